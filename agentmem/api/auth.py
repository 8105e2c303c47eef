"""API keys: random secrets shown once, stored only as their sha256, each naming one tenant.

The key is the only credential; whoever holds it acts inside its tenant and nowhere else, so
the tenant id never comes from the request body or path.
"""

from __future__ import annotations

import hashlib
import secrets
import threading

from cachetools import TTLCache

KEY_PREFIX = "am-"


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_token(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def create_tenant_with_key(store, name: str, key_name: str = "default") -> tuple[str, str]:
    """Create a tenant and its first key; returns (tenant_id, key). The key is not stored."""
    tenant_id = store.create_tenant(name)
    key = new_key()
    store.add_api_key(tenant_id, hash_key(key), key_name)
    return tenant_id, key


class KeyCache:
    """key hash -> tenant id (None: no such key), LRU with a TTL: every request needs the
    lookup and keys rarely change, but the cache must not grow with the distinct bad tokens
    a client can send (each would otherwise stay forever)."""

    def __init__(self, lookup, max_entries: int = 10_000, ttl_s: float = 5.0):
        self._lookup = lookup
        self._cache: TTLCache = TTLCache(maxsize=max_entries, ttl=ttl_s)
        self._lock = threading.Lock()

    def get(self, key_hash: str, fresh: bool = False) -> str | None:
        """The key's tenant; `fresh` reads the database (writes do, so a key deleted by
        another process stops writing at once)."""
        if not fresh:
            with self._lock:
                if key_hash in self._cache:
                    return self._cache[key_hash]
        tenant = self._lookup(key_hash)
        with self._lock:
            self._cache[key_hash] = tenant
        return tenant

    def drop_tenant(self, tenant_id: str) -> None:
        with self._lock:
            for h in [h for h, t in self._cache.items() if t == tenant_id]:
                self._cache.pop(h, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)
