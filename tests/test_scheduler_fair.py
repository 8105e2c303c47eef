"""Fair share between tenants (issue 18 item 1): in the engine's scheduler one tenant's 16
streams do not starve another's one, and the service runs only a few of one tenant's memory
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
    assert running.count("noisy") == sched.tenant_cap == 14


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
