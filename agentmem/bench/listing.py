"""`agentmem bench listing`: REST listings of a large tenant, a page and every page.

One tenant with `--users` users (2,000), each with `--sessions` sessions (2,000; every user,
so the sessions table holds users x sessions rows), and one session with `--messages`
messages, all inserted straight into the archive in bulk (no chat, no embedding). A real
server on a loopback port then answers, per listing (users, one user's sessions, one
session's messages): the first page at the default limit and at the maximum (response bytes,
median latency of `--repeat` requests) and a walk of every page at the default limit
(pages, bytes, seconds). No model is loaded. Prints JSON last.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path


def fill(store, tenant_id: str, users: int, sessions: int, messages: int, ) -> dict:
    """Bulk rows: users u00000.., each with sessions s00000.. (one microsecond apart), and
    `messages` messages in u00000's s00000. Returns the seconds it took."""
    from sqlalchemy import insert

    from ..tiers.schema import MessageRow, SessionRow, UserRow

    t0 = time.perf_counter()
    base = datetime(2026, 1, 1)
    with store.archive.tx() as s:
        s.execute(insert(UserRow), [{"tenant_id": tenant_id, "id": f"u{u:05d}", "created_at": base}
                                    for u in range(users)])
    # sessions through the driver's executemany (SQLite; SQLAlchemy's own time format): a
    # few million rows in seconds rather than minutes
    sql = f"INSERT INTO {SessionRow.__tablename__} (tenant_id, user_id, id, agent_id, created_at) VALUES (?, ?, ?, ?, ?)"
    times = [(base + timedelta(microseconds=i)).strftime("%Y-%m-%d %H:%M:%S.%f") for i in range(sessions)]
    names = [f"s{i:05d}" for i in range(sessions)]
    with store.archive.engine.begin() as conn:
        for u in range(users):
            uid = f"u{u:05d}"
            conn.exec_driver_sql(sql, [(tenant_id, uid, names[i], "default", times[i]) for i in range(sessions)])
    if messages:
        with store.archive.tx() as s:
            s.execute(insert(MessageRow), [
                {"tenant_id": tenant_id, "user_id": "u00000", "session_id": "s00000",
                 "role": "user" if i % 2 == 0 else "assistant", "text": f"message {i}: " + "words " * 20,
                 "created_at": base + timedelta(seconds=i)} for i in range(messages)])
    return {"fill_s": round(time.perf_counter() - t0, 2)}


def measure(client, path: str, default: int, maximum: int, repeat: int) -> dict:
    def one(params: dict) -> tuple[float, int, dict]:
        t = time.perf_counter()
        r = client.get(path, params=params)
        dt = time.perf_counter() - t
        r.raise_for_status()
        return dt, len(r.content), r.json()

    out: dict = {}
    for name, limit in (("page_default", default), ("page_max", maximum)):
        runs = [one({"limit": limit}) for _ in range(repeat)]
        out[name] = {"limit": limit, "rows": len(runs[0][2]["data"]), "bytes": runs[0][1],
                     "p50_ms": round(statistics.median(r[0] for r in runs) * 1000, 2)}
    t0 = time.perf_counter()
    pages, total, rows, cursor, slowest = 0, 0, 0, None, 0.0
    while True:
        dt, n, body = one({"limit": default, **({"cursor": cursor} if cursor else {})})
        pages, total, rows, slowest = pages + 1, total + n, rows + len(body["data"]), max(slowest, dt)
        cursor = body["next_cursor"]
        if cursor is None:
            break
    out["walk"] = {"limit": default, "pages": pages, "rows": rows, "bytes": total,
                   "seconds": round(time.perf_counter() - t0, 3), "slowest_page_ms": round(slowest * 1000, 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentmem bench listing", description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=2000)
    ap.add_argument("--sessions", type=int, default=2000, help="sessions per user (every user)")
    ap.add_argument("--messages", type=int, default=2000, help="messages in one session")
    ap.add_argument("--repeat", type=int, default=5, help="requests per single-page figure (median)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    if args.quick:
        args.users, args.sessions, args.messages, args.repeat = 300, 300, 300, 2
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))

    import httpx

    from ..api import create_app, create_tenant_with_key
    from ..api.local import LocalServer
    from ..api.pages import DEFAULT_LIMIT, MAX_LIMIT
    from ..config import Config
    from ..tiers.store import MemoryStore

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Config(data_dir=Path(tmp))
        store = MemoryStore(cfg)
        try:
            tenant_id, key = create_tenant_with_key(store, "bench")
            log(f"inserting {args.users} users x {args.sessions} sessions, {args.messages} messages ...")
            result: dict = {"users": args.users, "sessions_per_user": args.sessions, "messages": args.messages,
                            "db": "sqlite", **fill(store, tenant_id, args.users, args.sessions, args.messages), "listings": {}}
            log(f"filled in {result['fill_s']} s")
            logging.getLogger("httpx").setLevel(logging.WARNING)
            with LocalServer(create_app(cfg, store=store, ui=False)) as server, \
                    httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as c:
                for name, path in (("users", "/v1/users"), ("sessions", "/v1/users/u00000/sessions"),
                                   ("messages", "/v1/users/u00000/sessions/s00000/messages")):
                    c.get(path).raise_for_status()  # warm: the first request of a server pays for imports
                    result["listings"][name] = measure(c, path, DEFAULT_LIMIT, MAX_LIMIT, args.repeat)
                    log(name, json.dumps(result["listings"][name]))
        finally:
            store.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
