"""Fair share between tenants: in the engine's scheduler one tenant's 16
streams do not starve another's one (decode slots and prefill budget shared by weight,
preemption of the tenant over its share), and the service runs only a few of one tenant's memory
requests at once. Pure scheduling, no model."""

from __future__ import annotations

from agentmem.engine.block_manager import BlockManager
from agentmem.engine.sampler import SamplingParams
from agentmem.engine.scheduler import Scheduler
from agentmem.engine.sequence import Sequence


def _seq(tenant: str, n: int = 6) -> Sequence:
    return Sequence(list(range(100, 100 + n)), SamplingParams(max_tokens=8), max_new=8, salt=tenant)


def _decode_all(sched: Scheduler) -> None:
    """Pretend the batch ran: every scheduled sequence computed its tokens and sampled one."""
    for sc in sched.schedule():
        sc.seq.num_computed += sc.n
        sc.seq.token_ids.append(1)


def test_a_quiet_tenant_is_admitted_beside_a_flood():
    sched = Scheduler(BlockManager(512, 16), max_batch=16, prefill_chunk=512)
    for _ in range(32):
        sched.add(_seq("noisy"))
    sched.add(_seq("quiet"))  # arrives last
    _decode_all(sched)
    running = [s.salt for s in sched.running]
    assert "quiet" in running  # first-come-first-served would have filled all 16 slots with noisy
    assert running.count("noisy") == 8  # its share while quiet waited: half the batch
    _decode_all(sched)  # nobody else waits now: noisy fills up to its cap
    assert [s.salt for s in sched.running].count("noisy") == sched.tenant_cap == 14


def test_waiting_tenants_take_turns_and_one_tenant_alone_still_batches():
    sched = Scheduler(BlockManager(512, 16), max_batch=4, prefill_chunk=512, tenant_cap=4)
    for t in ("a", "a", "a", "a", "a", "b", "c"):
        sched.add(_seq(t))
    _decode_all(sched)
    assert sorted(s.salt for s in sched.running) == ["a", "a", "b", "c"]  # fewest running first
    alone = Scheduler(BlockManager(512, 16), max_batch=16, prefill_chunk=512)
    for _ in range(20):
        alone.add(_seq("only"))
    _decode_all(alone)
    assert len(alone.running) == alone.tenant_cap == 14


def _run(sched: Scheduler) -> list:
    """One step as the engine loop runs it: every scheduled sequence computes its tokens and
    samples one once its prompt is in; a sequence that reached max_new is finished."""
    batch = sched.schedule()
    for sc in batch:
        sc.seq.num_computed += sc.n
        if sc.seq.num_pending == 0:
            sc.seq.token_ids.append(1)
            if len(sc.seq.generated) >= sc.seq.max_new:
                sched.remove(sc.seq)
    return batch


def _long(tenant: str, n: int = 6, new: int = 10_000) -> Sequence:
    return Sequence(list(range(100, 100 + n)), SamplingParams(max_tokens=new), max_new=new, salt=tenant)


def test_a_tenant_under_its_share_takes_a_slot_from_the_one_over_its_own():
    sched = Scheduler(BlockManager(4096, 16), max_batch=8, prefill_chunk=512, tenant_cap=8)
    for _ in range(8):
        sched.add(_long("a"))
    for _ in range(3):
        _run(sched)
    assert [s.salt for s in sched.running] == ["a"] * 8  # alone, it may fill the batch
    sched.add(_seq("b"))
    sched.add(_seq("b"))
    batch = _run(sched)
    running = [s.salt for s in sched.running]
    assert running.count("b") == 2 and running.count("a") == 6 and sched.preemptions == 2
    # the two preempted are a's newest, waiting first in line, and out of this step's batch
    assert [s.salt for s in sched.waiting] == ["a", "a"]
    assert all(sc.seq in sched.running for sc in batch)
    for _ in range(20):  # b's two finish; a gets its slots back (nobody else waits)
        _run(sched)
    assert [s.salt for s in sched.running] == ["a"] * 8 and not sched.waiting


def test_slots_follow_the_weights():
    sched = Scheduler(BlockManager(4096, 16), max_batch=8, prefill_chunk=512, tenant_cap=8,
                      weights={"gold": 3.0})
    for _ in range(8):
        sched.add(_long("plain"))
        sched.add(_long("gold"))
    for _ in range(3):
        _run(sched)
    running = [s.salt for s in sched.running]
    assert running.count("gold") == 6 and running.count("plain") == 2


def test_the_prefill_budget_is_split_between_tenants_with_prompts():
    sched = Scheduler(BlockManager(4096, 16), max_batch=8, prefill_chunk=64, idle_chunk=64)
    sched.add(_long("a", n=1000))
    sched.add(_long("a", n=1000))
    _run(sched)
    sched.add(_seq("b", n=10))  # a short prompt arrives while a's long ones are being prefilled
    batch = _run(sched)
    given = {sc.seq.salt: 0 for sc in batch}
    for sc in batch:
        given[sc.seq.salt] += sc.n
    assert given == {"a": 54, "b": 10}  # b's whole prompt in its first step; a keeps the rest
    # two tenants with long prompts: the tokens each is given stay level
    for _ in range(10):
        sched.add(_long("b", n=1000))
    totals = {"a": 0, "b": 0}
    for _ in range(20):
        for sc in _run(sched):
            if sc.n > 1:
                totals[sc.seq.salt] += sc.n
    assert totals["a"] == totals["b"] == 20 * 32


