"""Which tokens run in the next forward: continuous batching with chunked prefill.

Every step first gives each running sequence that is decoding its one token (so a long
prompt arriving never stalls the streams already running), then spends at most
`prefill_chunk` tokens on prompts, oldest first (`idle_chunk` when no sequence is decoding:
there is nothing to stall then, and one large forward is faster than many small ones), admitting waiting requests while there is
room in the batch and in the KV pool. When a decode needs a block and the pool is full, the
most recently admitted sequence is preempted: its blocks are freed and it is recomputed later
(its full blocks usually stay cached, so the recompute is mostly prefix hits).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager, NoFreeBlocks
from .sequence import Sequence


@dataclass
class Scheduled:
    seq: Sequence
    n: int  # tokens to run, starting at seq.num_computed
    plan: bool = False  # fill the KV with the prefill planner instead of running the model


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, prefill_chunk: int, idle_chunk: int = 8192):
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be positive")
        self.blocks = blocks
        self.max_batch = max_batch
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
                    victim = self.running[-1]
                    self._preempt(victim)
                    batch = [s for s in batch if s.seq is not victim]
                    if victim is seq:
                        break
        budget = full = self.prefill_chunk if batch else self.idle_chunk
        for seq in self.running:
            if seq.num_pending > 1 and budget > 0:
                n = min(seq.num_pending, budget)
                batch.append(Scheduled(seq, n))
                budget -= n
        while self.waiting and len(self.running) < self.max_batch and budget > 0:
            seq = self.waiting[0]
            plan = seq.parts is not None
            if plan and budget < full:
                break  # a planner prefill runs alone in its step's prefill budget
            if not self.blocks.can_allocate(seq, reserve=len(self.running)):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            self.running.append(seq)
            n = seq.num_pending if plan else min(seq.num_pending, budget)
            batch.append(Scheduled(seq, n, plan))
            budget = 0 if plan else budget - n
        return batch
