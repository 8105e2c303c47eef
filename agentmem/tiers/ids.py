"""Server-made row ids (messages, memories, turns) that say nothing about other tenants and
are never reused.

A global counter (what autoincrement gives) tells a tenant how many rows everyone else wrote
between two of its own requests, and SQLite's plain rowid hands a deleted row's id to the
next insert. Here an id is `tick << 12 | low`:

- `tick` is a millisecond clock since 2025 that never repeats within a process (a burst runs
  it ahead of the wall clock, never back) and starts above every id already stored, so ids
  keep growing in insertion order as the archive's queries expect (old autoincrement ids
  are small, hence older, and keep working);
- `low` is the database's own counter (a PostgreSQL sequence; on SQLite a counter row,
  written inside the insert's transaction) modulo 4096, passed through a permutation keyed by
  a secret of the database and the tick, so two replicas never make the same id within a
  tick and its value shows nothing of the counter.

41 bits of ticks last until 2094 and the ids stay below 2**53 (exact in JavaScript).
"""

from __future__ import annotations

import hashlib
import threading
import time
import weakref

from sqlalchemy import text

LOW_BITS = 12
EPOCH_MS = 1_735_689_600_000  # 2025-01-01T00:00:00Z
_HALF = LOW_BITS // 2
_MASK = (1 << _HALF) - 1


class IdMaker:
    def __init__(self, secret: bytes, floor: int = 0):
        self._secret = secret
        self._last = floor >> LOW_BITS
        self._lock = threading.Lock()

    def make(self, counter: int) -> int:
        with self._lock:
            tick = max(int(time.time() * 1000) - EPOCH_MS, self._last + 1)
            self._last = tick
        return tick << LOW_BITS | self._permute(tick, counter & ((1 << LOW_BITS) - 1))

    def observe(self, row_id: int) -> None:
        """An id written as given (an import keeps its document's ids): later ids follow it."""
        with self._lock:
            self._last = max(self._last, row_id >> LOW_BITS)

    def _permute(self, tick: int, value: int) -> int:
        """A 4-round Feistel network on 12 bits: a bijection for each tick, so values of one
        tick never collide."""
        left, right = value >> _HALF, value & _MASK
        for r in range(4):
            digest = hashlib.blake2b(f"{tick}:{r}:{right}".encode(), key=self._secret, digest_size=2).digest()
            left, right = right, left ^ (int.from_bytes(digest, "big") & _MASK)
        return left << _HALF | right


def next_counter(connection) -> int:
    """The database's counter, advanced by one inside the caller's transaction."""
    if connection.dialect.name == "postgresql":
        return int(connection.execute(text("select nextval('row_id_seq')")).scalar_one())
    return int(connection.execute(text("update row_id_counter set n = n + 1 returning n")).scalar_one())


_MAKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register(engine, maker: IdMaker) -> None:
    """The maker of the database behind `engine` (one per open archive)."""
    _MAKERS[engine] = maker


def maker(engine) -> IdMaker:
    try:
        return _MAKERS[engine]
    except KeyError:
        raise RuntimeError("row ids are made by an open Archive; this engine has none") from None