def test_a_planned_prompt_is_not_kept_waiting_by_anothers_chunks():
    sched = Scheduler(BlockManager(4096, 16), max_batch=8, prefill_chunk=64)
    for _ in range(4):
        sched.add(_long("a", n=2000))
    _run(sched)
    planned = _seq("b", n=300)
    planned.parts = [(planned.token_ids, True, None)]  # the prefill planner fills it, whole
    sched.add(planned)
    steps = 0
    while not any(sc.plan for sc in _run(sched)):
        steps += 1
        assert steps < 5, "the planned prompt waits behind a's chunks"
    # preempted after it began its reply, it is recomputed by the model: the planner fills prompts only
    assert planned.generated
    sched._preempt(planned)
    assert planned.parts is None and planned.num_pending == len(planned.token_ids)


def test_a_short_request_takes_as_many_steps_beside_eight_long_streams_as_alone():
    """The scheduling half of the fairness figure: a 4-token reply to a short prompt needs 4
    steps alone, and 4 beside another tenant's 8 streams that never end (on the engine it is
    the same number of forwards, each a row wider)."""

    def steps_for_short(sched: Scheduler) -> int:
        seq = Sequence(list(range(100, 140)), SamplingParams(max_tokens=4), max_new=4, salt="short")
        sched.add(seq)
        n = 0
        while seq in sched.running or seq in sched.waiting:
            _run(sched)
            n += 1
        return n

    alone = steps_for_short(Scheduler(BlockManager(4096, 16), max_batch=8, prefill_chunk=512))
    busy = Scheduler(BlockManager(4096, 16), max_batch=8, prefill_chunk=512)
    for _ in range(8):
        busy.add(_long("long", n=400))
    for _ in range(5):
        _run(busy)
    assert len(busy.running) == 7  # its cap: an eighth of the batch stays free
    beside = [steps_for_short(busy) for _ in range(3)]
    assert alone == 4 and beside == [4, 4, 4]
    busy.add(_long("long", n=400))  # a ninth long stream queues behind its tenant's cap
    assert steps_for_short(busy) == 4


def test_preemption_takes_from_the_tenant_holding_the_most():
    sched = Scheduler(BlockManager(8, 4), max_batch=8, prefill_chunk=64, tenant_cap=8)
    for t in ("big", "big", "small"):
        sched.add(_seq(t, n=7))
    _decode_all(sched)
    assert len(sched.running) == 3
    for _ in range(3):  # decoding past 8 tokens needs a third block each: someone is preempted
        _decode_all(sched)
    assert sched.preemptions == 1
    # the newest sequence overall is small's, yet the one preempted is big's
    assert [s.salt for s in sched.waiting] == ["big"] and "small" in [s.salt for s in sched.running]


def test_a_tenants_memory_requests_wait_their_turn_others_do_not():
    import threading
    import time

    import pytest

    from agentmem.api.errors import ApiError
    from agentmem.api.limits import TenantSlots

    slots = TenantSlots(limit=2, wait_s=0.2)
    release = threading.Event()
    running = []

    def busy():
        with slots.hold("noisy"):
            running.append(1)
            release.wait(5)

    threads = [threading.Thread(target=busy) for _ in range(2)]
    for t in threads:
        t.start()
    while len(running) < 2:
        time.sleep(0.01)
    with pytest.raises(ApiError) as refused:  # a third of noisy's waits, then is told to retry
        with slots.hold("noisy"):
            pass
    assert refused.value.status == 429
    t = time.perf_counter()
    with slots.hold("quiet"):  # another tenant is not held up at all
        assert time.perf_counter() - t < 0.05
    release.set()
    for th in threads:
        th.join()
    with slots.hold("noisy"):
        pass


def _grant_order(gate, queued: list[tuple[str, float]], holder: str = "holder") -> list[str]:
    """Hold `gate` as `holder`, queue one thread per (owner, cost) in that order, release,
    and return the owners in the order they got their turns."""
    import threading
    import time

    order: list[str] = []
    gate.acquire(holder, 100.0)
    threads = []
    for i, (owner, cost) in enumerate(queued):
        def take(owner=owner, cost=cost):
            with gate.turn(owner, cost):
                order.append(owner)
        threads.append(threading.Thread(target=take))
        threads[-1].start()
        deadline = time.monotonic() + 5
        while gate.waiting() < i + 1 and time.monotonic() < deadline:
            time.sleep(0.001)
    gate.release()
    for t in threads:
        t.join(5)
    return order


