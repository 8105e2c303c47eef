"""`agentmem reflect [--tenant T] [--user U]`: run one reflection pass for one user, every
user of a tenant, or every user of every tenant. Progress goes to stderr; with --json the
last line of stdout is one JSON object with a report per user.

`agentmem reflect --watch` runs in the background instead (beside `agentmem serve`, on the
same database): every user is reflected after `--every-turns` new turns or `--idle` seconds
without one, until interrupted."""

from __future__ import annotations

import argparse
import json
import sys
import threading

from ..config import Config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentmem reflect", description=__doc__)
    p.add_argument("--tenant", help="tenant id (default: every tenant)")
    p.add_argument("--user", help="user id (default: every user of the tenant(s))")
    p.add_argument(
        "--no-model", action="store_true", help="templates only: no constrained decoding, no compression"
    )
    p.add_argument(
        "--max-model-sentences", type=int, default=None, help="cap on sentences sent to the model per user"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--watch", action="store_true", help="keep running: reflect users as they become due")
    p.add_argument("--every-turns", type=int, default=20, help="with --watch: new user turns that make a user due")
    p.add_argument("--idle", type=float, default=300.0, help="with --watch: idle seconds that make a user due")
    p.add_argument("--poll", type=float, default=5.0, help="with --watch: seconds between looks at the archive")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from ..tiers import MemoryStore

    config = Config()
    store = MemoryStore(config)
    if args.watch:
        return _watch(args, config, store)
    tenants = [args.tenant] if args.tenant else [t.id for t in store.list_tenants()]
    scope = [
        (t, u) for t in tenants for u in ([args.user] if args.user else [x.id for x in store.list_users(t)])
    ]
    if args.user and not any(store.archive.user_exists(t, u) for t, u in scope):
        print(f"agentmem reflect: no user {args.user!r} in tenant(s) {tenants}", file=sys.stderr)
        return 1
    engine, compressor = _model(args, config)
    extractor = _extractor(args, config)
    from .job import reflect

    reports = []
    for tenant_id, user_id in scope:
        if not store.archive.user_exists(tenant_id, user_id):
            continue
        r = reflect(
            store,
            engine,
            tenant_id,
            user_id,
            compressor=compressor,
            use_model=not args.no_model,
            max_model_sentences=args.max_model_sentences,
            extractor=extractor,
        )
        print(
            f"reflect {tenant_id}/{user_id}: {r.messages_read} messages, {len(r.facts_added)} facts added, "
            f"{r.merged} merged, {len(r.superseded)} superseded, {len(r.insights)} insights, {r.seconds:.1f}s",
            file=sys.stderr,
        )
        reports.append(r.to_dict())
    if args.json:
        print(json.dumps({"users": len(reports), "reports": reports}))
    return 0


def _extractor(args, config):
    """The remote engine's server as the extractor (AGENTMEM_REFLECT_ENGINE=remote), else None."""
    if args.no_model or config.reflect_engine != "remote":
        return None
    from .remote import remote_extractor

    return remote_extractor(config)


def _model(args, config):
    if args.no_model or config.reflect_engine in ("remote", "none"):
        return None, None
    from ..compress import Compressor
    from ..engine import Engine

    engine = Engine.load(config)
    return engine, Compressor(engine)


def _watch(args, config, store) -> int:
    from .trigger import ReflectionScheduler

    engine, compressor = _model(args, config)
    sched = ReflectionScheduler(
        store,
        engine,
        every_turns=args.every_turns,
        idle_s=args.idle,
        poll_s=args.poll,
        on_report=lambda r: print(json.dumps(r.to_dict()), flush=True),
        compressor=compressor,
        use_model=not args.no_model,
        max_model_sentences=args.max_model_sentences,
        extractor=_extractor(args, config),
    )
    print(f"agentmem reflect: watching {store.archive.url}", file=sys.stderr)
    sched.start()
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        sched.stop()
    return 0
