"""The operator's endpoints: `/metrics` (every tenant's traffic, in aggregate) and the API
docs (`/docs`, `/redoc`, `/openapi.json`) are not for tenants. With `operator_key` set they
need `Authorization: Bearer <operator_key>`; without one they answer only loopback clients
(a Prometheus or a developer on the same host). Anyone else gets the 404 of a missing page."""

from __future__ import annotations

import hmac
import json

from .auth import bearer_token
from .errors import error_body

OPERATOR_PATHS = frozenset({"/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def allowed(scope, operator_key: str | None) -> bool:
    if operator_key:
        header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        token = bearer_token(header) or ""
        return hmac.compare_digest(token.encode(), operator_key.encode())
    client = scope.get("client")
    return bool(client) and client[0] in LOOPBACK


class OperatorOnly:
    def __init__(self, app, operator_key: str | None):
        self.app = app
        self.operator_key = operator_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in OPERATOR_PATHS or allowed(scope, self.operator_key):
            return await self.app(scope, receive, send)
        body = json.dumps(error_body("not found", "not_found_error")).encode()
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
