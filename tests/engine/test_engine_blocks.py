"""The paged-KV block manager on its own: refcounts, prefix sharing, freeing, utilisation."""

import pytest

from agentmem.engine import BlockManager, NoFreeBlocks, SamplingParams, block_manager
from agentmem.engine.sequence import Sequence


def seq(ids, salt=""):
    return Sequence(list(ids), SamplingParams(), max_new=4, salt=salt)


def test_allocate_covers_tokens_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    bm.allocate(s)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free == 5 and s.num_computed == 0
    assert bm.slots(s, 3, 6) == [s.block_table[0] * 4 + 3, s.block_table[1] * 4, s.block_table[1] * 4 + 1]
    bm.free(s)
    assert bm.num_free == 8 and s.block_table == []


def test_full_blocks_are_shared_by_reference_and_freed_when_last_user_leaves():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))
    bm.allocate(a)
    a.num_computed = 10
    bm.register(a)  # publishes the 2 full blocks
    b = seq(list(range(8)) + [99, 98, 97])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached == b.num_computed == 8
    assert [bm.blocks[i].ref for i in a.block_table] == [2, 2, 1]
    assert bm.num_free == 8 - 3 - 1
    bm.free(a)
    assert [bm.blocks[i].ref for i in b.block_table] == [1, 1, 1]
    bm.free(b)
    assert bm.num_free == 8


def test_freed_blocks_stay_findable_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(9))
    bm.allocate(a)
    a.num_computed = 9
    bm.register(a)
    prefix = a.block_table[:2]
    bm.free(a)
    b = seq(range(9))
    bm.allocate(b)  # same prompt after a finished: its prefix blocks come back from the free list
    assert b.block_table[:2] == prefix and b.num_cached == 8
    bm.free(b)
    c = seq(range(100, 116))  # needs all 4 blocks: the cached ones are recycled
    bm.allocate(c)
    d = seq(range(9))
    assert bm._match_prefix(d) == []


def test_prefix_match_leaves_a_token_to_compute_and_respects_salt():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(8))
    bm.allocate(a)
    a.num_computed = 8
    bm.register(a)
    same = seq(range(8))
    bm.allocate(same)
    assert same.num_cached == 4  # the last block is recomputed: its last token's logits are needed
    other_tenant = seq(range(8), salt="t2")
    bm.allocate(other_tenant)
    assert other_tenant.num_cached == 0


def test_unshareable_sequences_neither_publish_nor_match():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(9))
    a.shareable = False
    bm.allocate(a)
    a.num_computed = 9
    bm.register(a)
    b = seq(range(9))
    bm.allocate(b)
    assert b.num_cached == 0


def test_pool_exhaustion_raises_without_leaking():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq(range(8))
    bm.allocate(a)
    big = seq(range(100, 108))
    assert not bm.can_allocate(big)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(big)
    assert big.block_table == [] and bm.num_free == 1
    bm.ensure_capacity(a, 12)
    with pytest.raises(NoFreeBlocks):
        bm.ensure_capacity(a, 13)


def test_utilization_counts_shared_blocks_once():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(6))
    bm.allocate(a)
    a.num_computed = 6
    assert bm.utilization([a]) == (6, 8)
    bm.register(a)
    b = seq(list(range(4)) + [7])
    bm.allocate(b)
    b.num_computed = 5
    assert bm.utilization([a, b]) == (4 + 2 + 1, 12)


def _runs(table):
    """How many places a block table jumps (0: one run of consecutive blocks)."""
    return sum(b != a + 1 for a, b in zip(table, table[1:], strict=False))


def test_streams_growing_together_keep_their_blocks_in_runs():
    """Eight sequences decoding side by side take a block each in turn; taken from the free
    list's front, each one's blocks would lie eight apart. Placed, each grows into a run."""
    bm = BlockManager(num_blocks=256, block_size=4)
    seqs = [seq(range(100 * i, 100 * i + 10)) for i in range(8)]
    for s in seqs:
        bm.allocate(s)
    for n in range(11, 60):  # decode: one token each per step
        for s in seqs:
            bm.ensure_capacity(s, n)
    assert all(_runs(s.block_table) == 0 for s in seqs)
    assert len({b for s in seqs for b in s.block_table}) == sum(len(s.block_table) for s in seqs)
    block_manager.CONTIGUOUS = False  # the free list's order alone: the scatter this prevents
    try:
        old = BlockManager(num_blocks=256, block_size=4)
        seqs = [seq(range(100 * i, 100 * i + 10)) for i in range(8)]
        for s in seqs:
            old.allocate(s)
        for n in range(11, 60):
            for s in seqs:
                old.ensure_capacity(s, n)
        assert all(_runs(s.block_table) >= 10 for s in seqs)
    finally:
        block_manager.CONTIGUOUS = True


