"""Reflection in the background: after N new turns of a user, or once the user has been
idle for a while, never on the request path (`notify` only counts and returns)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .job import ReflectReport, reflect

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
        self._pending: dict[tuple[str, str], tuple[int, float]] = {}  # -> (new turns, last turn time)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def notify(self, tenant_id: str, user_id: str, turns: int = 1) -> None:
        """A user had `turns` new turns. Cheap: safe to call from the request path."""
        with self._lock:
            n, _ = self._pending.get((tenant_id, user_id), (0, 0.0))
            self._pending[(tenant_id, user_id)] = (n + turns, time.monotonic())
            due = n + turns >= self.every_turns
        if due:
            self._wake.set()

    def due(self, now: float | None = None) -> list[tuple[str, str]]:
        now = time.monotonic() if now is None else now
        with self._lock:
            return [
                k
                for k, (n, last) in self._pending.items()
                if n >= self.every_turns or (n and now - last >= self.idle_s)
            ]

    def run_due(self, now: float | None = None) -> list[ReflectReport]:
        """Reflect every user that is due, one after another (the model is shared)."""
        reports = []
        for key in self.due(now):
            with self._lock:
                self._pending.pop(key, None)
            try:
                r = reflect(self.store, self.engine, *key, **self.reflect_kwargs)
            except Exception:
                log.exception("reflection failed for tenant %s user %s", *key)
                continue
            reports.append(r)
            if self.on_report:
                self.on_report(r)
        return reports

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
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if not self._stop.is_set():
                self.run_due()
