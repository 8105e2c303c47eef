"""The FastAPI app: `create_app(config, engine=None, store=None)`.

Everything the routes share lives on one `Services` object in `app.state`; nothing is a
module global, so tests can run several apps in one process. The model is loaded on first
use (or handed in), so the memory endpoints and the admin path never wait for it.
"""

from __future__ import annotations

import threading

from fastapi import FastAPI
from fastapi.responses import Response
from sqlalchemy import text

from ..cluster.forget import ForgetBroadcast
from ..config import Config
from ..tiers.store import MemoryStore
from . import errors
from .auth import KeyCache
from .chat import ChatService
from .disconnect import DisconnectWatch
from .guard import Guard
from .idempotency import Idempotency
from .kvcache import chunk_stats, drop_cached_kv
from .limits import BodyLimit, Limits, RateLimiter, TenantSlots
from .metrics import Metrics
from .operator import OperatorOnly
from .shared_rate import rate_limiter

KEY_CACHE_SECONDS = 5.0
KEY_CACHE_ENTRIES = 10_000


class Services:
    def __init__(self, config: Config, engine, store: MemoryStore, limits: Limits, serial: bool = False):
        self.config = config
        self.store = store
        self.limits = limits
        self.metrics = Metrics(chunk_stats=self.chunk_stats)
        self.rate = rate_limiter(config.redis_url, limits.rate_per_minute)  # shared through Redis when set
        if config.redis_url:
            from ..cluster import RedisCollector, redis_link

            self.metrics.registry.register(RedisCollector(redis_link(config.redis_url)))
        self.slots = TenantSlots(limits.tenant_concurrency, limits.tenant_wait_s, limits.tenant_queue)
        self.chat_slots = TenantSlots(limits.tenant_chats, limits.tenant_wait_s, limits.tenant_queue, "chat turns")
        self.failed_auth = RateLimiter(limits.failed_auth_per_minute, max_keys=limits.rate_clients)
        self._engine = engine
        self._engine_lock = threading.Lock()
        self._local = None
        self.keys = KeyCache(store.tenant_for_key_hash, KEY_CACHE_ENTRIES, KEY_CACHE_SECONDS)
        self.reflection = None  # a ReflectionScheduler once start_reflection() ran
        self.chat = ChatService(config, store, self.engine, limits, serial=serial)
        store.forget_hooks.append(self._forget)
        # replicas on PostgreSQL: a deletion on another replica runs the same local forgetting here
        self.forget_broadcast = ForgetBroadcast(store).start()

    def engine(self):
        """The engine, loaded on first use."""
        with self._engine_lock:
            if self._engine is None:
                from ..engine import load_engine

                self._engine = load_engine(self.config)
            return self._engine

    def local_engine(self):
        """The embedded engine reflection and compression run on: the engine itself, or one
        loaded beside a remote engine (they read the model's tensors)."""
        from ..engine import local_engine

        engine = self.engine()
        with self._engine_lock:
            if self._local is None:
                self._local = local_engine(engine, self.config)
            return self._local

    @property
    def engine_loaded(self) -> bool:
        return self._engine is not None

    def tenant_for_key(self, key_hash: str, fresh: bool = False) -> str | None:
        """Key lookups are cached briefly (reads); `fresh` asks the database (writes)."""
        return self.keys.get(key_hash, fresh)

    def start_reflection(self, every_turns: int = 20, idle_s: float = 300.0, poll_s: float = 5.0):
        """Offline reflection beside the service, in its own thread, never on a request's path:
        users become due after `every_turns` new turns or `idle_s` idle seconds. The model is
        loaded only when a user is first due; the compressor is built on the same model.
        `reflect_engine` "none": no model at all, the fact templates alone and no compression
        (a replica beside a remote engine then loads nothing)."""
        from ..compress import Compressor
        from ..reflect.trigger import ReflectionScheduler

        if self.config.reflect_engine not in ("local", "remote", "none"):
            raise ValueError("AGENTMEM_REFLECT_ENGINE must be local, remote or none, got "
                             f"{self.config.reflect_engine!r}")
        if self.config.reflect_engine == "remote":  # the remote engine's server extracts (reflect/remote.py)
            from ..reflect.remote import remote_extractor

            self.reflection = ReflectionScheduler(self.store, None, every_turns=every_turns, idle_s=idle_s,
                                                  poll_s=poll_s, use_model=False,
                                                  extractor=remote_extractor(self.config, self.engine))
        elif self.config.reflect_engine == "none":
            self.reflection = ReflectionScheduler(self.store, None, every_turns=every_turns, idle_s=idle_s,
                                                  poll_s=poll_s, use_model=False)
        else:
            self.reflection = ReflectionScheduler(self.store, self.local_engine, every_turns=every_turns,
                                                  idle_s=idle_s, poll_s=poll_s, compressor=Compressor)
        return self.reflection.start()

    def chunk_stats(self) -> dict | None:
        return chunk_stats(self._engine)

    def _forget(self, tenant_id: str, user_id: str | None) -> None:
        self.chat.forget(tenant_id, user_id)
        # chunk KV is namespaced by tenant (users of a tenant share chunks such as the system
        # prompt), so a deleted user's chunks can only be dropped with their tenant's
        drop_cached_kv(self.config, self._engine, tenant_id)
        if user_id is None:
            self.metrics.forget_tenant(tenant_id)
            self.rate.forget(tenant_id)
            self.slots.forget(tenant_id)
            self.chat_slots.forget(tenant_id)
            self.keys.drop_tenant(tenant_id)
            # a turn of the tenant still running may store chunks after the drop above: drop
            # them again when its last one ends
            self.chat_slots.after_running(tenant_id, lambda: drop_cached_kv(self.config, self._engine, tenant_id))


