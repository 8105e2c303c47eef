"""A real server on a free loopback port, in a background thread of this process: what the
tests and `agentmem bench serve` drive with real HTTP clients, sharing an engine that is
already loaded."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    def __init__(self, app, port: int | None = None, startup_timeout_s: float = 30.0):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
                             timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, name=f"agentmem-api-{self.port}", daemon=True)
        self._timeout = startup_timeout_s

    def __enter__(self) -> LocalServer:
        self._thread.start()
        deadline = time.monotonic() + self._timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
