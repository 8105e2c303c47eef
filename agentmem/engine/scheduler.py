"""Which tokens run in the next forward: continuous batching with chunked prefill.

Every step first gives each running sequence that is decoding its one token (so a long
prompt arriving never stalls the streams already running), then spends at most
`prefill_chunk` tokens on prompts, oldest first (`idle_chunk` when no sequence is decoding
and one tenant alone has work: there is nothing to stall then, and one large forward is
faster than many small ones), admitting waiting requests while there is
room in the batch and in the KV pool. When a decode needs a block and the pool is full, the
most recently admitted sequence is preempted: its blocks are freed and it is recomputed later
(its full blocks usually stay cached, so the recompute is mostly prefix hits).

Tenants share the batch fairly: a sequence's tenant is its `salt` (the KV namespace). No
tenant may hold more than `tenant_cap` of the batch's slots (default: all but an eighth,
so a tenant running 16 streams still leaves room for another tenant's one), waiting
requests are admitted tenant by tenant, the tenant with the fewest running first (first
come, first served within a tenant), prompt chunks are handed out in the same order, and
preemption takes the newest sequence of the tenant holding the most.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from .block_manager import BlockManager, NoFreeBlocks
from .sequence import Sequence


@dataclass
class Scheduled:
    seq: Sequence
    n: int  # tokens to run, starting at seq.num_computed
    plan: bool = False  # fill the KV with the prefill planner instead of running the model


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, prefill_chunk: int, idle_chunk: int = 8192,
                 tenant_cap: int | None = None):
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be positive")
        self.blocks = blocks
        self.max_batch = max_batch
        self.tenant_cap = max(1, tenant_cap if tenant_cap else max_batch - max(1, max_batch // 8))
        self.prefill_chunk = prefill_chunk
        self.idle_chunk = max(idle_chunk, prefill_chunk)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def _running_per_tenant(self) -> Counter:
        return Counter(seq.salt for seq in self.running)

    def _victim(self) -> Sequence:
        """The newest sequence of the tenant with the most running."""
        counts = self._running_per_tenant()
        heaviest = max(counts, key=lambda t: counts[t])
        return next(seq for seq in reversed(self.running) if seq.salt == heaviest)

    def _next_waiting(self, counts: Counter) -> Sequence | None:
        """The oldest waiting sequence of the tenant with the fewest running, among tenants
        under the cap."""
        best: Sequence | None = None
        for seq in self.waiting:
            n = counts[seq.salt]
            if n < self.tenant_cap and (best is None or n < counts[best.salt]):
                best = seq
        return best

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self.blocks.free(seq)
        self.waiting.appendleft(seq)

    def schedule(self) -> list[Scheduled]:
        batch: list[Scheduled] = []
        for seq in list(self.running):
            if seq.num_pending != 1 or seq not in self.running:
                continue
            while True:
                try:
                    self.blocks.ensure_capacity(seq, len(seq.token_ids))
                    batch.append(Scheduled(seq, 1))
                    break
                except NoFreeBlocks:
                    victim = self._victim()
                    self._preempt(victim)
                    batch = [s for s in batch if s.seq is not victim]
                    if victim is seq:
                        break
        # one large prefill forward only when one tenant alone has work: with two, another's
        # prompt would wait behind the whole of it
        alone = len({s.salt for s in self.running} | {s.salt for s in self.waiting}) <= 1
        budget = full = self.idle_chunk if alone and not batch else self.prefill_chunk
        counts = self._running_per_tenant()
        # prompt chunks: the tenants running least go first (a flood's prefills queue behind
        # a quiet tenant's, never the reverse); sorted() keeps arrival order within a tenant
        for seq in sorted((s for s in self.running if s.num_pending > 1), key=lambda s: counts[s.salt]):
            if budget > 0:
                n = min(seq.num_pending, budget)
                batch.append(Scheduled(seq, n))
                budget -= n
        while self.waiting and len(self.running) < self.max_batch and budget > 0:
            seq = self._next_waiting(counts)
            if seq is None:
                break  # every waiting tenant is at its cap
            plan = seq.parts is not None
            if plan and budget < full:
                break  # a planner prefill runs alone in its step's prefill budget
            hits = self.blocks.match(seq)
            if not self.blocks.can_allocate(seq, reserve=len(self.running), hits=hits):
                break
            self.waiting.remove(seq)
            counts[seq.salt] += 1
            self.blocks.allocate(seq, hits)
            self.running.append(seq)
            n = seq.num_pending if plan else min(seq.num_pending, budget)
            batch.append(Scheduled(seq, n, plan))
            budget = 0 if plan else budget - n
        return batch
