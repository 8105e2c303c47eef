"""`agentmem serve`: run the REST service with uvicorn.

Embedded defaults: SQLite under the data dir and the default model; `--db-url` points at
PostgreSQL for several replicas. One worker process per replica, because the engine (and
its KV cache) lives in the process; concurrency comes from the engine's batching.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .limits import Limits


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentmem serve", description="run the multi-tenant REST service")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--db-url", help="SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db (default: SQLite)")
    p.add_argument("--data-dir", type=Path, help="where SQLite, recall indexes and caches live")
    p.add_argument("--model-path", type=Path, help="an HF Llama-family checkpoint directory (default: SmolLM2-135M)")
    p.add_argument("--device", help="auto | cpu | cuda")
    p.add_argument("--dtype", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-batch", type=int, help="requests decoded together by the engine")
    p.add_argument("--preload", action="store_true",
                   help="load the model and the embedder before accepting requests")
    d = Limits()
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--max-message-chars", type=int, default=d.max_message_chars)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="largest max_tokens a request may ask")
    p.add_argument("--rate-limit", type=float, default=d.rate_per_minute,
                   help="requests per minute per tenant (0: unlimited)")
    p.add_argument("--tenant-concurrency", type=int, default=d.tenant_concurrency,
                   help="memory writes/searches/imports one tenant runs at once; the rest wait (0: unlimited)")
    p.add_argument("--tenant-chats", type=int, default=d.tenant_chats,
                   help="chat turns one tenant runs at once; the rest wait (0: unlimited)")
    p.add_argument("--tenant-queue", type=int, default=d.tenant_queue,
                   help="a tenant's requests that may wait for those; past them 429 with Retry-After at once")
    p.add_argument("--serial", action="store_true",
                   help="answer one chat at a time instead of batching (the peer of `agentmem bench serve`)")
    p.add_argument("--reflect-every-turns", type=int, default=20,
                   help="background reflection: a user is due after this many new turns (0: off)")
    p.add_argument("--reflect-idle", type=float, default=300.0,
                   help="background reflection: ... or after this many idle seconds")
    p.add_argument("--no-ui", action="store_true", help="do not serve the inspector page at /ui")
    p.add_argument("--log-level", default="info")
    return p


def config_from(args: argparse.Namespace):
    from ..config import Config

    overrides = {k: v for k, v in {"db_url": args.db_url, "data_dir": args.data_dir, "model_path": args.model_path,
                                   "device": args.device, "dtype": args.dtype, "max_batch": args.max_batch}.items()
                 if v is not None}
    return Config(**overrides)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    import os

    import uvicorn

    from .app import create_app
    from .logs import log_config

    os.umask(0o077)  # every file the service writes (database, recall index, chunk KV) is 0600

    config = config_from(args)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_message_chars=args.max_message_chars,
                    max_tokens=args.max_tokens, rate_per_minute=args.rate_limit,
                    tenant_concurrency=args.tenant_concurrency, tenant_chats=args.tenant_chats,
                    tenant_queue=args.tenant_queue)
    engine = None
    if args.preload:
        from ..engine import load_engine

        engine = load_engine(config)
    app = create_app(config, engine=engine, limits=limits, ui=not args.no_ui, serial=args.serial,
                     reflect_every_turns=args.reflect_every_turns, reflect_idle_s=args.reflect_idle)
    if args.preload:  # the embedder too: its load (~1.5-3 s) had landed on the first search or chat
        app.state.services.store.embedder_instance()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                log_config=log_config())
    return 0
