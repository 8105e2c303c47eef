"""A real agentmem server for the API tests: one store on a data dir of the test's own, its
tenants each with a key, the app on a loopback port (`LocalServer`), the store closed after.

    with serve(engine, embedder, tmp_path, tenants=("acme",), max_tokens=16) as s:
        c = s.client("acme")

Keyword arguments other than those named are the server's `Limits` (the test states the ones
it relies on)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from agentmem.api import Limits, create_app, create_tenant_with_key
from agentmem.api.local import LocalServer
from agentmem.tiers.store import MemoryStore


@dataclass
class Served:
    server: LocalServer
    store: MemoryStore
    keys: dict[str, tuple[str, str]]  # tenant name -> (tenant id, API key)

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, tenant: str, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.keys[tenant][1]}"},
                            timeout=timeout)


@contextmanager
def serve(engine, embedder, data: Path, *, tenants: tuple[str, ...] = ("acme",), db_url: str | None = None,
          ui: bool = False, serial: bool = False, config: dict | None = None, **limits) -> Iterator[Served]:
    """The engine's config on `data` (the chunk KV under data/chunks, so a deleted tenant's
    chunks are dropped from there) and `db_url` (None: SQLite in `data`); `serial`: the
    server answers one chat at a time (the bench's peer); `config`: further Config fields."""
    cfg = engine.config.model_copy(update={"data_dir": data, "db_url": db_url, "kv_disk_dir": data / "chunks",
                                           **(config or {})})
    store = MemoryStore(cfg, embedder=embedder)
    try:
        keys = {name: create_tenant_with_key(store, name) for name in tenants}
        with LocalServer(create_app(cfg, engine=engine, store=store, limits=Limits(**limits), ui=ui,
                                           serial=serial)) as server:
            yield Served(server, store, keys)
    finally:
        store.close()
