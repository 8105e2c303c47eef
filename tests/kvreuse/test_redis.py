"""Redis shared by replicas: rate limits across replicas, the shared chunk-KV tier, and what
happens when Redis stops mid-run. Each test starts its own `redis-server` on a free port
(the machine's shared Redis is never stopped)."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest
import torch

from agentmem.api import Limits, create_app, create_tenant_with_key
from agentmem.api.local import LocalServer, free_port
from agentmem.api.shared_rate import SharedRateLimiter
from agentmem.cluster import RedisCollector, RedisLink
from agentmem.config import Config
from agentmem.kvreuse import ChunkKV, ChunkStore
from agentmem.kvreuse.shared_tier import SharedTier
from agentmem.tiers import MemoryStore


class RedisServer:
    def __init__(self, tmp_path):
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        self.port, self.dir = free_port(), tmp_path
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                              text=True).stdout.strip() == "PONG":
                return self
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def _link(url: str) -> RedisLink:
    return RedisLink(url, timeout_s=0.3, retry_s=0.5)  # one per replica, as in two processes


def test_rate_limit_holds_across_replicas_and_falls_back_when_redis_stops(redis_server):
    a, b = (SharedRateLimiter(_link(redis_server.url), rate_per_minute=6) for _ in range(2))
    allowed = [lim.take("tenant-1") == 0.0 for _ in range(5) for lim in (a, b)]
    assert allowed.count(True) == 6  # one minute's burst, shared: not 6 per replica
    assert a.take("tenant-2") == 0.0  # tenants have buckets of their own
    redis_server.stop()
    assert a.take("tenant-1") == 0.0  # served from the replica's own bucket
    assert a.link.fallbacks["rate_limit"] >= 1 and not a.link.up
    families = {f.name: f for f in RedisCollector(a.link).collect()}
    assert families["agentmem_redis_up"].samples[0].value == 0
    assert families["agentmem_redis_fallbacks"].samples[0].labels == {"use": "rate_limit"}


def test_rate_limit_across_two_services(redis_server, tmp_path, embedder):
    cfg = Config(data_dir=tmp_path, redis_url=redis_server.url)
    store = MemoryStore(cfg, embedder=embedder)
    _, key = create_tenant_with_key(store, "limited")
    limits = Limits(rate_per_minute=8)
    with LocalServer(create_app(cfg, store=store, limits=limits, ui=False)) as one, \
            LocalServer(create_app(cfg, store=store, limits=limits, ui=False)) as two:
        codes = [httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code
                 for _ in range(6) for s in (one, two)]
        assert codes.count(200) == 8 and codes.count(429) == 4
        metrics = httpx.get(one.url + "/metrics").text
        assert "agentmem_redis_up 1.0" in metrics
    store.close()


def _kv(seed: int, tokens: int = 8) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    return ChunkKV(torch.randn(2, tokens, 3, 4, generator=g), torch.randn(2, tokens, 3, 4, generator=g))


def test_shared_kv_tier_between_replicas(redis_server):
    tiers = [SharedTier(_link(redis_server.url), budget=1 << 20) for _ in range(2)]
    a, b = (ChunkStore([("cpu", 1 << 20)], shared=t) for t in tiers)
    a.put("k1", "tenant-a", _kv(1))
    a.put("k2", "tenant-b", _kv(2))
    tiers[0].flush()
    got = b.get("k1")  # computed on replica a, found on replica b
    assert got is not None and torch.equal(got.k, _kv(1).k) and torch.equal(got.v, _kv(1).v)
    assert b.stats()["redis_hits"] == 1 and "k1" in b

    # a corrupt value is a miss, and is deleted
    client = tiers[0].link.client
    raw = bytearray(client.get("agentmem:kv:k2"))
    raw[-1] ^= 0xFF
    client.set("agentmem:kv:k2", bytes(raw))
    assert b.get("k2") is None and client.get("agentmem:kv:k2") is None and tiers[1].corrupt == 1

    # a deleted tenant's chunks leave Redis, others stay
    a.put("k3", "tenant-b", _kv(3))
    tiers[0].flush()
    assert a.drop_namespace("tenant-b") >= 1
    assert client.get("agentmem:kv:k3") is None and client.get("agentmem:kv:k1") is not None


def test_shared_kv_tier_is_bounded_and_survives_redis_stopping(redis_server):
    one = len(__import__("agentmem.kvreuse.store", fromlist=["pack"]).pack("k0", "t", _kv(0)))
    tier = SharedTier(_link(redis_server.url), budget=3 * one + 10)
    store = ChunkStore([("cpu", 1 << 20)], shared=tier)
    for i in range(6):
        store.put(f"k{i}", "t", _kv(i))
        tier.flush()
    client = tier.link.client
    assert int(client.get("agentmem:kv-bytes")) <= 3 * one + 10
    assert [client.exists(f"agentmem:kv:k{i}") for i in range(6)] == [0, 0, 0, 1, 1, 1]  # least recent out
    assert tier.evictions == 3

    redis_server.stop()
    other = ChunkStore([("cpu", 1 << 20)], shared=SharedTier(tier.link, budget=1 << 20))
    assert other.get("k5") is None  # a miss, not an error: the replica recomputes
    store.put("k9", "t", _kv(9))  # queued and dropped by the writer, never raised
    tier.flush()
    assert store.get("k9") is not None  # local tiers still serve
    assert tier.link.fallbacks["shared_kv"] >= 2

    redis_server.start()  # back: the link retries after its pause
    time.sleep(0.6)
    store.put("k10", "t", _kv(10))
    tier.flush()
    assert client.get("agentmem:kv:k10") is not None and tier.link.up


def _model_like(seed: int, tokens: int = 40) -> ChunkKV:
    """bf16 KV shaped like a model's (K with a few large channels shared by every token)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(4, tokens, 3, 64, generator=g)
    k[..., :4] = k[..., :4] * 0.3 + 12.0 * torch.randn(4, 1, 3, 4, generator=g)
    v = torch.randn(4, tokens, 3, 64, generator=g) * 0.5
    return ChunkKV(k.bfloat16(), v.bfloat16(), context="ctx")


