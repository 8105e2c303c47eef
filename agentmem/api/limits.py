"""Service limits: each one refuses with a 4xx JSON error before any work is done.

Body size is enforced on the raw ASGI stream (a missing or lying Content-Length cannot get
past it); the rate limit is a token bucket per tenant, so one noisy tenant cannot starve
the others of the engine.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cachetools import LRUCache

from .errors import ApiError, error_body


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_message_chars: int = 32_000
    max_messages: int = 256
    max_tokens: int = 1024
    rate_per_minute: float = 600.0  # per tenant; burst = one minute's worth
    max_import_bytes: int = 16 << 20  # import documents may be larger than other bodies
    max_import_messages: int = 50_000  # rows of one import document, refused before any row is read
    max_import_memories: int = 20_000
    max_import_sessions: int = 10_000
    max_import_blocks: int = 100
    tenant_concurrency: int = 4  # memory writes, searches, imports one tenant runs at once (0: unlimited)
    tenant_chats: int = 16  # chat turns one tenant runs at once (0: unlimited)
    tenant_queue: int = 64  # a tenant's requests waiting for one of those beyond which it gets 429 at once
    tenant_wait_s: float = 120.0  # how long a request waits for one of them before a 429
    failed_auth_per_minute: float = 30.0  # per client address: guessing keys is slow
    rate_clients: int = 100_000  # addresses (or tenants) a rate limiter remembers at most


class TooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: 413 when the request body exceeds the limit."""

    def __init__(self, app, limits: Limits):
        self.app = app
        self.limits = limits

    def _limit_for(self, scope) -> int:
        if scope.get("method") == "POST" and scope.get("path", "").endswith("/import"):
            return self.limits.max_import_bytes
        return self.limits.max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self._limit_for(scope)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await _reply(send, 400, "invalid Content-Length", "invalid_request_error", "bad_length")
                if declared > limit:
                    return await _too_large(send, limit)
        seen = 0
        started = over = False

        async def counted_receive():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    raise TooLarge
            return message

        async def tracked_send(message):
            # the app may catch TooLarge while reading the body (FastAPI turns it into a 400
            # "error parsing the body"): whatever it answers then, the answer is our 413
            nonlocal started
            if over:
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await _too_large(send, limit)
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except TooLarge:
            if not started:
                await _too_large(send, limit)


async def _too_large(send, limit: int) -> None:
    await _reply(send, 413, f"request body exceeds {limit} bytes", "request_too_large", "body_too_large")


async def _reply(send, status: int, message: str, type_: str, code: str) -> None:
    body = json.dumps(error_body(message, type_, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RateLimiter:
    """Token bucket per key: `rate_per_minute` sustained, bursts up to one minute's worth."""

    def __init__(self, rate_per_minute: float, max_keys: int = 100_000):
        self.rate = rate_per_minute / 60.0
        self.burst = max(1.0, rate_per_minute)
        # least recently used buckets go first: a forgotten bucket is a full one, which is
        # what a key that has been idle for a minute would have anyway
        self._buckets: LRUCache = LRUCache(maxsize=max_keys)
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """Spend one token; 0.0 if allowed, else the seconds until one is available."""
        if self.rate <= 0:
            return 0.0
        return self._take(key, spend=True)

    def check(self, key: str) -> float:
        """The seconds until `key` has a token again, spending nothing (0.0: it has one)."""
        if self.rate <= 0:
            return 0.0
        return self._take(key, spend=False)

    def _take(self, key: str, spend: bool) -> float:
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0 if spend else tokens, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate

    def forget(self, key: str) -> None:
        with self._lock:
            self._buckets.pop(key, None)


class TenantSlots:
    """At most `limit` of one tenant's requests of a kind run at once; the next `queue` wait
    their turn in their own tenant's queue (up to `wait_s`), and any beyond those are
    refused at once with 429 and Retry-After. A tenant firing 100 requests at once thus
    holds `limit` threads' worth of CPU and `queue` idle threads, never the whole thread
    pool, and every other tenant's requests go on as if it were quiet."""

    def __init__(self, limit: int, wait_s: float, queue: int = 64, what: str = "memory requests"):
        self.limit, self.wait_s, self.queue, self.what = limit, wait_s, queue, what
        self._slots: dict[str, threading.BoundedSemaphore] = {}
        self._waiting: dict[str, int] = {}
        self._running: dict[str, int] = {}
        self._when_idle: dict[str, list[Callable[[], None]]] = {}
        self._lock = threading.Lock()

    def _busy(self, why: str) -> ApiError:
        return ApiError(429, f"{why}; retry later", "rate_limit_error", "too_many_concurrent",
                        headers={"Retry-After": "1"})

    def enter(self, tenant_id: str) -> Callable[[], None]:
        """Take one of the tenant's slots; returns the function that gives it back (calling
        it again does nothing)."""
        if self.limit <= 0:
            with self._lock:
                self._running[tenant_id] = self._running.get(tenant_id, 0) + 1
            return _once(lambda: self._left(tenant_id, None))
        with self._lock:
            slot = self._slots.setdefault(tenant_id, threading.BoundedSemaphore(self.limit))
            if slot.acquire(blocking=False):
                self._running[tenant_id] = self._running.get(tenant_id, 0) + 1
                return _once(lambda: self._left(tenant_id, slot))
            if self._waiting.get(tenant_id, 0) >= self.queue:
                raise self._busy(f"{self.limit} {self.what} of this tenant are running and {self.queue} waiting")
            self._waiting[tenant_id] = self._waiting.get(tenant_id, 0) + 1
        try:
            got = slot.acquire(timeout=self.wait_s)
        finally:
            with self._lock:
                left = self._waiting.pop(tenant_id) - 1
                if left:
                    self._waiting[tenant_id] = left
        if not got:
            raise self._busy(f"more than {self.limit} {self.what} of this tenant are running")
        with self._lock:
            self._running[tenant_id] = self._running.get(tenant_id, 0) + 1
        return _once(lambda: self._left(tenant_id, slot))

    def _left(self, tenant_id: str, slot: threading.BoundedSemaphore | None) -> None:
        if slot is not None:
            slot.release()
        with self._lock:
            left = self._running.pop(tenant_id, 1) - 1
            if left > 0:
                self._running[tenant_id] = left
                return
            hooks = self._when_idle.pop(tenant_id, [])
        for hook in hooks:
            hook()

    def after_running(self, tenant_id: str, hook: Callable[[], None]) -> bool:
        """Call `hook` when the last of the tenant's requests of this kind running now ends;
        False (and no call) when none runs. A deleted tenant's turns still in flight may
        write cached KV after its deletion dropped it: this drops it again."""
        with self._lock:
            if self._running.get(tenant_id, 0) <= 0:
                return False
            self._when_idle.setdefault(tenant_id, []).append(hook)
            return True

    @contextmanager
    def hold(self, tenant_id: str) -> Iterator[None]:
        release = self.enter(tenant_id)
        try:
            yield
        finally:
            release()

    def forget(self, tenant_id: str) -> None:
        with self._lock:
            self._slots.pop(tenant_id, None)


def _once(release: Callable[[], None]) -> Callable[[], None]:
    done = threading.Lock()

    def give_back() -> None:
        if done.acquire(blocking=False):
            release()

    return give_back
