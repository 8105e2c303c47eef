"""`SharedTier`: chunk KV in Redis, so one replica reuses the KV another computed.

Entries are the disk tier's bytes (`store.pack`: header with the namespace and a digest of
the payload), so a torn or corrupt value is a miss and is deleted, like a bad file. Chunk
keys already hash the namespace (the tenant) in, and each namespace's keys are listed in a
set of its own, so a deleted tenant's chunks go with one call. The tier is bounded in bytes
across all replicas: each write records the entry's size and last use, and one Lua script
(atomic on the server) stores it and evicts the least recently used entries past the
budget. Writes leave the request path: a background thread sends them, and drops them when
it falls behind (it is a cache). While Redis is down, reads miss and writes are dropped.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time

from ..cluster.link import RedisLink
from .store import ChunkKV, pack, unpack

# KEYS: value, lru zset, meta hash, total bytes, namespace set. ARGV: data, now, size, ns, key,
# budget, prefix. meta[key] = "<size> <ns>".
_PUT = """
local old = redis.call('HGET', KEYS[3], ARGV[5])
if old then
  redis.call('DECRBY', KEYS[4], tonumber(string.sub(old, 1, string.find(old, ' ') - 1)))
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[5])
redis.call('HSET', KEYS[3], ARGV[5], ARGV[3] .. ' ' .. ARGV[4])
redis.call('SADD', KEYS[5], ARGV[5])
local total = redis.call('INCRBY', KEYS[4], ARGV[3])
local budget = tonumber(ARGV[6])
local evicted = 0
while total > budget do
  local popped = redis.call('ZPOPMIN', KEYS[2])
  if #popped == 0 then break end
  local k = popped[1]
  local m = redis.call('HGET', KEYS[3], k)
  if m then
    local sp = string.find(m, ' ')
    redis.call('HDEL', KEYS[3], k)
    redis.call('SREM', ARGV[7] .. 'kv-ns:' .. string.sub(m, sp + 1), k)
    total = redis.call('DECRBY', KEYS[4], tonumber(string.sub(m, 1, sp - 1)))
  end
  redis.call('DEL', ARGV[7] .. 'kv:' .. k)
  evicted = evicted + 1
end
return evicted
"""

# KEYS: lru zset, meta hash, total bytes, namespace set. ARGV: prefix. Returns entries removed.
_DROP = """
local keys = redis.call('SMEMBERS', KEYS[4])
for _, k in ipairs(keys) do
  local m = redis.call('HGET', KEYS[2], k)
  if m then
    redis.call('DECRBY', KEYS[3], tonumber(string.sub(m, 1, string.find(m, ' ') - 1)))
    redis.call('HDEL', KEYS[2], k)
  end
  redis.call('ZREM', KEYS[1], k)
  redis.call('DEL', ARGV[1] .. 'kv:' .. k)
end
redis.call('DEL', KEYS[4])
return #keys
"""


def _ns(namespace: str) -> str:
    return hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()


class SharedTier:
    def __init__(self, link: RedisLink, budget: int, pending: int = 64):
        self.link, self.budget = link, budget
        self._put = link.client.register_script(_PUT)
        self._drop = link.client.register_script(_DROP)
        self.hits = self.misses = self.corrupt = self.dropped = self.evictions = 0
        self._queue: queue.Queue = queue.Queue(maxsize=pending)
        self._thread = threading.Thread(target=self._writer, name="agentmem-shared-kv", daemon=True)
        self._thread.start()

    def _keys(self, key: str, namespace_hash: str) -> list[str]:
        k = self.link.key
        return [k("kv", key), k("kv-lru"), k("kv-meta"), k("kv-bytes"), k("kv-ns", namespace_hash)]

    def read(self, key: str) -> tuple[str, ChunkKV] | None:
        """(namespace, entry) or None: absent, Redis down, or not intact (then deleted)."""
        data = self.link.call("shared_kv", lambda c: c.get(self.link.key("kv", key)), lambda: None)
        found = unpack(data, key) if data is not None else None
        if data is not None and found is None:
            self.corrupt += 1
            self.link.call("shared_kv", lambda c: c.delete(self.link.key("kv", key)), lambda: None)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self.link.call("shared_kv", lambda c: c.zadd(self.link.key("kv-lru"), {key: time.time()}), lambda: None)
        return found

    def write(self, key: str, namespace: str, kv: ChunkKV) -> None:
        """Queue the entry for Redis; dropped (counted) when the writer is behind."""
        try:
            self._queue.put_nowait((key, namespace, kv))
        except queue.Full:
            self.dropped += 1

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until the queued writes are sent (benchmarks and tests, before another
        replica reads)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def _writer(self) -> None:
        while True:
            key, namespace, kv = self._queue.get()
            try:
                data = pack(key, namespace, kv)
                ns = _ns(namespace)
                args = [data, time.time(), len(data), ns, key, self.budget, self.link.prefix]
                n = self.link.call("shared_kv", lambda c, a=args, ks=self._keys(key, ns): self._put(keys=ks, args=a),
                                   lambda: None)
                self.evictions += int(n or 0)
            finally:
                self._queue.task_done()

    def drop_namespace(self, namespace: str) -> int:
        ks = self._keys("", _ns(namespace))[1:]
        return int(self.link.call("shared_kv", lambda c: self._drop(keys=ks, args=[self.link.prefix]), lambda: 0))

    def stats(self) -> dict:
        looked = self.hits + self.misses
        return {"redis_hits": self.hits, "redis_misses": self.misses, "redis_corrupt": self.corrupt,
                "redis_dropped_writes": self.dropped, "redis_evictions": self.evictions,
                "redis_hit_ratio": self.hits / looked if looked else 0.0}
