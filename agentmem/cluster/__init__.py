"""What replicas share beyond the database: Redis, when `AGENTMEM_REDIS_URL` is set, for
per-tenant rate limits (api/shared_rate.py) and a chunk-KV tier (kvreuse/shared_tier.py).
Every use falls back to the replica's own state while Redis is unreachable;
`agentmem_redis_up` and `agentmem_redis_fallbacks_total` say so."""

from .link import RedisCollector, RedisLink, redis_link

__all__ = ["RedisCollector", "RedisLink", "redis_link"]
