"""Per-tenant rate limits that hold across replicas: the service's token bucket, kept in
Redis and updated by one Lua script (read, refill, spend, write: atomic on the server), so
N replicas together allow what one would. While Redis is away each replica limits with its
own bucket, as without Redis."""

from __future__ import annotations

from ..cluster.link import RedisLink, redis_link
from .limits import RateLimiter

# KEYS[1] bucket; ARGV: rate per second, burst, now (s). Returns 0 or the seconds to wait.
_TAKE = """
local b = redis.call('HMGET', KEYS[1], 'tokens', 'last')
local rate, burst, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens = tonumber(b[1]) or burst
local last = tonumber(b[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - last) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'last', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 60)
return tostring(wait)
"""


class SharedRateLimiter:
    """`RateLimiter`'s interface (`take`, `forget`) over Redis; Redis's clock, not the
    replicas', times the refill."""

    def __init__(self, link: RedisLink, rate_per_minute: float):
        self.link = link
        self.local = RateLimiter(rate_per_minute)
        self.rate, self.burst = self.local.rate, self.local.burst
        self._take = link.client.register_script(_TAKE)

    def take(self, key: str) -> float:
        if self.rate <= 0:
            return 0.0

        def shared(client) -> float:
            sec, usec = client.time()
            now = sec + usec / 1e6
            return float(self._take(keys=[self.link.key("rate", key)], args=[self.rate, self.burst, now]))

        return self.link.call("rate_limit", shared, lambda: self.local.take(key))

    def forget(self, key: str) -> None:
        self.local.forget(key)
        self.link.call("rate_limit", lambda c: c.delete(self.link.key("rate", key)), lambda: None)


def rate_limiter(redis_url: str | None, rate_per_minute: float, link: RedisLink | None = None):
    """The shared limiter when Redis is configured, else the replica's own."""
    link = link or redis_link(redis_url)
    return SharedRateLimiter(link, rate_per_minute) if link is not None else RateLimiter(rate_per_minute)
