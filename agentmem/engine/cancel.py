"""Cancelling a stream from another thread: an event that every engine's stream started
under `cancel_on` watches.

A stream's consumer may be blocked waiting for the next piece (a long prefill, text held
back by stop strings), so closing the stream from the waiting thread is not enough; the
event is read by the stream itself, whichever engine made it.
"""

from __future__ import annotations

import contextlib
import threading

_CANCEL = threading.local()
CANCEL_POLL_S = 0.1  # how often a stream under `cancel_on` looks at its event while it waits


@contextlib.contextmanager
def cancel_on(event: threading.Event | None):
    """Streams started in this thread inside the block are cancelled once `event` is set,
    even while no text comes, and end as finish_reason "cancelled". The API's plain requests
    use it for a client that has gone (`api/disconnect.py`), the async session for a
    cancelled task."""
    before = getattr(_CANCEL, "event", None)
    _CANCEL.event = event
    try:
        yield
    finally:
        _CANCEL.event = before


def current_cancel_event() -> threading.Event | None:
    """The event of the innermost `cancel_on` block of this thread, if any."""
    return getattr(_CANCEL, "event", None)
