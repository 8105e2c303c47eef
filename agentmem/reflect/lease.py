"""Reflection leases: one replica at a time reflects a given user.

On PostgreSQL a lease is a session-level advisory lock on a key derived from (tenant, user),
taken with `pg_try_advisory_lock` on a connection of its own and held for the pass: a
replica that dies mid-pass loses its connection and with it the lock, so nothing has to
expire. Elsewhere (SQLite serves one process) a lock per user inside the process does.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import text


def lease_key(tenant_id: str, user_id: str) -> int:
    """A signed 64-bit key, as PostgreSQL's advisory locks take."""
    digest = hashlib.sha256(f"agentmem-reflect\x00{tenant_id}\x00{user_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class Leases:
    def __init__(self, sql_engine):
        self.sql = sql_engine
        self._pg = sql_engine.dialect.name == "postgresql"
        self._local: set[int] = set()
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, tenant_id: str, user_id: str) -> Iterator[bool]:
        """Yield True with the lease held for the block, or False at once if another replica
        (or thread) holds it."""
        key = lease_key(tenant_id, user_id)
        if self._pg:
            with self.sql.connect() as conn:
                got = bool(conn.execute(text("select pg_try_advisory_lock(:k)"), {"k": key}).scalar())
                conn.commit()
                try:
                    yield got
                finally:
                    if got:
                        conn.execute(text("select pg_advisory_unlock(:k)"), {"k": key})
                        conn.commit()
            return
        with self._lock:
            got = key not in self._local
            self._local.add(key)
        try:
            yield got
        finally:
            if got:
                with self._lock:
                    self._local.discard(key)
