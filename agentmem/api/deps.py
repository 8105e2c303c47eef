"""Request dependencies: the calling tenant (from the API key) and the app's services."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .auth import hash_key
from .errors import ApiError

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
bearer = HTTPBearer(auto_error=False, description="an agentmem API key (`agentmem tenant create`)")


@dataclass(frozen=True)
class Caller:
    tenant_id: str


def services(request: Request):
    return request.app.state.services


def caller(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Caller:
    """The calling tenant of a REST request: a write looks its key up in the database, so a
    key deleted by any process stops writing at once; a read may use the key cache."""
    return authenticate(request, creds.credentials if creds else None, fresh=request.method not in SAFE_METHODS)


def authenticate(request: Request, key: str | None, fresh: bool) -> Caller:
    """Resolve the key to its tenant, then spend one token of that tenant's rate limit.
    Failed authentications are limited per client address. `fresh` reads the key from the
    database instead of the key cache (KEY_CACHE_SECONDS)."""
    svc = request.app.state.services
    if "api_key" in request.query_params:
        raise ApiError(400, "send the API key as `Authorization: Bearer <key>`, never in the URL",
                       code="key_in_url", param="api_key")
    address = request.client.host if request.client else "unknown"
    wait = svc.failed_auth.check(address)
    if wait > 0:
        svc.metrics.rate_limited.inc()
        raise ApiError(429, f"too many failed authentications; retry in {wait:.1f} s", "rate_limit_error",
                       "auth_rate_limited", headers={"Retry-After": str(max(1, round(wait)))})
    if not key:
        svc.failed_auth.take(address)
        raise ApiError(401, "missing API key: send `Authorization: Bearer <key>`", "authentication_error",
                       "missing_api_key", headers={"WWW-Authenticate": "Bearer"})
    tenant_id = svc.tenant_for_key(hash_key(key), fresh=fresh)
    if tenant_id is None:
        svc.failed_auth.take(address)
        raise ApiError(401, "invalid API key", "authentication_error", "invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    wait = svc.rate.take(tenant_id)
    if wait > 0:
        svc.metrics.rate_limited.inc()
        raise ApiError(429, f"rate limit exceeded; retry in {wait:.1f} s", "rate_limit_error", "rate_limited",
                       headers={"Retry-After": str(max(1, round(wait)))})
    return Caller(tenant_id)
