"""Paged-KV bookkeeping: which pool blocks each sequence holds, shared prefixes, freeing.

No tensors here (kv_pool.py holds them). A full block is named by a hash of its token ids
chained with the previous block's hash and the sequence's salt (its namespace), so sequences
that start with the same tokens map onto the same blocks, counted by reference. A freed block
keeps its hash until it is handed out again, so a later request with that prefix still finds
it: freed blocks are reused least-recently-freed first.

**Placement.** Decode attention streams a sequence's K/V block after block, and a sequence
whose blocks lie one after another in the pool reads faster than one whose blocks are
scattered: the hardware prefetchers follow one stream of addresses and stop where it jumps
(a 16-slot block of SmolLM2 is 6 KB a layer). Taking blocks only from the front of the free
list scatters every sequence that grows beside others: eight streams decoding together take
their next blocks in turn, so each stream's blocks end up eight apart. So a sequence's new
blocks are placed: the block right after its last one when that block is *open* (free, and
either holding no cached prefix or among the older half of the free list, which the
least-recently-freed rule would evict first anyway), else the start of the longest run of
open blocks, or its middle when a live sequence's block comes just before the run (that
sequence grows into the first half). Only when no block is open does a block come from the
front of the free list, as before. The newer half of the free cached blocks is never taken out
of turn, so a chat's next turn still finds the prefix its last turn left.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .sequence import Sequence

CONTIGUOUS = True  # place blocks in runs (see the module's docstring); False: free-list order only


class NoFreeBlocks(RuntimeError):
    """The pool has too few free blocks for the request; the scheduler waits or preempts."""


@dataclass
class Block:
    id: int
    ref: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()


def chain_hash(prev: int | None, salt: str, tokens: Iterable[int]) -> int:
    return hash((prev, salt, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one token")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self._clock = 0  # counts frees: a free block's `_freed_at` orders the free list by age
        self._freed_at = np.zeros(num_blocks, dtype=np.int64)
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._cached = np.zeros(num_blocks, dtype=bool)  # holds the prefix its hash names

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _match_prefix(self, seq: Sequence) -> list[Block]:
        """Cached full blocks at the start of seq; always leaves >= 1 token to compute, since
        the last prompt token's logits are needed."""
        bs = self.block_size
        hits: list[Block] = []
        prev = None
        for j in range((len(seq.token_ids) - 1) // bs):
            toks = tuple(seq.token_ids[j * bs : (j + 1) * bs])
            prev = chain_hash(prev, seq.salt, toks)
            bid = self._by_hash.get(prev)
            if bid is None or self.blocks[bid].tokens != toks:
                break
            hits.append(self.blocks[bid])
        return hits

    def match(self, seq: Sequence) -> list[Block]:
        """The cached prefix blocks seq would share (none where it shares nothing). An admission
        matches once and passes the result to `can_allocate` and `allocate`: hashing a 2k-token
        prompt's 128 blocks three times an admission was the scheduler's own cost."""
        return self._match_prefix(seq) if seq.shareable else []

    def can_allocate(self, seq: Sequence, reserve: int = 0, hits: list[Block] | None = None) -> bool:
        """Whether seq's blocks fit with `reserve` blocks left over; `hits`: `match(seq)`, if
        already made (the pool unchanged since)."""
        hits = self.match(seq) if hits is None else hits
        need = self.blocks_for(len(seq.token_ids)) - len(hits) + sum(b.ref == 0 for b in hits)
        return need + reserve <= self.num_free

    def allocate(self, seq: Sequence, hits: list[Block] | None = None) -> None:
        """Give seq blocks for all its tokens, sharing cached prefix blocks (`hits`: `match(seq)`,
        if already made, the pool unchanged since); sets num_computed to the tokens those blocks
        already hold."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.id} already holds blocks")
        hits = self.match(seq) if hits is None else hits
        if not self.can_allocate(seq, hits=hits):
            raise NoFreeBlocks(f"sequence {seq.id} needs more KV blocks than are free")
        for b in hits:
            if b.ref == 0:
                del self._free[b.id]
                self._is_free[b.id] = False
            b.ref += 1
            seq.block_table.append(b.id)
            seq.block_hashes.append(b.hash)
        seq.num_cached = seq.num_computed = len(hits) * self.block_size
        self._grow(seq, self.blocks_for(len(seq.token_ids)) - len(hits))

    def _grow(self, seq: Sequence, n: int) -> None:
        """n more blocks at the end of seq's table, placed (module docstring)."""
        if n <= 0:
            return
        if not CONTIGUOUS:
            for _ in range(n):
                seq.block_table.append(self._take().id)
            return
        opened: np.ndarray | None = None  # computed when first needed (a pass over the pool)
        for _ in range(n):
            nxt = seq.block_table[-1] + 1 if seq.block_table else -1
            if not (0 <= nxt < len(self.blocks) and self._is_free[nxt] and not self._cached[nxt]):
                if opened is None:
                    opened = self._open()
                if not (0 <= nxt < len(self.blocks) and opened[nxt]):
                    nxt = self._run_start(opened)
            b = self._take(nxt)
            if opened is not None:
                opened[b.id] = False
            seq.block_table.append(b.id)

    def _open(self) -> np.ndarray:
        """Free blocks that may be taken out of the free list's order: those holding no cached
        prefix, and cached ones among the older half of the free list."""
        opened = self._is_free & ~self._cached
        cached = self._is_free & self._cached
        if cached.any():
            ages = self._freed_at[self._is_free]
            mid = (len(ages) - 1) // 2
            opened |= cached & (self._freed_at <= np.partition(ages, mid)[mid])
        return opened

    def _run_start(self, opened: np.ndarray) -> int | None:
        """Where a new run of blocks starts: the longest run of open blocks, at its start, or at
        its middle when a live block comes just before it. None: no block is open."""
        edges = np.diff(np.concatenate(([0], opened.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if not len(starts):
            return None
        i = int(np.argmax(ends - starts))
        s, e = int(starts[i]), int(ends[i])
        if s > 0 and self.blocks[s - 1].ref > 0:
            return s + (e - s) // 2
        return s

    def _take(self, bid: int | None = None) -> Block:
        """Block bid, or the least recently freed one; a cached prefix it held is forgotten."""
        if not self._free:
            raise NoFreeBlocks("the KV pool is full")
        if bid is None:
            bid, _ = self._free.popitem(last=False)
        else:
            del self._free[bid]
        b = self.blocks[bid]
        if b.hash is not None and self._by_hash.get(b.hash) == bid:
            del self._by_hash[b.hash]
        b.hash, b.tokens, b.ref = None, (), 1
        self._is_free[bid] = self._cached[bid] = False
        return b

    def ensure_capacity(self, seq: Sequence, n_tokens: int) -> None:
        """Make seq's table cover n_tokens (one more block at most per decode step)."""
        self._grow(seq, self.blocks_for(n_tokens) - len(seq.block_table))

    def register(self, seq: Sequence) -> None:
        """Publish seq's newly filled full blocks for sharing (only exact, computed KV)."""
        if not seq.shareable:
            return
        bs = self.block_size
        for j in range(len(seq.block_hashes), seq.num_computed // bs):
            toks = tuple(seq.token_ids[j * bs : (j + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, seq.salt, toks)
            b = self.blocks[seq.block_table[j]]
            b.hash, b.tokens = h, toks
            if self._by_hash.setdefault(h, b.id) == b.id:
                self._cached[b.id] = True
            seq.block_hashes.append(h)

    def free(self, seq: Sequence) -> None:
        for bid in reversed(seq.block_table):  # tail first: the prefix stays cached longest
            b = self.blocks[bid]
            b.ref -= 1
            if b.ref == 0:
                self._free[bid] = None
                self._is_free[bid] = True
                self._clock += 1
                self._freed_at[bid] = self._clock
        seq.block_table, seq.block_hashes = [], []
        seq.num_computed = seq.num_cached = 0

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat pool slots of token positions start..end-1 of seq."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def key_slots(self, seq: Sequence, n: int) -> np.ndarray:
        """`slots(seq, 0, n)` as an int64 array, kept on the sequence between steps
        (`KeySlots`): a decode step asks for every key's slot of every row, and only the new
        positions' are computed."""
        ks = seq.key_slots
        if ks is None:
            ks = seq.key_slots = KeySlots()
        return ks.upto(seq.block_table, n, self.block_size)

    def utilization(self, seqs: Iterable[Sequence]) -> tuple[int, int]:
        """(used, allocated) token slots over the blocks the live sequences hold; a shared
        block counts once."""
        fill: dict[int, int] = {}
        for s in seqs:
            n = s.num_computed
            for j, bid in enumerate(s.block_table):
                fill[bid] = max(fill.get(bid, 0), min(self.block_size, max(0, n - j * self.block_size)))
        return sum(fill.values()), len(fill) * self.block_size


class KeySlots:
    """A sequence's flat pool slots of positions 0..n-1, grown a step at a time.

    A decode step's attention reads every key of every row by its slot. Built from the block
    tables by tensor ops each step, that was ~10 small torch calls a step, each slow after a
    step's layers have passed ~60 MB of weights through the caches (~0.2 ms of a 3.9 ms
    one-stream step on the Zen 4 VM, 2026-11-29); kept here in numpy, a step adds its new
    position's slot with scalar work. The table prefix the slots were computed from is kept
    too: where the table changed under them (a block copied on write, a preempted sequence
    given new blocks), they are computed again."""

    __slots__ = ("buf", "n", "table")

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.int64)
        self.n = 0  # positions whose slot is in buf
        self.table: list[int] = []  # the block table entries those slots were read from

    def upto(self, table: list[int], n: int, bs: int) -> np.ndarray:
        """The slots of positions 0..n-1 (a view of the kept array: read it before the next call)."""
        if table[: len(self.table)] != self.table:
            self.n, self.table = 0, []  # computed again from this table, which is then the one kept
        if n > len(table) * bs:
            raise ValueError(f"a block table of {len(table)} blocks has no slot for position {n - 1}")
        if n > self.n:
            if n > len(self.buf):
                buf = np.empty(max(n, 2 * len(self.buf), 64), dtype=np.int64)
                buf[: self.n] = self.buf[: self.n]
                self.buf = buf
            if n - self.n == 1:
                p = self.n
                self.buf[p] = table[p // bs] * bs + p % bs
            else:
                p = np.arange(self.n, n)
                self.buf[self.n : n] = np.asarray(table[: -(-n // bs)], dtype=np.int64)[p // bs] * bs + p % bs
            self.n = n
            if len(self.table) * bs < n:
                self.table = table[: -(-n // bs)]
        return self.buf[:n]
