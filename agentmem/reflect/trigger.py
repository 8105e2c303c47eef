"""Reflection in the background: a user is due after N new turns, or once they have been idle
for a while. Never on the request path: the scheduler reads the backlog from the archive
(the turns after each user's checkpoint), so whoever wrote the turns, on whatever replica,
nothing has to call it; `notify` only wakes it early."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from .checkpoint import Checkpoints
from .job import ReflectReport, reflect
from .lease import Leases

log = logging.getLogger(__name__)


class ReflectionScheduler:
    def __init__(
        self,
        store,
        engine,
        every_turns: int = 20,
        idle_s: float = 300.0,
        poll_s: float = 5.0,
        on_report: Callable[[ReflectReport], None] | None = None,
        **reflect_kwargs,
    ):
        if every_turns < 1 or idle_s <= 0 or poll_s <= 0:
            raise ValueError("every_turns must be >= 1, idle_s and poll_s > 0")
        self.store, self.engine = store, engine
        self.every_turns, self.idle_s, self.poll_s = every_turns, idle_s, poll_s
        self.on_report = on_report
        self.reflect_kwargs = reflect_kwargs
        self.checkpoints = Checkpoints(store.archive.engine)
        self.leases = Leases(store.archive.engine)  # replicas: one of them reflects a user at a time
        store.forget_hooks.append(self.checkpoints.forget)  # a deleted user's checkpoint goes too
        self._failed: dict[tuple[str, str], float] = {}  # -> monotonic time of the last failure
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def notify(self) -> None:
        """Some user had new turns: look at the backlog now rather than at the next poll."""
        self._wake.set()

    def due(self, now: datetime | None = None) -> list[tuple[str, str]]:
        """Users with `every_turns` unreflected turns, or with some and idle for `idle_s`;
        a user whose last pass failed waits `idle_s` before the next try."""
        now = now or datetime.now(UTC)
        idle = timedelta(seconds=self.idle_s)
        mono = time.monotonic()
        return [
            (t, u)
            for t, u, n, last in self.checkpoints.backlog()
            if (n >= self.every_turns or now - last >= idle) and mono - self._failed.get((t, u), -1e18) >= self.idle_s
        ]

    def _engine_and_kwargs(self):
        """`engine` may be a zero-argument function (a service loads its model on first use):
        it is called only when some user is due. So is a `compressor` given as a function."""
        engine = self.engine() if callable(self.engine) else self.engine
        kwargs = dict(self.reflect_kwargs)
        make = kwargs.get("compressor")
        if isinstance(make, type) or (callable(make) and not hasattr(make, "compress")):
            kwargs["compressor"] = self.reflect_kwargs["compressor"] = make(engine)
        return engine, kwargs

    def run_due(self, now: datetime | None = None) -> list[ReflectReport]:
        """Reflect every user that is due, one after another (the model is shared)."""
        reports = []
        due = self.due(now)
        if not due:
            return reports
        engine, kwargs = self._engine_and_kwargs()
        for key in due:
            if self._stop.is_set():
                break
            try:
                r = self._reflect_leased(engine, key, kwargs)
            except Exception:
                log.exception("reflection failed for tenant %s user %s", *key)
                self._failed[key] = time.monotonic()
                continue
            if r is None:  # another replica holds the user's lease, or has just reflected them
                continue
            self._failed.pop(key, None)
            reports.append(r)
            if self.on_report:
                self.on_report(r)
        return reports

    def _reflect_leased(self, engine, key: tuple[str, str], kwargs: dict) -> ReflectReport | None:
        """Reflect one user under their lease; None if another replica has it. The backlog
        is read again once the lease is held: a replica that just finished the same user
        has moved the checkpoint past it."""
        with self.leases.hold(*key) as held:
            if not held or key not in {(t, u) for t, u, _, _ in self.checkpoints.backlog()}:
                return None
            return reflect(self.store, engine, *key, **kwargs)

    def start(self) -> ReflectionScheduler:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="agentmem-reflect", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_due()
            except Exception:  # the archive was unreachable: try again at the next poll
                log.exception("reflection scheduler poll failed")
            self._wake.wait(self.poll_s)
            self._wake.clear()