def _mount_mcp(app: FastAPI, services: Services) -> None:
    """MCP over streamable HTTP at `/mcp`, where the `mcp` extra is installed; else `/mcp`
    says which extra it needs."""
    try:
        from ..integrations import mcp_server
    except ImportError as exc:
        message = str(exc)

        @app.api_route("/mcp", methods=["GET", "POST", "DELETE"], include_in_schema=False)
        def mcp_missing() -> None:
            raise errors.ApiError(501, message, "not_implemented_error", "mcp_not_installed")

        return
    mcp_server.mount(app, services)


def create_app(config: Config | None = None, engine=None, store: MemoryStore | None = None,
               limits: Limits | None = None, ui: bool = True, serial: bool = False,
               reflect_every_turns: int | None = None, reflect_idle_s: float = 300.0) -> FastAPI:
    """The service. `serial=True` answers one chat at a time (the benchmark's peer).
    `reflect_every_turns` starts background reflection (off by default here so embedding
    apps and tests stay deterministic; `agentmem serve` turns it on)."""
    from .chat_routes import router as chat_router
    from .memory_routes import router as memory_router

    config = config or Config()
    store = store or MemoryStore(config)
    if not config.embed_bulk_threads:  # auto: indexing leaves half the cores to the engine and queries
        import torch

        store.set_bulk_threads(max(1, torch.get_num_threads() // 2))
    services = Services(config, engine, store, limits or Limits(), serial=serial)
    app = FastAPI(title="agentmem", version="0.1.0",
                  description="Long-term memory for chat assistants, OpenAI-compatible, multi-tenant.")
    app.state.services = services
    if reflect_every_turns:
        services.start_reflection(reflect_every_turns, reflect_idle_s)
        # a pass cut short at shutdown resumes where it stopped (the checkpoint advances per message)
        app.router.on_shutdown.append(lambda: services.reflection.stop(5))
    app.router.on_shutdown.append(services.forget_broadcast.stop)
    errors.install(app)
    app.add_middleware(DisconnectWatch)
    app.add_middleware(Idempotency, services=services)  # inside the body limit: it reads whole bodies
    app.add_middleware(BodyLimit, limits=services.limits)
    app.add_middleware(OperatorOnly, operator_key=config.operator_key)
    app.add_middleware(Guard, metrics=services.metrics)  # outermost: counts the body limit's 413s too

    @app.get("/healthz", tags=["service"])
    def healthz() -> dict:
        """Liveness and readiness: the database answers; whether the model and the embedder are
        loaded yet (`serve --preload` loads both before it accepts requests)."""
        with store.archive.engine.connect() as conn:
            conn.execute(text("select 1"))
        return {"status": "ok", "model_loaded": services.engine_loaded,
                "embedder_loaded": store.embedder_loaded}

    @app.get("/metrics", tags=["service"], response_class=Response)
    def metrics() -> Response:
        """Prometheus exposition format."""
        return Response(services.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(chat_router)
    app.include_router(memory_router)
    _mount_mcp(app, services)
    if ui:
        from .ui import mount_ui

        mount_ui(app)
    return app