@pytest.mark.parametrize("codec,most", [("int8", 0.6), ("int4", 0.35)])
def test_shared_kv_tier_carries_compressed_kv_between_replicas(redis_server, tmp_path, codec, most):
    """Replica a writes a chunk through Redis in the store's codec; replica b reads it back
    within the codec's error bound, counts the bytes it read, and keeps a copy on its own disk
    (its RAM has no room), so the next read of it is the disk's, not Redis's again."""
    from agentmem.kvreuse import codec as kvcodec

    tiers = [SharedTier(_link(redis_server.url), budget=1 << 24) for _ in range(2)]
    a = ChunkStore([("cpu", 1 << 24)], shared=tiers[0], codec=codec)
    b = ChunkStore([("cpu", 1024)], tmp_path / "disk-b", 1 << 24, shared=tiers[1], codec=codec)
    kv = _model_like(1)
    a.put("k1", "tenant-a", kv)
    a.put("k2", "tenant-a", _model_like(2))
    tiers[0].flush()
    client = tiers[0].link.client
    value = client.get("agentmem:kv:k1")
    assert kvcodec.codec_of(value) == codec and len(value) <= most * kv.nbytes

    got, info = b.lookup("k1", tokens=40)
    assert info["tier"] == "redis" and got.quantized and got.context == kv.context  # lossy, in the context it was computed in
    for name, ref, back in (("k", kv.k, got.k), ("v", kv.v, got.v)):
        err = (back.float() - ref.float()).abs().amax(dim=(1, 2, 3))
        # bf16 output rounding on top of the codec's own bound
        assert (err <= kvcodec.error_bound(ref, codec, name) + ref.float().abs().amax(dim=(1, 2, 3)) * 2.0 ** -8).all()
    assert b.stats()["redis_read_bytes"] == len(value) and "k1" in b.disk
    again, info = b.lookup("k1", tokens=40)
    assert info["tier"] == "disk" and torch.equal(again.k, got.k)
    assert b.stats()["redis_hits"] == 1 and b.stats()["redis_read_bytes"] == len(value)

    # a corrupt compressed value is a miss, and is deleted
    raw = bytearray(client.get("agentmem:kv:k2"))
    raw[len(raw) // 2] ^= 0x10
    client.set("agentmem:kv:k2", bytes(raw))
    # (no length given: no load-or-recompute choice, which the rates measured above might make)
    assert b.get("k2") is None and client.get("agentmem:kv:k2") is None and tiers[1].corrupt == 1
