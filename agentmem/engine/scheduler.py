"""Which tokens run in the next forward: continuous batching with chunked prefill, shared
fairly between tenants.

Every step first gives each running sequence that is decoding its one token (so a long
prompt arriving never stalls the streams already running), then spends at most
`prefill_chunk` tokens on prompts (`idle_chunk` when no sequence is decoding and one tenant
alone has work: there is nothing to stall then, and one large forward is faster than many
small ones), admitting waiting requests while there is room in the batch and in the KV pool.

Tenants share the engine by weighted fair queueing; a sequence's tenant is its `salt` (the
KV namespace), its weight `weights.get(tenant, 1)`, and within a tenant it is first come,
first served:

- Decode slots. A tenant's share is `max_batch` split by weight among the tenants with work
  (running or waiting). While another tenant waits, a tenant at or over its share is admitted
  nothing more; one alone may fill the batch up to `tenant_cap` (default: all but an eighth
  of it, so a newcomer usually finds a slot free). A waiting tenant under its share that finds
  the batch (or the KV pool) full takes a slot from the tenant furthest over its own: that
  tenant's newest sequence is preempted (its blocks freed, recomputed later; its full blocks
  usually stay cached, so the recompute is mostly prefix hits).
- Prefill budget. Each step's budget is split by weight among the tenants with prompt tokens
  to run; a tenant that needs less leaves the rest to the others. Tenants are served in order
  of the prefill tokens they have been given over their weight (a tenant that was idle starts
  level with the least served), so a flood of long prompts cannot keep another tenant's short
  one waiting. A prompt the prefill planner fills runs alone in a step's whole budget; its
  tenant goes first once it is the least served.
- Preemption when the KV pool runs out takes the newest sequence of the tenant holding the
  most slots for its weight.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
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
                 tenant_cap: int | None = None, weights: Mapping[str, float] | None = None):
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be positive")
        if weights and min(weights.values()) <= 0:
            raise ValueError("tenant weights must be positive")
        self.blocks = blocks
        self.max_batch = max_batch
        self.tenant_cap = max(1, tenant_cap if tenant_cap else max_batch - max(1, max_batch // 8))
        self.prefill_chunk = prefill_chunk
        self.idle_chunk = max(idle_chunk, prefill_chunk)
        self.weights: dict[str, float] = dict(weights or {})
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.served: dict[str, float] = {}  # prefill tokens given per tenant, over its weight
        self._preempted: set[int] = set()

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

    # --- shares ------------------------------------------------------------------------
    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def _running_per_tenant(self) -> Counter:
        return Counter(seq.salt for seq in self.running)

    def shares(self) -> dict[str, float]:
        """Each tenant with work: its share of the batch's slots (`max_batch` split by weight)."""
        active = {s.salt for s in self.running} | {s.salt for s in self.waiting}
        total = sum(self.weight(t) for t in active)
        return {t: self.max_batch * self.weight(t) / total for t in active}

    def _heaviest(self, counts: Counter) -> str:
        return max(counts, key=lambda t: counts[t] / self.weight(t))

    def _victim(self) -> Sequence:
        """The newest sequence of the tenant holding the most slots for its weight."""
        heaviest = self._heaviest(self._running_per_tenant())
        return next(seq for seq in reversed(self.running) if seq.salt == heaviest)

    def _over_share(self, counts: Counter, shares: dict[str, float], but: str) -> Sequence | None:
        """The newest sequence of the tenant furthest over its share (other than `but`), if any is over."""
        over = [t for t in counts if t != but and counts[t] > shares.get(t, 0) and counts[t] > 1]
        if not over:
            return None
        t = max(over, key=lambda t: counts[t] / shares[t])
        return next(seq for seq in reversed(self.running) if seq.salt == t)

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self.blocks.free(seq)
        if seq.parts is not None and seq.generated:
            seq.parts = None  # the planner fills a prompt, not a reply: the recompute runs the model
        self.waiting.appendleft(seq)

    # --- a step ------------------------------------------------------------------------
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
        decoding = bool(batch)
        tenants = {s.salt for s in self.running} | {s.salt for s in self.waiting}
        # one large prefill forward only when one tenant alone has work: with two, another's
        # prompt would wait behind the whole of it
        full = self.idle_chunk if len(tenants) <= 1 and not decoding else self.prefill_chunk
        self._level(tenants)
        self._preempted: set[int] = set()  # ids of the sequences preempted this step
        batch += self._prefill(full)
        # a sequence preempted for a tenant under its share leaves this step's decodes too
        running = {s.id for s in self.running}
        return [sc for sc in batch if sc.seq.id in running]

    def _level(self, tenants: set[str]) -> None:
        """A tenant that had no work starts level with the least served of those that had:
        being idle earns no credit to flood with later."""
        for t in [t for t in self.served if t not in tenants]:
            del self.served[t]
        floor = min(self.served.values(), default=0.0)
        for t in tenants:
            self.served.setdefault(t, floor)

    def _prefill(self, full: int) -> list[Scheduled]:
        """This step's prompt chunks: the budget split by weight among tenants with prompt
        work, least served first, FIFO within a tenant (running prompts before admissions)."""
        given: dict[int, Scheduled] = {}
        budget = full
        counts = self._running_per_tenant()
        shares = self.shares()
        queues: dict[str, list[Sequence]] = {}
        for seq in self.running:
            if seq.num_pending > 1:
                queues.setdefault(seq.salt, []).append(seq)
        waiting = set()
        for seq in self.waiting:
            queues.setdefault(seq.salt, []).append(seq)
            waiting.add(seq.id)
        stuck: set[str] = set()  # tenants whose next request cannot be admitted this step
        for second in (False, True):  # first each tenant's quota, then what is left, in the same order
            order = [t for t in sorted(queues, key=lambda t: self.served[t]) if t not in stuck]
            weight = sum(self.weight(t) for t in order)
            for t in order:
                quota = budget if second else max(1, round(full * self.weight(t) / weight))
                while queues[t] and quota > 0 and budget > 0:
                    seq = queues[t][0]
                    sc = given.get(seq.id)
                    if sc is None and seq.id in waiting:
                        sc = self._admit(seq, counts, shares, min(quota, budget), budget == full)
                        if sc is None:
                            stuck.add(t)
                            break
                        given[seq.id] = sc
                        n = sc.n
                        if sc.plan:
                            budget = 0  # a planner prefill runs alone in its step's prefill budget
                    else:
                        n = min(seq.num_pending - (sc.n if sc else 0), quota, budget)
                        if sc is None:
                            given[seq.id] = Scheduled(seq, n)
                        else:
                            sc.n += n
                    if given[seq.id].n >= seq.num_pending:
                        queues[t].pop(0)
                    budget -= n
                    quota -= n
                    self.served[t] += n / self.weight(t)
        running = {s.id for s in self.running}
        return [sc for sc in given.values() if sc.seq.id in running]

    def _admit(self, seq: Sequence, counts: Counter, shares: dict[str, float], budget: int,
               whole: bool) -> Scheduled | None:
        """Admit a waiting sequence and return its first chunk, or None when it must wait: its
        tenant is at its cap, or at its share while another tenant waits, or the batch or pool
        is full and no tenant over its share can give up a slot."""
        t = seq.salt
        if counts[t] >= self.tenant_cap:
            return None
        others_wait = any(s.salt != t for s in self.waiting)
        if others_wait and counts[t] >= max(1.0, shares[t]):
            return None
        plan = seq.parts is not None
        if plan and not whole:
            return None  # a planner prefill runs alone in its step's prefill budget
        if seq.id in self._preempted:
            return None  # not back in the step it gave up its slot
        while True:
            hits = self.blocks.match(seq)
            room = len(self.running) < self.max_batch
            if room and self.blocks.can_allocate(seq, reserve=len(self.running), hits=hits):
                break
            # full: a tenant under its share takes a slot (or blocks) from the one furthest over its own
            victim = self._over_share(counts, shares, t) if counts[t] + 1 <= shares[t] else None
            if victim is None:
                return None
            self._preempt(victim)
            self._preempted.add(victim.id)
            counts[victim.salt] -= 1
        self.waiting.remove(seq)
        counts[t] += 1
        self.blocks.allocate(seq, hits)
        self.running.append(seq)
        n = seq.num_pending if plan else min(seq.num_pending, budget)
        return Scheduled(seq, n, plan)
