"""`Idempotency-Key` on the POSTs that write (messages, memories, import, chat): a client
that lost the answer sends the same request with the same key again and gets the first
answer back, byte for byte (an SSE stream included), instead of a second copy of its data.

The key is the tenant's own (two tenants may use the same one). The first request claims
it in the database before running, so a retry arriving while the first still runs gets a
409 rather than a duplicate, on any replica; only a 2xx answer is kept (a 4xx or 5xx frees
the key, so the retry runs afresh). Reusing a key for a different request is a 422. Keys
are kept for a day, and go with their user or tenant when those are deleted.
"""

from __future__ import annotations

import hashlib
import json
import re

import anyio
from starlette.concurrency import run_in_threadpool

from ..tiers.sizes import IDEMPOTENCY_KEY_CHARS
from .auth import bearer_token, hash_key
from .errors import error_body

HEADER = b"idempotency-key"

_PATHS = re.compile(r"^/v1/(chat/completions|users/(?P<user>[^/]+)/(messages|memories|import))$")

class Idempotency:
    def __init__(self, app, services):
        self.app = app
        self.services = services

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers") or ()) if scope["type"] == "http" else {}
        match = _PATHS.match(scope.get("path", "")) if scope.get("method") == "POST" else None
        if HEADER not in headers or match is None:
            return await self.app(scope, receive, send)
        key = headers[HEADER].decode("latin-1")
        if not 0 < len(key) <= IDEMPOTENCY_KEY_CHARS or not key.isprintable():
            return await _reply(send, 400, f"Idempotency-Key must be 1 to {IDEMPOTENCY_KEY_CHARS} printable characters",
                                "invalid_idempotency_key")
        token = bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
        tenant = token and await run_in_threadpool(self.services.tenant_for_key, hash_key(token), True)
        if not tenant:
            return await self.app(scope, receive, send)  # the app answers the 401

        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        user = match.group("user") or _chat_user(bytes(body))
        fingerprint = hashlib.sha256(scope["path"].encode() + b"\0" + bytes(body)).hexdigest()
        archive = self.services.store.archive
        state, saved = await run_in_threadpool(archive.claim_idempotency_key, tenant, key, fingerprint, user)
        if state == "busy":
            return await _reply(send, 409, "a request with this Idempotency-Key is still running; retry later",
                                "idempotency_key_in_use")
        if state == "mismatch":
            return await _reply(send, 422, "this Idempotency-Key was used for a different request",
                                "idempotency_key_reused")
        if state == "done":
            status, content_type, payload = saved
            return await _send(send, status, payload, content_type, replayed=True)

        sent = False

        async def replay_receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        start: dict = {}
        chunks: list[bytes] = []
        settled = False  # the key is kept (a 2xx) or freed (anything else)

        async def capture(message):
            # the key is settled before the answer's last byte is sent: a client that retries
            # the moment it has the answer must find it kept (a replay) or freed (a fresh run),
            # never still claimed (a 409) or claimed by the refused body (a 422)
            nonlocal settled
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                status = start.get("status", 500)
                if not message.get("more_body"):
                    if 200 <= status < 300:
                        content_type = dict(start.get("headers") or ()).get(b"content-type", b"application/json")
                        await run_in_threadpool(archive.finish_idempotency_key, tenant, key, status,
                                                content_type.decode("latin-1"), b"".join(chunks))
                    else:
                        await run_in_threadpool(archive.release_idempotency_key, tenant, key)
                    settled = True
            await send(message)

        try:
            await self.app(scope, replay_receive, capture)
        finally:
            if not settled:  # the app failed before answering in full
                with anyio.CancelScope(shield=True):
                    await run_in_threadpool(archive.release_idempotency_key, tenant, key)


def _chat_user(body: bytes) -> str | None:
    try:
        user = json.loads(body).get("user")
    except (ValueError, AttributeError):
        return None
    return user if isinstance(user, str) else None

async def _reply(send, status: int, message: str, code: str) -> None:
    payload = json.dumps(error_body(message, "invalid_request_error", code)).encode()
    await _send(send, status, payload, "application/json")

async def _send(send, status: int, payload: bytes, content_type: str, replayed: bool = False) -> None:
    headers = [(b"content-type", content_type.encode("latin-1")), (b"content-length", str(len(payload)).encode())]
    if replayed:
        headers.append((b"idempotent-replayed", b"true"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
