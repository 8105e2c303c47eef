"""API keys: random secrets shown once, stored only as their sha256, each naming one tenant.

The key is the only credential; whoever holds it acts inside its tenant and nowhere else, so
the tenant id never comes from the request body or path.
"""

from __future__ import annotations

import hashlib
import secrets

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