def test_fair_gate_serves_an_idle_owner_before_a_backlog():
    from agentmem.fair import FairGate

    gate = FairGate()
    order = _grant_order(gate, [("noisy", 100.0)] * 6 + [("quiet", 100.0)], holder="noisy")
    assert order[0] == "quiet"  # a plain lock (FIFO at best) would serve it seventh
    assert order[1:] == ["noisy"] * 6


def test_fair_gate_shares_turns_between_backlogged_owners_by_cost():
    from agentmem.fair import FairGate

    order = _grant_order(FairGate(), [("a", 10.0)] * 4 + [("b", 10.0)] * 4)
    assert order == ["a", "b"] * 4
    # b's turns cost twice a's: a gets two turns for each of b's
    order = _grant_order(FairGate(), [("a", 10.0)] * 6 + [("b", 20.0)] * 3)
    assert order == ["a", "b", "a", "a", "b", "a", "a", "b", "a"]


def test_embedder_turns_are_bounded_and_keep_the_order(embedder):
    import numpy as np

    from agentmem.tiers.embed import BATCH, TURN_CHARS, _turns

    lengths = [10] * 100 + [900, 1500, 5000, 30]
    runs = _turns(lengths)
    assert sorted(i for r in runs for i in r) == list(range(len(lengths)))
    assert all(len(r) <= BATCH and (len(r) == 1 or sum(lengths[i] for i in r) <= TURN_CHARS) for r in runs)
    texts = ["a dog called Pepper " * 60, "rice and beans", "a weekend trip " * 150, "hello"]
    one_by_one = np.concatenate([embedder.embed([t]) for t in texts])
    together = embedder.embed(texts, owner="tenant-a")
    np.testing.assert_allclose(together, one_by_one, atol=2e-2)  # bf16 batches pad differently
    assert [int(np.argmax(together @ v)) for v in one_by_one] == [0, 1, 2, 3]


def test_a_tenants_queue_is_bounded_past_it_429_at_once():
    import threading
    import time

    import pytest

    from agentmem.api.errors import ApiError
    from agentmem.api.limits import TenantSlots

    slots = TenantSlots(limit=1, wait_s=30, queue=2, what="chat turns")
    release = slots.enter("noisy")
    waiters = [threading.Thread(target=lambda: slots.enter("noisy")()) for _ in range(2)]
    for t in waiters:
        t.start()
    while slots._waiting.get("noisy", 0) < 2:
        time.sleep(0.01)
    t0 = time.perf_counter()
    with pytest.raises(ApiError) as refused:  # the queue is full: refused without waiting
        slots.enter("noisy")
    assert time.perf_counter() - t0 < 1.0
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
    slots.enter("quiet")()  # another tenant's queue is its own
    release()
    release()  # giving back twice gives back once
    for t in waiters:
        t.join(5)
    assert not any(t.is_alive() for t in waiters) and "noisy" not in slots._waiting


def test_one_large_prefill_only_when_one_tenant_alone_has_work():
    alone = Scheduler(BlockManager(512, 16), max_batch=4, prefill_chunk=8, idle_chunk=64)
    alone.add(_seq("a", n=40))
    assert [sc.n for sc in alone.schedule()] == [40]  # nobody to stall: the whole prompt at once
    shared = Scheduler(BlockManager(512, 16), max_batch=4, prefill_chunk=8, idle_chunk=64)
    shared.add(_seq("a", n=40))
    shared.add(_seq("b", n=40))
    assert sum(sc.n for sc in shared.schedule()) == 8  # b's prompt waits for one chunk, not for all of a's


def test_bulk_embedding_runs_on_a_lower_priority_thread_queries_do_not():
    """A long text's turns run on the embedder's own bulk thread at nice +bulk_nice (the
    kernel serves queries and the engine first on a busy machine); a query runs on the
    caller's thread at its priority; errors come back to the caller."""
    import os
    import threading

    import numpy as np
    import pytest

    from agentmem.tiers.embed import QUICK_CHARS, Embedder

    class Model:
        seen: list[tuple[int, int]] = []

        def get_sentence_embedding_dimension(self):
            return 4

        def encode(self, texts, **kw):
            if any("boom" in t for t in texts):
                raise RuntimeError("boom")
            tid = threading.get_native_id()
            self.seen.append((tid, os.getpriority(os.PRIO_PROCESS, tid)))
            return np.ones((len(texts), 4), dtype=np.float32)

    model = Model()
    mine = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, mine)
    emb = Embedder(model, bulk_threads=1, bulk_nice=7)
    assert emb.embed(["where did I park?"]).shape == (1, 4)
    assert model.seen[-1] == (mine, base)
    assert emb.embed(["x" * (QUICK_CHARS + 1), "y" * 3000], owner="t").shape == (2, 4)
    bulk = model.seen[-2:]
    assert all(tid != mine and nice == min(19, base + 7) for tid, nice in bulk)
    assert os.getpriority(os.PRIO_PROCESS, mine) == base  # the caller's own priority is untouched
    with pytest.raises(RuntimeError, match="boom"):
        emb.embed(["boom " * 200])
    plain = Embedder(model, bulk_nice=0)
    plain.embed(["z" * 3000])
    assert model.seen[-1] == (mine, base)
