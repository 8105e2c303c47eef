"""Which chunks the store keeps: value per byte (the default) or least recently used.

A cached chunk is worth what its next hits save, per byte it takes (Marconi's criterion):

    value = expected reuse x prefill seconds a hit saves / bytes

- **Expected reuse** is the chunk's observed frequency, decayed by recency: every use adds 1,
  and the count halves every `half_life_s` without one. The key of a chunk hashes the tenant,
  not the user, so a persona or core block that every user of a tenant sends is one chunk, and
  its count is the sum of all their uses. A chunk not used yet starts from the reuse observed
  for its kind (the segment's tier: system, core, recall, turn...): the share of stored chunks
  of that kind that were used again (Laplace-smoothed), so the KV of a recent turn, which the
  next turn sends again, is kept before that of a one-off question.
- **Seconds saved** is what recomputing it would cost at prefill's measured rate (`Rates`),
  less what loading it from its tier costs.
- **Bytes** is the entry's size in that tier (compressed where the tier's codec compresses).

Since every value decays by the same factor, `priority` (the log of value, with the common
decay since time 0 taken out) orders chunks the same way at any later time without being
recomputed: each tier evicts in ascending priority, and admits a new entry only when every
entry it would push out has a lower priority (its value per byte is lower). The Redis tier
keeps the same number as its sorted set's score. `LRUPolicy` is the baseline: the priority is
the time of last use, and everything is admitted.

Chunks shorter than `min_tokens` are not admitted at all: the chat format's openers and
closers, one-word turns. Their entry's bookkeeping (header, index, a file or a Redis key)
costs about what recomputing them does.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

LN2 = math.log(2.0)
ENTRY_OVERHEAD_BYTES = 512  # header, index entry and dict slot per cached chunk


@dataclass
class Seen:
    """What the policy knows of one chunk, resident or not."""

    tokens: int
    kind: str = ""
    freq: float = 0.0  # uses, decayed to `last`
    last: float = 0.0
    uses: int = 0
    users: set[str] = field(default_factory=set)


class Rates:
    """Measured rates the value and the load-or-recompute choice need, as moving averages:
    prefill seconds per token run, and per tier the seconds a read takes per byte plus a fixed
    latency per read (CacheGen's controller compares the same two)."""

    def __init__(self, prefill_s_per_token: float = 3e-4, recompute_share: float = 0.15, alpha: float = 0.2):
        self.prefill_s_per_token = prefill_s_per_token
        self.recompute_share = recompute_share  # a hit is blended: this share still runs
        self.alpha = alpha
        self.read_s_per_byte: dict[str, float] = {}
        self.read_latency_s: dict[str, float] = {}
        self.prefill_samples = 0

    def prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 16 and seconds > 0:
            r = seconds / tokens
            a = self.alpha if self.prefill_samples else 1.0
            self.prefill_s_per_token += a * (r - self.prefill_s_per_token)
            self.prefill_samples += 1

    def read(self, tier: str, nbytes: int, seconds: float) -> None:
        """One read (and decode) of `nbytes` from `tier` that took `seconds`."""
        lat = self.read_latency_s.get(tier)
        per = self.read_s_per_byte.get(tier)
        if per is None:
            self.read_latency_s[tier] = min(seconds, 2e-4)
            self.read_s_per_byte[tier] = max(seconds - self.read_latency_s[tier], 0.0) / max(nbytes, 1)
            return
        self.read_latency_s[tier] = lat + self.alpha * (min(seconds, 2e-4) - lat)
        per_now = max(seconds - self.read_latency_s[tier], 0.0) / max(nbytes, 1)
        self.read_s_per_byte[tier] = per + self.alpha * (per_now - per)

    def load_s(self, tier: str, nbytes: int) -> float:
        """Seconds a read of `nbytes` from `tier` is expected to take (0 before one was measured:
        the first read is how it gets measured)."""
        return self.read_latency_s.get(tier, 0.0) + self.read_s_per_byte.get(tier, 0.0) * nbytes

    def saved_s(self, tokens: int) -> float:
        """Prefill seconds a hit on a chunk of `tokens` saves (its blended share still runs)."""
        return tokens * self.prefill_s_per_token * (1.0 - self.recompute_share)

    def worth_loading(self, tier: str, tokens: int, nbytes: int) -> bool:
        """Load from `tier` rather than recompute: the read is expected to cost less than the
        prefill it saves."""
        return self.load_s(tier, nbytes) < self.saved_s(tokens)


class LRUPolicy:
    """Least recently used: the priority is the time of last use; everything is admitted."""

    name = "lru"
    admission = False  # every entry is admitted, as most recent

    def __init__(self, clock: Callable[[], float] = time.time, rates: Rates | None = None,
                 max_tracked: int = 100_000):
        self.clock = clock
        self.rates = rates or Rates()
        self.max_tracked = max_tracked
        self.seen: OrderedDict[str, Seen] = OrderedDict()

    def _info(self, key: str, tokens: int, kind: str) -> Seen:
        s = self.seen.get(key)
        if s is None:
            s = self.seen[key] = Seen(tokens, kind, last=self.clock())
            while len(self.seen) > self.max_tracked:
                self.seen.popitem(last=False)
        else:
            self.seen.move_to_end(key)
            if kind and not s.kind:
                s.kind = kind
            if tokens and not s.tokens:
                s.tokens = tokens
        return s

    def used(self, key: str, tokens: int, kind: str = "", user: str | None = None) -> None:
        """A prompt asked for the chunk (hit or miss: a miss is demand too)."""
        s = self._info(key, tokens, kind)
        now = self.clock()
        s.freq = s.freq * 2.0 ** (-(now - s.last) / self.half_life_s) + 1.0 if s.uses else 1.0
        s.last = now
        s.uses += 1
        if user is not None:
            s.users.add(user)

    half_life_s = 300.0

    def stored(self, key: str, tokens: int, kind: str = "") -> None:
        """The chunk's KV was computed and offered to the store (LRU: as most recent)."""
        self._info(key, tokens, kind).last = self.clock()

    def admits(self, tokens: int) -> bool:
        return True

    def priority(self, key: str, nbytes: int) -> float:
        s = self.seen.get(key)
        return s.last if s is not None else self.clock()

    def stats(self) -> dict:
        return {"policy": self.name}


class ValuePolicy(LRUPolicy):
    """Value per byte (see the module docstring)."""

    name = "value"
    admission = True

    def __init__(self, clock: Callable[[], float] = time.time, rates: Rates | None = None,
                 half_life_s: float = 300.0, min_tokens: int = 16, max_tracked: int = 100_000):
        super().__init__(clock, rates, max_tracked)
        self.half_life_s = half_life_s
        self.min_tokens = min_tokens
        self.kinds: dict[str, list[int]] = {}  # kind -> [chunks stored, of them used again]
        self._stored: dict[str, int] = {}  # key -> its uses when stored, until it is used again

    def used(self, key: str, tokens: int, kind: str = "", user: str | None = None) -> None:
        s = self.seen.get(key)
        if s is not None and self._stored.get(key) == s.uses:
            self.kinds.setdefault(s.kind, [0, 0])[1] += 1  # the first use since it was stored
            self._stored[key] = -1
        super().used(key, tokens, kind, user)

    def stored(self, key: str, tokens: int, kind: str = "") -> None:
        s = self._info(key, tokens, kind)
        if key not in self._stored:
            while len(self._stored) >= self.max_tracked:
                self._stored.pop(next(iter(self._stored)))
            self._stored[key] = s.uses
            self.kinds.setdefault(s.kind, [0, 0])[0] += 1

    def prior(self, kind: str) -> float:
        """The observed chance that a stored chunk of this kind is used again."""
        stored, again = self.kinds.get(kind, (0, 0))
        return (again + 1.0) / (stored + 2.0)

    def admits(self, tokens: int) -> bool:
        return tokens >= self.min_tokens

    def expected_reuse(self, key: str, now: float | None = None) -> float:
        s = self.seen[key]
        now = self.clock() if now is None else now
        return (s.freq + self.prior(s.kind)) * 2.0 ** (-(now - s.last) / self.half_life_s)

    def priority(self, key: str, nbytes: int) -> float:
        s = self.seen.get(key)
        if s is None:
            return -math.inf
        saved = max(self.rates.saved_s(s.tokens), 1e-12)
        return (math.log(s.freq + self.prior(s.kind)) + s.last * LN2 / self.half_life_s
                + math.log(saved / (nbytes + ENTRY_OVERHEAD_BYTES)))

    def stats(self) -> dict:
        return {"policy": self.name, "reuse_by_kind": {k: round(self.prior(k), 3) for k in sorted(self.kinds)}}


def victims(entries: Iterable[tuple[str, int, float, bool]], over: int, new_priority: float, new_pinned: bool
            ) -> list[str] | None:
    """Which entries leave so that `over` more bytes fit: (key, bytes, priority, pinned) in,
    keys out in eviction order, or None when the new entry is not admitted. Unpinned entries
    go first, lowest priority first, and only while their priority is below the new entry's;
    pinned ones (oldest pin first is the caller's order) only to make room for another pinned
    entry. A pinned new entry is always admitted: the pin is a promise to the tool call."""
    items = list(entries)
    free = [e for e in items if not e[3]]
    free.sort(key=lambda e: e[2])
    out, freed = [], 0
    for key, nbytes, prio, _ in free:
        if freed >= over:
            return out
        if prio >= new_priority and not new_pinned:
            return None
        out.append(key)
        freed += nbytes
    if freed >= over:
        return out
    if not new_pinned:
        return None
    for key, nbytes, _, pinned in items:
        if freed >= over:
            break
        if pinned:
            out.append(key)
            freed += nbytes
    return out


def make_policy(name: str, clock: Callable[[], float] = time.time, rates: Rates | None = None, **kw) -> LRUPolicy:
    if name == "lru":
        return LRUPolicy(clock, rates)
    if name == "value":
        return ValuePolicy(clock, rates, **kw)
    raise ValueError(f"kv_policy must be value or lru, got {name!r}")
