"""`RedisLink`: one Redis client per process, and what to do when Redis is away.

Every call goes through `call(use, fn, fallback)`: an error (connection refused, timeout)
marks Redis down for `retry_s`, counts a fallback for that use, and returns the fallback;
while down, calls go straight to the fallback without waiting on a socket, so a dead Redis
costs requests nothing but the shared state. The next call after `retry_s` tries again.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)
T = TypeVar("T")


class RedisLink:
    def __init__(self, url: str, timeout_s: float = 0.5, retry_s: float = 5.0, prefix: str = "agentmem:"):
        import redis

        self.url, self.prefix, self.retry_s = url, prefix, retry_s
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.errors = (redis.RedisError, OSError)
        self.fallbacks: dict[str, int] = {}
        self._down_until = 0.0
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def call(self, use: str, fn: Callable[[object], T], fallback: Callable[[], T]) -> T:
        """`fn(client)`, or `fallback()` if Redis is down or fails now (counted under `use`)."""
        if self.up:
            try:
                return fn(self.client)
            except self.errors as exc:
                with self._lock:
                    if self.up:
                        log.warning("redis at %s unreachable (%s): falling back to local state for %.0f s",
                                    self.url, exc, self.retry_s)
                    self._down_until = time.monotonic() + self.retry_s
        with self._lock:
            self.fallbacks[use] = self.fallbacks.get(use, 0) + 1
        return fallback()

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)


@functools.cache
def _link(url: str) -> RedisLink:
    return RedisLink(url)


def redis_link(url: str | None) -> RedisLink | None:
    """The process's link to `url` (one per URL: the rate limiter and the KV tier of one
    replica see Redis go down and come back together), or None without a URL."""
    return _link(url) if url else None


class RedisCollector:
    """Prometheus: `agentmem_redis_up` (0 while requests fall back to local state) and
    `agentmem_redis_fallbacks_total{use}` (calls served locally because Redis was away)."""

    def __init__(self, link: RedisLink):
        self.link = link

    def describe(self):
        return []

    def collect(self):
        yield GaugeMetricFamily("agentmem_redis_up", "1 while Redis answers, 0 while falling back to local state",
                                value=1 if self.link.up else 0)
        c = CounterMetricFamily("agentmem_redis_fallbacks", "calls served from local state because Redis was down",
                                labels=["use"])
        for use, n in sorted(self.link.fallbacks.items()):
            c.add_metric([use], n)
        yield c
