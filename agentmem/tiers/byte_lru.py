"""`ByteLRU`: a mapping bounded by the bytes its values hold, least recently used out first.

The recall store keeps one index per user in memory; over a process's life that grows
with every user it has served. Bounded by bytes (`AGENTMEM_RECALL_CACHE_MB`), the indexes
of users not seen lately leave memory (written to disk first, through `on_evict`) and are
loaded again on their next use, as the chunk-KV store does with its tiers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    def __init__(self, budget: int, size: Callable[[V], int], on_evict: Callable[[K, V], bool] | None = None):
        """`on_evict(key, value)` runs as an entry leaves (to save it); returning False keeps
        the entry (it is in use), as most recent, and eviction moves on to the next."""
        self.budget, self._size, self._on_evict = budget, size, on_evict
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: K, value: V) -> None:
        """Insert or re-measure (after the value grew) as most recent; evict past the budget.
        The entry just put stays even if it alone is over the budget: it is in use."""
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        n = self._size(value)
        self._items[key] = (value, n)
        self.bytes += n
        tries = len(self._items) - 1  # every other entry at most once: some may be in use
        while self.bytes > self.budget and tries > 0:
            tries -= 1
            k, (v, m) = self._items.popitem(last=False)
            if self._on_evict is not None and not self._on_evict(k, v):
                self._items[k] = (v, m)
                continue
            self.bytes -= m
            self.evictions += 1

    def pop(self, key: K) -> V | None:
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.bytes -= item[1]
        return item[0]

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)