def test_placement_fills_the_pool_and_keeps_the_newest_cached_prefixes():
    """Runs never cost capacity: every block can still be handed out. A cached prefix freed
    recently stays findable while older free blocks remain; only the older half of the free
    list is taken out of turn."""
    bm = BlockManager(num_blocks=16, block_size=4)
    old = seq(range(200, 217))  # 5 blocks, 4 of them full
    bm.allocate(old)
    old.num_computed = 17
    bm.register(old)
    bm.free(old)
    recent = seq(range(9))  # 3 blocks, 2 full: freed last
    bm.allocate(recent)
    recent.num_computed = 9
    bm.register(recent)
    bm.free(recent)
    grower = seq(range(500, 501))
    bm.allocate(grower)
    for n in range(2, 4 * 12 + 1):  # 12 blocks: the 10 that hold no prefix, then 2 cached ones
        bm.ensure_capacity(grower, n)
    assert len(bm._match_prefix(seq(range(9)))) == 2  # the newest prefix survives
    assert len(bm._match_prefix(seq(range(200, 217)))) < 4  # an older one gave way
    everyone = [seq(range(1000 + 10 * i, 1000 + 10 * i + 4)) for i in range(bm.num_free)]
    for s in everyone:
        bm.allocate(s)
    assert bm.num_free == 0
    with pytest.raises(NoFreeBlocks):
        bm.allocate(seq(range(3000, 3004)))
    for s in [grower, *everyone]:
        bm.free(s)
    assert bm.num_free == 16 and bm._is_free.all()


def test_the_runners_kept_key_slots_are_the_per_key_list():
    """ModelRunner._key_slots_kept (a decode step's key slots from each sequence's kept slots)
    gives `_key_slots`' list exactly: ragged lengths, each row padded with its own first slot,
    tables longer than the keys they hold, one key, a block boundary."""
    import random

    import torch

    from agentmem.engine.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.blocks = torch.device("cpu"), BlockManager(num_blocks=512, block_size=16)
    rng = random.Random(3)
    for lens in ([1], [16], [17, 16, 1], [300, 5, 64, 299], [rng.randint(1, 400) for _ in range(9)]):
        seqs = []
        for n in lens:
            s = seq(range(4))
            s.block_table = rng.sample(range(512), -(-n // 16) + rng.randint(0, 2))
            seqs.append(s)
        width = max(lens)
        want = runner._key_slots(seqs, lens, width)
        got = torch.from_numpy(runner._key_slots_kept(seqs, lens, width))
        assert got.dtype == torch.long and got.tolist() == want, lens


def test_the_kept_key_slots_follow_growth_and_changed_tables():
    """The slots a decode step reads, kept on each sequence (`BlockManager.key_slots`) and grown
    a position at a time, equal `slots(seq, 0, n)` as the sequence grows a token at a time, jumps
    by a prompt, is cut back, and has a block of its table replaced under the kept slots (copy on
    write, a preempted sequence given new blocks); the runner's padded rows from them equal its
    per-key list; a position past the table is refused."""
    import random

    import torch

    from agentmem.engine.model_runner import ModelRunner

    rng = random.Random(5)
    bm = BlockManager(num_blocks=512, block_size=16)
    s = seq(range(4))
    s.block_table = rng.sample(range(512), 40)
    for n in [1, 2, 3, 15, 16, 17, 300, 301, 302, 40, 41, 303, 640]:
        assert bm.key_slots(s, n).tolist() == bm.slots(s, 0, n), n
    s.block_table[3] = 511 if s.block_table[3] != 511 else 510  # under the kept slots
    assert bm.key_slots(s, 640).tolist() == bm.slots(s, 0, 640)
    assert s.key_slots.table == s.block_table  # the new table is the one kept: next steps add to it
    s.block_table = rng.sample(range(512), 40)  # a new table altogether
    assert bm.key_slots(s, 100).tolist() == bm.slots(s, 0, 100)
    with pytest.raises(ValueError, match="no slot for position 640"):
        bm.key_slots(s, 641)

    runner = ModelRunner.__new__(ModelRunner)
    runner.device, runner.blocks = torch.device("cpu"), bm
    seqs, lens = [], [17, 300, 1, 64]
    for n in lens:
        t = seq(range(4))
        t.block_table = rng.sample(range(512), -(-n // 16) + rng.randint(0, 2))
        seqs.append(t)
    for grow in range(3):  # three steps: each row one key longer
        now = [n + grow for n in lens]
        for t, n in zip(seqs, now, strict=True):
            while len(t.block_table) * 16 < n:
                t.block_table.append(rng.randrange(512))
        assert runner._key_slots_kept(seqs, now, max(now)).tolist() == runner._key_slots(seqs, now, max(now))
    one = runner._key_slots_kept(seqs[:1], [lens[0] + 2], lens[0] + 2)
    assert one.tolist() == bm.slots(seqs[0], 0, lens[0] + 2)
    assert not np_shares(one, seqs[0].key_slots.buf)  # a step's array is its own


def np_shares(a, b) -> bool:
    import numpy as np

    return bool(np.shares_memory(a, b))


def test_an_admission_matches_its_prefix_once(monkeypatch):
    from agentmem.engine.scheduler import Scheduler

    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(10))
    bm.allocate(a)
    a.num_computed = 10
    bm.register(a)
    calls = []
    real = bm._match_prefix
    monkeypatch.setattr(bm, "_match_prefix", lambda s: calls.append(s.id) or real(s))
    sched = Scheduler(bm, max_batch=4, prefill_chunk=64)
    b = seq(list(range(8)) + [7, 7, 7])
    sched.add(b)
    batch = sched.schedule()
    assert [sc.seq for sc in batch] == [b] and calls == [b.id]  # can_allocate and allocate share one match
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached == 8
    # called alone, each still matches for itself
    c = seq(range(10))
    assert bm.can_allocate(c) and bm.match(c) == [bm.blocks[i] for i in a.block_table[:2]]
    bm.allocate(c)
    assert c.block_table[:2] == a.block_table[:2] and len(calls) == 4
