"""`agentmem tenant create NAME | list | delete ID | key ID | fix-ids [ID]`: tenants, API keys,
and the one-time repair of ids stored before they were checked (`tiers/fix_ids.py`).

A key is printed once, when it is made; only its sha256 is stored, so a lost key cannot be
recovered, only replaced (`key`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .auth import create_tenant_with_key, hash_key, new_key
from .kvcache import drop_cached_kv


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentmem tenant", description="manage tenants and their API keys")
    p.add_argument("--db-url", help="SQLAlchemy URL (default: SQLite under the data dir)")
    p.add_argument("--data-dir", type=Path)
    p.add_argument("--json", action="store_true", help="print JSON")
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("create", help="create a tenant and print its first API key")
    c.add_argument("name")
    sub.add_parser("list", help="list tenants")
    d = sub.add_parser("delete", help="delete a tenant with all its users' memory")
    d.add_argument("tenant_id")
    k = sub.add_parser("key", help="add another API key to a tenant and print it")
    k.add_argument("tenant_id")
    k.add_argument("--name", default="")
    f = sub.add_parser("fix-ids", help="rename (or --delete) users and sessions whose ids no URL can carry, "
                                       "printing old -> new; run with the service stopped")
    f.add_argument("tenant_id", nargs="?", help="only this tenant (default: every tenant)")
    f.add_argument("--delete", action="store_true", help="delete those users and sessions instead")
    f.add_argument("--dry-run", action="store_true", help="only print what would change")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from ..config import Config
    from ..tiers.records import InvalidInput, NotFound
    from ..tiers.store import MemoryStore

    overrides = {k: v for k, v in {"db_url": args.db_url, "data_dir": args.data_dir}.items() if v is not None}
    store = MemoryStore(Config(**overrides))
    try:
        if args.action == "create":
            tenant_id, key = create_tenant_with_key(store, args.name)
            _out(args, {"tenant_id": tenant_id, "name": args.name, "api_key": key},
                 f"tenant {tenant_id} ({args.name})\napi key (shown once): {key}")
        elif args.action == "key":
            key = new_key()
            store.add_api_key(args.tenant_id, hash_key(key), args.name)
            _out(args, {"tenant_id": args.tenant_id, "api_key": key}, f"api key (shown once): {key}")
        elif args.action == "list":
            tenants = [t.to_dict() for t in store.list_tenants()]
            _out(args, {"tenants": tenants}, "\n".join(f"{t['id']}  {t['name']}  {t['created_at']}" for t in tenants))
        elif args.action == "fix-ids":
            from ..tiers.fix_ids import fix_ids

            out = fix_ids(store, args.tenant_id, delete=args.delete, dry_run=args.dry_run)
            _out(args, out, _fixed_text(out))
        else:
            store.delete_tenant(args.tenant_id)
            drop_cached_kv(store.config, None, args.tenant_id)
            _out(args, {"tenant_id": args.tenant_id, "deleted": True}, f"deleted tenant {args.tenant_id}")
    except (NotFound, InvalidInput) as exc:
        print(f"agentmem tenant: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    return 0


def _fixed_text(out: dict) -> str:
    verb = "would " if out["dry_run"] else ""
    lines = [f"{t['tenant_id']}  user {t['old']!r} -> " + (repr(t["new"]) if t["new"] else f"{verb}deleted")
             for t in out["users"]]
    lines += [f"{t['tenant_id']}  user {t['user_id']!r} session {t['old']!r} -> "
              + (repr(t["new"]) if t["new"] else f"{verb}deleted") for t in out["sessions"]]
    return "\n".join(lines) or "every user and session id is addressable: nothing to fix"


def _out(args, data: dict, text: str) -> None:
    print(json.dumps(data) if args.json else text)
