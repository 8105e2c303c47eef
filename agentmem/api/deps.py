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
    """Resolve the key to its tenant, then spend one token of that tenant's rate limit.
    Failed authentications are limited per client address; a write looks its key up in the
    database, so a key deleted by any process stops writing at once."""
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
    if creds is None or not creds.credentials:
        svc.failed_auth.take(address)
        raise ApiError(401, "missing API key: send `Authorization: Bearer <key>`", "authentication_error",
                       "missing_api_key", headers={"WWW-Authenticate": "Bearer"})
    tenant_id = svc.tenant_for_key(hash_key(creds.credentials), fresh=request.method not in SAFE_METHODS)
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
