"""A lock that takes turns fairly between owners (tenants): start-time fair queuing.

A plain lock hands the next turn to whichever waiter the OS wakes first, so a tenant with
sixteen threads waiting gets sixteen turns for another tenant's one. Here every turn is
tagged with its owner's virtual start time, max(now's virtual time, the owner's previous
finish), and finishes `cost` later; the waiter with the smallest start goes next. An owner
that has been idle starts at the current virtual time, ahead of a backlogged owner's next
turn, so it waits for at most the turn being served; backlogged owners share the turns in
proportion to cost.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

PRUNE_OWNERS = 1024  # finish tags kept before the ones at or behind the virtual time are dropped


class FairGate:
    def __init__(self):
        self._mutex = threading.Lock()
        self._busy = False
        self._vtime = 0.0
        self._finish: dict[str, float] = {}
        self._waiting: list[tuple[float, int, threading.Event]] = []
        self._order = itertools.count()

    def _tag(self, owner: str, cost: float) -> float:
        start = max(self._vtime, self._finish.get(owner, 0.0))
        self._finish[owner] = start + max(cost, 1e-9)
        return start

    def acquire(self, owner: str, cost: float = 1.0) -> None:
        with self._mutex:
            start = self._tag(owner, cost)
            if not self._busy:
                self._busy, self._vtime = True, start
                return
            turn = threading.Event()
            heapq.heappush(self._waiting, (start, next(self._order), turn))
        turn.wait()  # release() hands the gate over: _busy stays True, _vtime is set for us

    def release(self) -> None:
        with self._mutex:
            if not self._waiting:
                self._busy = False
            else:
                start, _, turn = heapq.heappop(self._waiting)
                self._vtime = start
                turn.set()
            if len(self._finish) > PRUNE_OWNERS:  # owners at or behind the virtual time start there anyway
                self._finish = {o: f for o, f in self._finish.items() if f > self._vtime}

    @contextmanager
    def turn(self, owner: str, cost: float = 1.0) -> Iterator[None]:
        self.acquire(owner, cost)
        try:
            yield
        finally:
            self.release()

    def waiting(self) -> int:
        with self._mutex:
            return len(self._waiting)
