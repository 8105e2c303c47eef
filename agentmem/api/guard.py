"""The outermost layer of the service: every response counted in `/metrics` by route and
status (the 413s of the body limit and the 500s included), and no exception escaping as a
dropped connection: a failure before the response started becomes a JSON 500 that says
`Connection: close`, so a client knows the connection ends rather than seeing it cut."""

from __future__ import annotations

import json
import logging
import time

from .errors import error_body

log = logging.getLogger("agentmem.api")


class Guard:
    def __init__(self, app, metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500
        started = False

        async def tracked_send(message):
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            status = 500
            if not started:
                body = json.dumps(error_body("internal error; the request may be retried", "api_error",
                                             "internal_error")).encode()
                await send({"type": "http.response.start", "status": 500,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(scope.get("method", ""), route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
