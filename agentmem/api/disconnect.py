"""Noticing a client that has gone while its request still runs. A streamed reply notices
by itself (its next write fails); a plain one is produced whole before anything is sent, so
without this it would keep the engine generating for nobody. `DisconnectWatch` listens for
the client's disconnect once the request body has been read and sets a flag the handler's
thread can check between tokens (`until_disconnected`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

from ..engine.cancel import cancel_on
from .errors import ApiError


class DisconnectWatch:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        gone = threading.Event()
        scope.setdefault("state", {})["client_gone"] = gone
        later: asyncio.Queue = asyncio.Queue()
        watcher: asyncio.Task | None = None

        async def watch() -> None:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            await later.put(message)

        async def watched_receive():
            nonlocal watcher
            if watcher is not None:
                return await later.get()
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body"):
                watcher = asyncio.create_task(watch())
            return message

        try:
            await self.app(scope, watched_receive, send)
        finally:
            if watcher is not None:
                watcher.cancel()


def until_disconnected(pieces: Iterator[str], gone: threading.Event | None) -> Iterator[str]:
    """`pieces` until the client goes; then generation is cancelled (the engine frees the
    sequence) and the request ends as 499, the status for a request its client closed. The
    engine streams started while iterating are under `cancel_on(gone)`: they end within
    0.1 s of the disconnect even while their text is held back (a counting reply is held by
    the loop detector until it settles), not only at their next piece."""
    with cancel_on(gone):
        for piece in pieces:
            if gone is not None and gone.is_set():
                break
            yield piece
    if gone is not None and gone.is_set():
        close = getattr(pieces, "close", None)
        if close is not None:
            close()
        raise ApiError(499, "the client closed the request", code="client_closed")
