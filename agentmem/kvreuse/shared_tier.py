"""`SharedTier`: chunk KV in Redis, so one replica reuses the KV another computed.

Entries are the disk tier's blobs (codec.py: header with the namespace and a digest of the
payload, in the store's codec), so a torn or corrupt value is a miss and is deleted, like a
bad file. Chunk
keys already hash the namespace (the tenant) in, and each namespace's keys are listed in a
set of its own, so a deleted tenant's chunks go with one call. The tier is bounded in bytes
across all replicas: each write records the entry's size and last use, and one Lua script
(atomic on the server) stores it and evicts the lowest scored entries past the budget; which entries go is the store's policy (policy.py): the sorted set's score is the
entry's priority (value per byte, or the time of last use for LRU), and with value per byte a
new entry is admitted only where it outscores every entry it would push out. Writes leave the request path: a background thread sends them, and drops them when
it falls behind (it is a cache). While Redis is down, reads miss and writes are dropped.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time

from ..cluster.link import RedisLink
from .codec import decode, encode
from .entry import ChunkKV

# KEYS: value, score zset, meta hash, total bytes, namespace set. ARGV: data, score, size, ns,
# key, budget, prefix, admission (1: the new entry must outscore every entry it pushes out).
# meta[key] = "<size> <ns>". Returns the entries evicted, or -1: not admitted.
_PUT = """
local old = redis.call('HGET', KEYS[3], ARGV[5])
if old then
  local sp = string.find(old, ' ')
  redis.call('DECRBY', KEYS[4], tonumber(string.sub(old, 1, sp - 1)))
  redis.call('HDEL', KEYS[3], ARGV[5])
  redis.call('ZREM', KEYS[2], ARGV[5])
end
local size = tonumber(ARGV[3])
local budget = tonumber(ARGV[6])
local score = tonumber(ARGV[2])
local total = tonumber(redis.call('GET', KEYS[4]) or '0')
local need = total + size - budget
local out = {}
if need > 0 then
  if size > budget then return -1 end
  local freed, at = 0, 0
  while freed < need do
    local batch = redis.call('ZRANGE', KEYS[2], at, at + 31, 'WITHSCORES')
    if #batch == 0 then return -1 end
    for i = 1, #batch, 2 do
      if freed >= need then break end
      if ARGV[8] == '1' and tonumber(batch[i + 1]) >= score then return -1 end
      local m = redis.call('HGET', KEYS[3], batch[i])
      local n = 0
      if m then n = tonumber(string.sub(m, 1, string.find(m, ' ') - 1)) end
      freed = freed + n
      out[#out + 1] = batch[i]
    end
    at = at + 32
  end
  for _, k in ipairs(out) do
    local m = redis.call('HGET', KEYS[3], k)
    if m then
      local sp = string.find(m, ' ')
      redis.call('HDEL', KEYS[3], k)
      redis.call('SREM', ARGV[7] .. 'kv-ns:' .. string.sub(m, sp + 1), k)
      redis.call('DECRBY', KEYS[4], tonumber(string.sub(m, 1, sp - 1)))
    end
    redis.call('ZREM', KEYS[2], k)
    redis.call('DEL', ARGV[7] .. 'kv:' .. k)
  end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], score, ARGV[5])
redis.call('HSET', KEYS[3], ARGV[5], ARGV[3] .. ' ' .. ARGV[4])
redis.call('SADD', KEYS[5], ARGV[5])
redis.call('INCRBY', KEYS[4], size)
return #out
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
        self.hits = self.misses = self.corrupt = self.dropped = self.evictions = self.rejected = 0
        self.policy = None  # the store's (attach); None: LRU scores, everything admitted
        self.codec = "raw"
        self._queue: queue.Queue = queue.Queue(maxsize=pending)
        self._thread = threading.Thread(target=self._writer, name="agentmem-shared-kv", daemon=True)
        self._thread.start()

    def attach(self, policy, codec: str) -> None:
        """Score and encode as the store that reads and writes through this tier does."""
        self.policy, self.codec = policy, codec

    def _score(self, key: str, nbytes: int) -> float:
        score = self.policy.priority(key, nbytes) if self.policy is not None else time.time()
        return min(max(score, -1e300), 1e300)  # finite: Lua's tonumber reads no infinity

    def _keys(self, key: str, namespace_hash: str) -> list[str]:
        k = self.link.key
        return [k("kv", key), k("kv-lru"), k("kv-meta"), k("kv-bytes"), k("kv-ns", namespace_hash)]

    def read(self, key: str) -> tuple[str, ChunkKV, int] | None:
        """(namespace, entry, bytes read) or None: absent, Redis down, or not intact (then
        deleted)."""
        data = self.link.call("shared_kv", lambda c: c.get(self.link.key("kv", key)), lambda: None)
        found = decode(data, key) if data is not None else None
        if data is not None and found is None:
            self.corrupt += 1
            self.link.call("shared_kv", lambda c: c.delete(self.link.key("kv", key)), lambda: None)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        score = self._score(key, len(data))
        self.link.call("shared_kv", lambda c: c.zadd(self.link.key("kv-lru"), {key: score}, xx=True), lambda: None)
        return found[0], found[1], len(data)

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
                data = encode(key, namespace, kv, self.codec)
                ns = _ns(namespace)
                admission = "1" if getattr(self.policy, "admission", False) else "0"
                args = [data, self._score(key, len(data)), len(data), ns, key, self.budget, self.link.prefix, admission]
                n = int(self.link.call("shared_kv", lambda c, a=args, ks=self._keys(key, ns): self._put(keys=ks, args=a),
                                       lambda: None) or 0)
                if n < 0:
                    self.rejected += 1
                else:
                    self.evictions += n
            finally:
                self._queue.task_done()

    def drop_namespace(self, namespace: str) -> int:
        ks = self._keys("", _ns(namespace))[1:]
        return int(self.link.call("shared_kv", lambda c: self._drop(keys=ks, args=[self.link.prefix]), lambda: 0))

    def stats(self) -> dict:
        looked = self.hits + self.misses
        return {"redis_hits": self.hits, "redis_misses": self.misses, "redis_corrupt": self.corrupt,
                "redis_dropped_writes": self.dropped, "redis_evictions": self.evictions,
                "redis_rejected": self.rejected,
                "redis_hit_ratio": self.hits / looked if looked else 0.0}
