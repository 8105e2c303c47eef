"""Prometheus metrics, in a registry of the app's own (two apps in one process, as in tests,
never share counters). Cache hit ratio is kept as two counters (reused and prompt tokens),
so any time window's ratio is `rate(reused) / rate(prompt)`; the gauge shows the lifetime
value. A short in-memory series per tenant feeds the inspector's chart. The chunk-KV store's
own counters (hits, misses, evictions, bytes in RAM and on disk) are read when scraped."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

SERIES_POINTS = 500
COUNTED = ("hits", "misses", "evictions")


class ChunkCacheCollector:
    """Exports `stats()` of the chunk-KV store ({hits, misses, evictions, ram_bytes,
    disk_bytes, hit_ratio}) at scrape time; nothing while there is no store."""

    def __init__(self, stats: Callable[[], dict | None]):
        self.stats = stats

    def describe(self):
        return []

    def collect(self):
        st = self.stats()
        if not st:
            return
        for name, value in st.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if name in COUNTED:
                yield CounterMetricFamily(f"agentmem_kv_chunk_{name}", f"chunk-KV store {name}", value=value)
            else:
                yield GaugeMetricFamily(f"agentmem_kv_chunk_{name}", f"chunk-KV store {name}", value=value)


class Metrics:
    def __init__(self, chunk_stats: Callable[[], dict | None] | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("agentmem_requests_total", "HTTP requests", ["method", "route", "status"], registry=r)
        self.latency = Histogram("agentmem_request_seconds", "HTTP request latency", ["route"], registry=r)
        self.ttft = Histogram("agentmem_ttft_seconds", "time to first token of chat completions", registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64))
        self.prompt_tokens = Counter("agentmem_prompt_tokens_total", "prompt tokens", registry=r)
        self.completion_tokens = Counter("agentmem_completion_tokens_total", "completion tokens", registry=r)
        self.reused_tokens = Counter("agentmem_reused_tokens_total", "prompt tokens served from cached KV", registry=r)
        self.hit_ratio = Gauge("agentmem_cache_hit_ratio", "reused / prompt tokens since start", registry=r)
        self.queue = Gauge("agentmem_queue_length", "chat requests waiting for or in the engine", registry=r)
        self.rate_limited = Counter("agentmem_rate_limited_total", "requests refused by the rate limit", registry=r)
        self._lock = threading.Lock()
        self._prompt = self._reused = 0
        self._series: dict[str, deque] = {}
        if chunk_stats is not None:
            r.register(ChunkCacheCollector(chunk_stats))

    def observe_generation(self, tenant_id: str, prompt: int, completion: int, reused: int, ttft_s: float) -> None:
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)
        self.reused_tokens.inc(reused)
        self.ttft.observe(ttft_s)
        with self._lock:
            self._prompt += prompt
            self._reused += reused
            self.hit_ratio.set(self._reused / self._prompt if self._prompt else 0.0)
            series = self._series.setdefault(tenant_id, deque(maxlen=SERIES_POINTS))
            series.append({"time": time.time(), "prompt_tokens": prompt, "reused_tokens": reused,
                           "cache_hit_ratio": reused / prompt if prompt else 0.0, "ttft_s": ttft_s})

    def series(self, tenant_id: str) -> list[dict]:
        with self._lock:
            return list(self._series.get(tenant_id, ()))

    def forget_tenant(self, tenant_id: str) -> None:
        with self._lock:
            self._series.pop(tenant_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
