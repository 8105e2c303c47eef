"""Deletions reach every replica at once: PostgreSQL `NOTIFY` / `LISTEN`.

Deleting a user or tenant removes the rows for everyone, but each replica also holds the
user in memory and on its own disk: open sessions, the recall index, chunk KV. The replica
that deletes runs its forget hooks and then notifies; every other replica on the database
listens and runs the same local forgetting (recall index dropped from memory and disk,
then the store's forget hooks: open sessions, cached KV, checkpoints). Without PostgreSQL
(SQLite serves one process) there is nobody to tell.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import uuid

log = logging.getLogger(__name__)
CHANNEL = "agentmem_forget"


class ForgetBroadcast:
    def __init__(self, store):
        self.store = store
        self.origin = uuid.uuid4().hex
        url = store.archive.engine.url
        self.database = hashlib.sha256(store.archive.url.encode()).hexdigest()[:16]
        self.enabled = url.get_backend_name() == "postgresql"
        self._conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        if self.enabled:
            store.forget_hooks.append(self.publish)

    def start(self) -> ForgetBroadcast:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._listen, name="agentmem-forget", daemon=True)
            self._thread.start()
            self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def publish(self, tenant_id: str, user_id: str | None) -> None:
        """The store's forget hook on the deleting replica: tell the others."""
        payload = json.dumps({"db": self.database, "origin": self.origin, "tenant": tenant_id, "user": user_id})
        from sqlalchemy import text

        with self.store.archive.engine.begin() as c:
            c.execute(text("select pg_notify(:ch, :p)"), {"ch": CHANNEL, "p": payload})

    def apply(self, tenant_id: str, user_id: str | None) -> None:
        """What the deleting replica did locally, on this one (the rows are gone already)."""
        if user_id is None:
            self.store.recall.drop_tenant(tenant_id)
        else:
            self.store.recall.drop(tenant_id, user_id)
        for hook in list(self.store.forget_hooks):
            if hook != self.publish:
                hook(tenant_id, user_id)

    def _listen(self) -> None:
        import psycopg

        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True) as conn:
                    conn.execute(f"listen {CHANNEL}")
                    self._ready.set()
                    while not self._stop.is_set():
                        for n in conn.notifies(timeout=0.5):
                            self._handle(n.payload)
            except Exception:  # the database went away: listen again (deletions meanwhile are
                log.exception("forget listener lost its connection")  # still caught per turn)
                self._ready.set()
                self._stop.wait(2.0)

    def _handle(self, payload: str) -> None:
        msg = json.loads(payload)
        if msg.get("db") != self.database or msg.get("origin") == self.origin:
            return
        try:
            self.apply(msg["tenant"], msg.get("user"))
        except Exception:
            log.exception("forgetting %s/%s on this replica failed", msg.get("tenant"), msg.get("user"))
