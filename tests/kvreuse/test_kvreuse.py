"""Chunk KV reuse: identity, the tiered store, prefix reuse, the CacheBlend fuser, and the
planner inside engine.generate. Short chunks keep it cheap; the model is the shared fp32 one."""

from __future__ import annotations

import json
import time

import pytest
import torch

from agentmem.bench.blend import kl
from agentmem.config import Config, resolve_kv_mode
from agentmem.engine import Engine, Segment, attend
from agentmem.engine.kernels import rope_ref, selected_attention_ref
from agentmem.kvreuse import (
    ChunkKV,
    ChunkReuse,
    ChunkStore,
    chunk_key,
    enable_chunk_reuse,
    fuser,
    get_reuse,
    place_k,
)
from agentmem.kvreuse.fuser import METRICS, Piece, RowAttention, _attend_and_share, _Drift, causal_bias, fuse

FACTS = [
    "- 2024-03-02 the user said: \"My cat is called Miso and she is four years old.\"\n",
    "- 2024-04-11 the user said: \"I moved to Lyon last spring for a job at a bakery.\"\n",
    "- 2024-05-19 the user said: \"My sister Clara works as a pilot and lives in Porto.\"\n",
    "- 2024-06-23 the user said: \"I am learning the cello and practise every Tuesday.\"\n",
]
QUESTIONS = ["What is my cat called?", "Where does my sister live?", "Which instrument am I learning?"]


def view(engine: Engine, tmp_path, **kw) -> Engine:
    """A second Engine on the shared model, so installing a planner leaves the fixture alone."""
    cfg = Config(dtype="float32", device="cpu", kv_disk_dir=tmp_path, **kw)
    return Engine(engine.model, engine.tokenizer, engine.model_id, engine.device, cfg)


def prompt(engine: Engine, order: list[int], question: str, namespace: str = "") -> list[Segment]:
    sys_open, sys_close = engine.chat.wraps["system"]
    segs = [Segment(f"{sys_open}You are a helpful assistant with notes about the user.\n", tier="system")]
    segs += [Segment(FACTS[i], tier="recall", ref=f"m{i}") for i in order]
    segs += [Segment(sys_close, tier="system"), Segment(engine.format_message("user", question), tier="user"),
             Segment(engine.chat.generation_prefix, cacheable=False, tier="generation")]
    for s in segs:
        s.namespace = namespace
    return segs


def memories(namespace: str = "") -> list[Segment]:
    return [Segment(f, tier="recall", namespace=namespace) for f in FACTS]


@pytest.fixture(scope="module")
def warm(engine, tmp_path_factory):
    """A blend-mode ChunkReuse whose memory chunks are precomputed."""
    e = view(engine, tmp_path_factory.mktemp("chunks"), kv_mode="blend")
    reuse = enable_chunk_reuse(e)
    assert reuse.precompute(memories()) == sum(len(e.encode(f)) for f in FACTS)
    return e, reuse


def kv_entry(layers=2, tokens=4, fill=0.0) -> ChunkKV:
    shape = (layers, tokens, 3, 8)
    return ChunkKV(torch.full(shape, float(fill)), torch.full(shape, float(fill) + 1))


# --- identity and the store ------------------------------------------------------------------
def test_chunk_key_depends_on_model_dtype_ids_and_namespace():
    base = chunk_key("m", torch.float32, [1, 2, 3], "a")
    assert base == chunk_key("m", torch.float32, [1, 2, 3], "a")
    others = {chunk_key("m2", torch.float32, [1, 2, 3], "a"), chunk_key("m", torch.bfloat16, [1, 2, 3], "a"),
              chunk_key("m", torch.float32, [1, 2, 4], "a"), chunk_key("m", torch.float32, [1, 2, 3], "b"),
              chunk_key("m", torch.float32, [1, 2], "a")}
    assert base not in others and len(others) == 5


def test_lru_respects_its_byte_budget_and_spills_to_disk(tmp_path):
    size = kv_entry().nbytes
    budget = int(2.5 * size)
    store = ChunkStore([("cpu", budget)], tmp_path)
    store.put("k0", "", kv_entry(fill=0))
    store.put("k1", "", kv_entry(fill=1))
    assert store.get("k0") is not None  # k1 is now the least recently used
    store.put("k2", "", kv_entry(fill=2))
    s = store.stats()
    assert set(store.tiers[0].entries) == {"k0", "k2"} and s["ram_bytes"] == 2 * size <= budget
    assert s["evictions"] == 1 and s["disk_bytes"] > size
    spilled = store.get("k1")  # read back from disk, intact; k0 leaves RAM for it
    assert spilled is not None and torch.equal(spilled.k, kv_entry(fill=1).k) and torch.equal(spilled.v, kv_entry(fill=1).v)
    assert set(store.tiers[0].entries) == {"k2", "k1"} and store.stats()["ram_bytes"] <= budget
    assert store.stats()["evictions"] == 2 and store.stats()["hits"] == 2
    reopened = ChunkStore([("cpu", 10 * size)], tmp_path)  # the disk tier survives a restart
    assert torch.equal(reopened.get("k0").k, kv_entry(fill=0).k)


def test_an_entry_larger_than_ram_goes_to_disk(tmp_path):
    store = ChunkStore([("cpu", 10)], tmp_path)
    store.put("big", "", kv_entry())
    assert store.stats()["ram_bytes"] == 0 and store.get("big") is not None


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_a_corrupt_or_torn_disk_entry_is_a_miss(tmp_path, damage):
    store = ChunkStore([("cpu", 1)], tmp_path)  # everything spills
    store.put("k", "ns", kv_entry(fill=2.0))
    path = store.disk.path("k", "ns")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-7] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"not a chunk file at all")
    path.write_bytes(bytes(data))
    assert store.get("k") is None
    assert store.stats()["misses"] == 1 and store.stats()["hits"] == 0
    assert not path.exists() and store.stats()["disk_bytes"] == 0


def test_drop_namespace_removes_every_tier(tmp_path):
    size = kv_entry().nbytes
    store = ChunkStore([("cpu", size), ("cpu", size)], tmp_path)  # two memory tiers, then disk
    for i in range(4):
        store.put(f"a{i}", "tenant-a", kv_entry(fill=i))
    store.put("b0", "tenant-b", kv_entry())
    assert store.drop_namespace("tenant-a") == 4
    assert all(store.get(f"a{i}") is None for i in range(4))
    assert store.get("b0") is not None
    assert not any(p.parent.name == store.disk.namespace_dir("tenant-a") for p in tmp_path.glob("*/*"))


class _HeldWrites:
    """Blocks the store's disk writes until released, so a test sees them waiting."""

    def __init__(self, store: ChunkStore, monkeypatch):
        import threading

        self.started, self.release = threading.Event(), threading.Event()
        real = store.disk.write_tmp

        def write_tmp(key, namespace, blob):
            self.started.set()
            assert self.release.wait(30)
            return real(key, namespace, blob)

        monkeypatch.setattr(store.disk, "write_tmp", write_tmp)


def test_write_behind_keeps_entries_readable_until_written(tmp_path, monkeypatch):
    store = ChunkStore([("cpu", kv_entry().nbytes)], tmp_path, write_behind=True)  # RAM holds one
    held = _HeldWrites(store, monkeypatch)
    for i in range(3):
        store.put(f"k{i}", "ns", kv_entry(fill=i))
    assert held.started.wait(10) and store.stats()["disk_pending"] == 2 and not list(tmp_path.glob("*/*.kv"))
    # a waiting entry (k0, its write under way) is a memory hit; taking it back cancels the
    # write, and k2 goes to wait for the disk in its place
    back, info = store.lookup("k0")
    assert info["tier"] == "ram" and torch.equal(back.k, kv_entry(fill=0).k)
    held.release.set()
    assert store.flush(30) and store.stats()["disk_pending"] == 0
    assert {p.stem for p in tmp_path.glob("*/*.kv")} == {"k1", "k2"} and set(store.tiers[0].entries) == {"k0"}
    assert not list(tmp_path.glob("*/*.tmp"))
    reopened = ChunkStore([("cpu", 1 << 20)], tmp_path)
    assert torch.equal(reopened.get("k1").v, kv_entry(fill=1).v)


def test_dropping_a_namespace_cancels_its_waiting_and_running_writes(tmp_path, monkeypatch):
    import threading

    store = ChunkStore([("cpu", 1)], tmp_path, write_behind=True)
    held = _HeldWrites(store, monkeypatch)
    store.put("a0", "tenant-a", kv_entry(fill=0))  # the write under way, held
    assert held.started.wait(10)
    store.put("a1", "tenant-a", kv_entry(fill=1))  # waiting behind it
    store.put("b0", "tenant-b", kv_entry(fill=2))
    done = []
    dropper = threading.Thread(target=lambda: done.append(store.drop_namespace("tenant-a")))
    dropper.start()
    dropper.join(0.5)
    assert dropper.is_alive()  # it waits for tenant-a's write under way
    held.release.set()
    dropper.join(30)
    assert done == [2]  # both waited for the disk; a0's file, written meanwhile, is discarded
    d = tmp_path / store.disk.namespace_dir("tenant-a")
    assert not d.exists() or not any(d.iterdir())
    assert store.flush(30) and store.get("a0") is None and store.get("a1") is None
    assert store.get("b0") is not None and (tmp_path / store.disk.namespace_dir("tenant-b") / "b0.kv").exists()


def test_write_behind_writes_on_the_callers_thread_when_too_many_wait(tmp_path, monkeypatch):
    store = ChunkStore([("cpu", 1)], tmp_path, write_behind=True, max_pending=1)
    held = _HeldWrites(store, monkeypatch)
    store.put("k0", "", kv_entry(fill=0))
    assert held.started.wait(10)  # k0 is being written (held): one waiting
    monkeypatch.setattr(store.disk, "write_tmp", type(store.disk).write_tmp.__get__(store.disk))
    store.put("k1", "", kv_entry(fill=1))  # over the limit: written at once, here
    assert store.disk.path("k1", "").exists() and store.stats()["disk_pending"] == 1
    held.release.set()
    assert store.flush(30) and store.disk.path("k0", "").exists()


# --- the fuser -------------------------------------------------------------------------------
def test_rerotated_k_equals_k_computed_at_the_new_positions(engine):
    ids = engine.encode("The lighthouse keeper counted ships until the fog rolled in.")
    n, shift = len(ids), 37
    got = {}

    def capture(at):
        pos = torch.arange(at, at + n)

        def attn(i, q, k_raw, k_rot, v):
            got.setdefault(at, []).append((k_raw, k_rot))
            return attend(q, k_rot, v, pos, pos)

        engine.model(torch.tensor(ids), pos, attn)

    capture(0)
    capture(shift)
    raw = torch.stack([k for k, _ in got[0]])  # K before RoPE, computed at positions 0..n-1
    at_new = torch.stack([k for _, k in got[shift]])  # K computed at shift..shift+n-1
    moved = place_k(engine.model, raw, torch.arange(shift, shift + n))
    assert (moved - at_new).abs().max().item() < 1e-4
    # the CUDA path rotates with the kernel; its reference gives the same K
    flat = raw.transpose(0, 1).reshape(n, -1, raw.shape[-1])
    ref = rope_ref(flat, torch.arange(shift, shift + n), engine.model.rotary.inv_freq)
    assert (ref.view(n, raw.shape[0], *raw.shape[2:]).transpose(0, 1) - moved).abs().max().item() < 1e-5


def test_blocked_selected_attention_equals_the_reference(monkeypatch):
    monkeypatch.setenv("AGENTMEM_ATTN_KERNEL", "off")  # the grouped SDPA path, not cpu_fp32's AVX-512 kernel
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(300, 3, 16, generator=g), torch.randn(300, 3, 16, generator=g)
    rows = torch.randperm(300, generator=g)[:200].sort().values
    q = torch.randn(200, 9, 16, generator=g)
    ref = selected_attention_ref(q, k, v, rows, torch.arange(300))
    for blocks in (1, 5):  # the grouped layout and the per-block masks, built at the first call, reused
        attend = RowAttention(rows, 300, dtype=torch.float32, blocks=blocks)
        assert attend.parts == []
        for _ in range(2):
            assert (attend(q, k, v) - ref).abs().max().item() < 1e-5
            assert len(attend.parts) == blocks


def test_row_attention_plans_no_sdpa_blocks_where_the_fp32_kernel_takes_the_rows():
    from agentmem.engine.kernels import cpu_fp32

    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(300, 3, 64, generator=g), torch.randn(300, 3, 64, generator=g)
    rows = torch.randperm(300, generator=g)[:64].sort().values
    q = torch.randn(64, 9, 64, generator=g)
    if cpu_fp32.rows_kernel(q, k) is None:
        pytest.skip("no fp32 rows kernel here (cpu_fp32's AVX-512 build)")
    attend = RowAttention(rows, 300, dtype=torch.float32)
    out = attend(q, k, v)
    assert (out - selected_attention_ref(q, k, v, rows, torch.arange(300))).abs().max().item() < 1e-4
    assert attend.parts == []  # no SDPA blocks planned


def test_probe_attention_equals_the_reference_and_shares_what_values_add():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(120, 3, 16, generator=g), torch.randn(120, 3, 16, generator=g)
    v[7] = 0.0  # a key with a zero value adds nothing to any output
    q_pos = torch.tensor([90, 95, 100, 101])
    q = torch.randn(4, 9, 16, generator=g)
    out, share = _attend_and_share(q, k, v, causal_bias(q_pos, 120, group=3))
    assert (out - selected_attention_ref(q, k, v, q_pos, torch.arange(120))).abs().max().item() < 1e-5
    assert share.shape == (120,) and share[7] == 0 and (share[102:] == 0).all() and (share[:102] > 0).sum() == 101


def test_probe_scores_in_bf16_rank_the_keys_as_fp32_does():
    """In a bf16 model the probe multiplies the scores in bf16 (no float copy of the keys per
    layer); its softmax and shares stay fp32, close to the fp32 ones."""
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(400, 3, 16, generator=g), torch.randn(400, 3, 16, generator=g)
    q_pos = torch.arange(380, 400)
    q = torch.randn(20, 9, 16, generator=g)
    bias = causal_bias(q_pos, 400, group=3)
    out32, share32 = _attend_and_share(q, k, v, bias)
    out16, share16 = _attend_and_share(q.bfloat16(), k.bfloat16(), v.bfloat16(), bias)
    assert out16.dtype == torch.bfloat16 and share16.dtype == torch.float32
    assert (out16.float() - out32).norm() / out32.norm() < 2e-2
    assert (share16 - share32).norm() / share32.norm() < 2e-2
    top32, top16 = set(share32.topk(60).indices.tolist()), set(share16.topk(60).indices.tolist())
    assert len(top32 & top16) >= 54


def test_drift_groups_short_chunks_until_they_give_enough_samples():
    kv = kv_entry(layers=2, tokens=100)
    pieces = [Piece(0, 10, kv_entry(2, 10), exact=True)] + [Piece(10 + 100 * i, 100, kv) for i in range(5)]
    pieces.append(Piece(510, 5))  # uncached: never sampled, never shifted
    d = _Drift.sample(pieces, share=0.04, n_tok=515, device="cpu", min_samples=8)  # groups of >= 200 tokens
    assert d.n_groups == 2  # 200 + 300 tokens: the short remainder joins the group before it
    assert (d.token_group[:10] == -1).all() and (d.token_group[510:] == -1).all()
    assert (d.token_group[10:210] == 0).all() and (d.token_group[210:510] == 1).all()
    assert [int((d.group == g).sum()) for g in (0, 1)] == [8, 12]
    assert len(set(d.pos.tolist())) == 20 and all(10 <= p < 510 for p in d.pos.tolist())
    assert d.k_raw.shape == (2, 20, 3, 8)
    # too few cached tokens for one group of min_samples: no drift at all
    assert _Drift.sample(pieces[:2], share=0.04, n_tok=110, device="cpu", min_samples=8) is None


def test_drift_shifts_the_tokens_not_recomputed_by_their_group_mean(engine):
    model, layers = engine.model, engine.model.args.n_layers
    kv_heads, hd = engine.model.args.n_kv_heads, engine.model.args.head_dim
    g = torch.Generator().manual_seed(3)
    stale = ChunkKV(torch.randn(layers, 40, kv_heads, hd, generator=g), torch.randn(layers, 40, kv_heads, hd, generator=g))
    d = _Drift.sample([Piece(0, 40, stale)], share=0.1, n_tok=40, device="cpu", min_samples=4)
    rows = d.pos  # only the samples run
    fresh_k = stale.k[:, rows] + torch.randn(layers, len(rows), kv_heads, hd, generator=g)
    fresh_v = stale.v[:, rows] + torch.randn(layers, len(rows), kv_heads, hd, generator=g)
    pos = torch.arange(40)
    k_l, v_l = place_k(model, stale.k, pos)[5].clone(), stale.v[5].clone()
    unsel = torch.tensor([i for i in range(40) if i not in set(rows.tolist())])
    d.bind(model, rows)
    d.apply(5, fresh_k[5], fresh_v[5], k_l, v_l)
    mk = (fresh_k[5] - stale.k[5, rows]).mean(0)
    mv = (fresh_v[5] - stale.v[5, rows]).mean(0)
    want_k = place_k(model, (stale.k[5, unsel] + mk)[None], unsel)[0]
    assert (k_l[unsel] - want_k).abs().max().item() < 1e-4
    assert (v_l[unsel] - (stale.v[5, unsel] + mv)).abs().max().item() < 1e-5
    # the rows are shifted too (a contiguous slice); the pass overwrites them with fresh K/V


def test_auto_probes_only_long_prompts(engine, tmp_path, monkeypatch):
    """`auto` ranks by the question's probe (`query`) from AUTO_QUERY_MIN_TOKENS cached
    tokens on, and by CacheBlend's V deviation below."""
    from agentmem.bench.blend import build_prompts

    probes = []
    real = fuser._probe
    monkeypatch.setattr(fuser, "_probe", lambda *a: probes.append(1) or real(*a))
    e = view(engine, tmp_path, kv_mode="blend")
    reuse = ChunkReuse(e)
    assert reuse.metric == "auto"
    prompts, memory = build_prompts(e, 1, 4, 3, 64, seed=2)
    reuse.precompute(memory)
    parts = e.tokenize_prompt(prompts[0])
    cached = sum(len(p[0]) for p in parts[1:4])
    monkeypatch.setattr(fuser, "AUTO_QUERY_MIN_TOKENS", cached + 1)
    reuse.plan(parts, store=False)
    assert probes == []
    monkeypatch.setattr(fuser, "AUTO_QUERY_MIN_TOKENS", cached)
    reuse.plan(parts, store=False)
    assert probes == [1]


def test_bad_blend_settings_are_clear_errors(engine, tmp_path):
    ids = engine.encode("hello there")
    with pytest.raises(ValueError, match="check_layer"):
        fuse(engine.model, ids, [Piece(0, len(ids))], "blend", metric="v", check_layer=-1)
    with pytest.raises(ValueError, match="drift"):
        fuse(engine.model, ids, [Piece(0, len(ids))], "blend", drift=1.5)
    with pytest.raises(ValueError, match="blend_check_layer"):
        ChunkReuse(view(engine, tmp_path, kv_mode="blend", blend_metric="v", blend_check_layer=-1))
    with pytest.raises(ValueError, match="unset with metric 'auto'"):
        fuse(engine.model, ids, [Piece(0, len(ids))], "blend", metric="auto", check_layer=1)
    with pytest.raises(ValueError, match="blend_check_layer"):
        ChunkReuse(view(engine, tmp_path, kv_mode="blend", blend_check_layer=2))  # metric auto
    with pytest.raises(ValueError, match="blend_drift"):
        ChunkReuse(view(engine, tmp_path, kv_mode="blend", blend_drift=-0.1))


@pytest.fixture
def metric(warm, request):
    """Run a test with the fixture's planner on another selection metric, then restore it."""
    reuse, before = warm[1], warm[1].metric
    reuse.metric = request.param
    yield request.param
    reuse.metric = before


@pytest.fixture
def small_drift_groups(monkeypatch):
    """The test prompts are short: let drift groups form from 2 samples so drift is active."""
    monkeypatch.setattr(fuser, "DRIFT_MIN_SAMPLES", 2)


@pytest.mark.parametrize("metric", METRICS, indirect=True)
def test_blend_at_ratio_one_gives_the_full_logits(warm, metric, small_drift_groups):
    e, reuse = warm
    assert reuse.drift > 0
    parts = e.tokenize_prompt(prompt(e, [2, 0, 3], QUESTIONS[1]))
    full = reuse.plan(parts, mode="full", store=False)
    one = reuse.plan(parts, mode="blend", ratio=1.0, store=False)
    assert one.reused == 0 and one.recomputed > 0
    zero = reuse.plan(parts, mode="blend", ratio=0.0, store=False)  # drift has no budget left: off, no error
    assert zero.recomputed == 0 and zero.reused > 0
    assert torch.equal(one.last_logits, full.last_logits)
    assert all(torch.equal(a, b) for a, b in zip(one.k + one.v, full.k + full.v, strict=True))


@pytest.mark.parametrize("metric", METRICS, indirect=True)
def test_a_prompt_of_cached_chunks_only_blends_with_every_metric(warm, metric):
    """No uncached token at all: only the last token is new work (the question metrics have
    no question rows to read with), and every metric still blends without error."""
    e, reuse = warm
    ids = [t for i in (2, 0, 1) for t in e.encode(FACTS[i])]
    pieces, start = [], 0
    for i in (2, 0, 1):
        n = len(e.encode(FACTS[i]))
        pieces.append(Piece(start, n, reuse.store.get(reuse._key(e.encode(FACTS[i]), ""), count=False)))
        start += n
    assert all(p.kv is not None for p in pieces)
    full = fuse(e.model, ids, [Piece(0, len(ids))], "full")
    out = fuse(e.model, ids, pieces, "blend", ratio=0.5, metric=reuse.metric, check_layer=reuse.check_layer)
    assert out.ran[-1] and 0 < int(out.ran.sum()) < len(ids)
    assert kl(full.last_logits, out.last_logits) < 1.0


def test_causal_bias_masks_only_later_keys():
    first, bias = causal_bias(torch.tensor([5, 7]), 9, group=2)
    assert first == 5 and bias.shape == (4, 4)  # keys 5..8, rows (group, query)
    assert torch.isinf(bias[0, 1:]).all() and (bias[0, 0] == 0) and torch.isinf(bias[1, 3]) and (bias[1, :3] == 0).all()
    assert torch.equal(bias[:2], bias[2:])
    first, bias = causal_bias(torch.tensor([], dtype=torch.long), 9, group=3)
    assert first == 9 and bias.shape == (0, 0)


@pytest.mark.parametrize("metric", ["v", "query", "auto"], indirect=True)
def test_blend_is_closer_to_full_than_reuse(warm, metric):
    e, reuse = warm
    kls = {"reuse": [], "blend": []}
    for order, q in [([1, 0, 2], QUESTIONS[0]), ([3, 2, 1, 0], QUESTIONS[1]), ([0, 3, 2], QUESTIONS[2])]:
        parts = e.tokenize_prompt(prompt(e, order, q))
        full = reuse.plan(parts, mode="full", store=False)
        for mode in kls:
            r = reuse.plan(parts, mode=mode, store=False)
            kls[mode].append(kl(full.last_logits, r.last_logits))
            assert r.reused > 0 and r.prefilled > 0
    assert sum(kls["blend"]) < sum(kls["reuse"])
    assert sum(kls["reuse"]) > 0


def test_drift_brings_blend_closer_to_full_on_longer_chunks(engine, tmp_path, monkeypatch):
    """Chunks of ~128 tokens (the bench's workload, smaller): per prompt, blend with the drift
    correction is closer to full prefill than blend without it, which is closer than reuse."""
    from agentmem.bench.blend import build_prompts

    monkeypatch.setattr(fuser, "DRIFT_MIN_SAMPLES", 4)
    e = view(engine, tmp_path, kv_mode="blend")
    reuse = ChunkReuse(e)
    prompts, memory = build_prompts(e, 3, 6, 4, 128, seed=5)
    reuse.precompute(memory)
    for p in prompts:
        parts = e.tokenize_prompt(p)
        full = reuse.plan(parts, mode="full", store=False).last_logits
        kls = {}
        for name, drift in (("drift", 0.03), ("plain", 0.0)):
            reuse.drift = drift
            kls[name] = kl(full, reuse.plan(parts, mode="blend", store=False).last_logits)
        kls["reuse"] = kl(full, reuse.plan(parts, mode="reuse", store=False).last_logits)
        assert kls["drift"] < kls["plain"] < kls["reuse"], kls


def test_stats_count_each_token_once(warm):
    e, reuse = warm
    parts = e.tokenize_prompt(prompt(e, [3, 1], QUESTIONS[2]))
    r = reuse.plan(parts, mode="blend", store=False)
    assert r.reused + r.recomputed + r.prefilled == sum(len(p[0]) for p in parts)
    hows = [s["how"] for s in r.segments]
    assert hows[1:3] == ["blended", "blended"] and hows[-1] == "prefilled"
    assert [s["tokens"] for s in r.segments] == [len(p[0]) for p in parts]
    assert 0 < r.recomputed < sum(s["tokens"] for s in r.segments[1:3])


def test_prefix_reuse_is_exact_and_new_segments_are_stored(engine, tmp_path):
    e = view(engine, tmp_path, kv_mode="blend")
    reuse = ChunkReuse(e)
    parts = e.tokenize_prompt(prompt(e, [0, 1], QUESTIONS[0]))
    first = reuse.plan(parts)
    assert first.reused == 0 and first.prefilled == sum(len(p[0]) for p in parts)
    again = reuse.plan(parts)
    assert [s["how"] for s in again.segments] == ["reused"] * (len(parts) - 1) + ["prefilled"]
    assert again.prefilled == len(parts[-1][0]) and again.recomputed == 0
    full = reuse.plan(parts, mode="full", store=False)
    assert (again.last_logits - full.last_logits).abs().max().item() < 1e-3
    # a new order: the first segment is still an exact prefix, the moved ones are blended
    moved = reuse.plan(e.tokenize_prompt(prompt(e, [1, 0], QUESTIONS[0])), store=False)
    assert [s["how"] for s in moved.segments][:3] == ["reused", "blended", "blended"]
    assert reuse.stats()["hits"] > 0 and reuse.stats()["misses"] > 0


@pytest.mark.parametrize("as_prefix", [True, False])
def test_quantized_chunks_from_disk_are_a_prefix_only_when_allowed(engine, tmp_path, as_prefix):
    e = view(engine, tmp_path, kv_mode="blend", kv_quantized_prefix=as_prefix)
    # a RAM tier too small for any chunk: every entry lives on disk as int4
    reuse = ChunkReuse(e, store=ChunkStore([("cpu", 1)], tmp_path / "disk", 1 << 30, codec="int4"))
    parts = e.tokenize_prompt(prompt(e, [0, 1], QUESTIONS[0]))
    reuse.plan(parts)
    again = reuse.plan(parts, store=False)
    assert all(s.get("kv_tier") == "disk" and s.get("kv_quantized") for s in again.segments[:-1])
    hows = [s["how"] for s in again.segments]
    if as_prefix:
        assert hows == ["reused"] * (len(parts) - 1) + ["prefilled"] and again.recomputed == 0
    else:
        assert "reused" not in hows and again.recomputed > 0
    full = reuse.plan(parts, mode="full", store=False).last_logits
    # int4 KV in its own context stays close to full prefill: measured 0.008 on the blend prompts
    assert kl(full, again.last_logits) < 0.05


def test_namespaces_never_share_entries(engine, tmp_path):
    e = view(engine, tmp_path, kv_mode="blend")
    reuse = ChunkReuse(e)
    assert reuse.precompute(memories("tenant-a")) > 0
    assert reuse.precompute(memories("tenant-a")) == 0  # already cached
    b = reuse.plan(e.tokenize_prompt(prompt(e, [0, 1], QUESTIONS[0], namespace="tenant-b")), store=False)
    assert b.reused == b.recomputed == 0
    a = reuse.plan(e.tokenize_prompt(prompt(e, [0, 1], QUESTIONS[0], namespace="tenant-a")), store=False)
    assert a.reused > 0
    assert reuse.drop_namespace("tenant-a") == len(FACTS)
    again = reuse.plan(e.tokenize_prompt(prompt(e, [0, 1], QUESTIONS[0], namespace="tenant-a")), store=False)
    assert again.reused == 0
    assert set(reuse.stats()) >= {"hits", "misses", "evictions", "ram_bytes", "disk_bytes", "hit_ratio"}


# --- wired into the engine -------------------------------------------------------------------
def test_generate_with_segments_reports_reuse(warm):
    e, reuse = warm
    assert get_reuse(e) is reuse and enable_chunk_reuse(e) is reuse  # idempotent
    g = e.generate(prompt(e, [3, 0, 1], QUESTIONS[0]), max_tokens=6)
    s = g.stats
    assert s.reused_tokens > 0 and s.recomputed_tokens > 0 and s.prefilled_tokens > 0
    assert s.reused_tokens + s.recomputed_tokens + s.prefilled_tokens == s.prompt_tokens
    assert [x["how"] for x in s.segments][1:4] == ["blended"] * 3
    assert 0 < s.ttft_s <= s.total_s and s.completion_tokens >= 1
    plain = e.generate("Describe a quiet morning.", max_tokens=2)  # a plain string is not planned
    assert plain.stats.reused_tokens == plain.stats.recomputed_tokens == 0 and plain.stats.segments == []


def test_engine_load_installs_reuse_unless_full(engine, tmp_path, monkeypatch):
    import agentmem.engine.engine as engine_mod

    monkeypatch.setattr(engine_mod, "resolve_model_dir", lambda *a: tmp_path)
    monkeypatch.setattr(engine_mod, "load_transformer", lambda *a: engine.model)
    monkeypatch.setattr(engine_mod, "load_tokenizer", lambda *a: engine.tokenizer)
    blended = Engine.load(Config(dtype="float32", device="cpu", kv_disk_dir=tmp_path))  # kv_mode auto
    assert isinstance(get_reuse(blended), ChunkReuse) and blended._planner is get_reuse(blended)
    assert blended.config.kv_mode == "blend" and get_reuse(blended).mode == "blend"
    assert resolve_kv_mode("auto", "cuda") == "full" and resolve_kv_mode("reuse", "cuda") == "reuse"
    with pytest.raises(ValueError, match="kv_mode must be auto or one of"):
        ChunkReuse(blended, Config(kv_mode="fast", kv_disk_dir=tmp_path))
    plain = Engine.load(Config(dtype="float32", device="cpu", kv_mode="full"))
    assert get_reuse(plain) is None and plain._planner is None
    assert engine._planner is None  # the shared fixture keeps plain prefill


def test_blend_bench_prints_its_json_contract_last(engine, tmp_path, monkeypatch, capsys):
    """`agentmem bench blend` on tiny sizes, on the session's model (no second load)."""
    from agentmem.bench import blend as bench

    monkeypatch.setattr(bench.Engine, "load", staticmethod(
        lambda cfg: Engine(engine.model, engine.tokenizer, engine.model_id, engine.device, cfg)))
    plot = tmp_path / "curve.png"
    assert bench.main(["--quick", "--json", "--curve", "--curve-out", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("prompt_tokens", "full_ttft_s", "reuse_ttft_s", "blend_ttft_s", "speedup", "blend_kl", "reuse_kl",
                "blend_top1", "reuse_top1", "blend_answer_match", "recompute_ratio"):
        assert isinstance(out[key], float), key
    assert out["metric"] == "auto" and out["drift"] == 0.03 and out["ratio"] == 0.15 and out["check_layer"] is None
    assert out["full_ttft_s"] > 0 and 0 < out["recompute_ratio"] < 1 and out["blend_kl"] >= 0
    assert [c["ratio"] for c in out["curve"]] == list(bench.CURVE_RATIOS)
    # one margin per prompt whose blend missed full prefill's top-1, each a top-1 minus top-2 gap
    misses = out["blend_top1_miss_full_margins"]
    assert len(misses) == round((1 - out["blend_top1"]) * out["prompts"]) and all(m >= 0 for m in misses)
    # r = 1 is full prefill; the bench recomputes in row blocks of other sizes than full prefill,
    # and on an AMX VM the BLAS blocks those matmuls differently (KL 8.9e-08 measured there)
    assert out["curve"][-1]["kl"] < 1e-6
    assert plot.stat().st_size > 0
    parts = out["blend_breakdown_s"]
    assert list(parts) == list(fuser.Clock.PARTS) and all(t >= 0 for t in parts.values())
    assert parts["layers"] > 0 and parts["attention"] > 0
    # the parts tile the blend's TTFT: they add up to it within 10%
    assert abs(sum(parts.values()) - out["blend_ttft_s"]) <= 0.1 * out["blend_ttft_s"]


@pytest.mark.parametrize("metric", ["query", "v"], indirect=True)
def test_blend_breakdown_adds_up_to_the_blend_time(warm, metric, small_drift_groups):
    """A Clock through plan() charges every stretch of a blend to one part: the parts add up to
    the wall time within 10%, and the parts the metric runs are there."""
    e, reuse = warm
    parts = e.tokenize_prompt(prompt(e, [2, 0, 3], QUESTIONS[1]))
    reuse.plan(parts, store=False)  # warm-up
    clock = fuser.Clock()
    t0 = clock.t
    reuse.plan(parts, store=False, clock=clock)
    wall = time.perf_counter() - t0
    assert set(clock.parts) <= set(fuser.Clock.PARTS)
    assert {"lookup", "place", "select", "drift", "layers", "attention", "logits", "finish"} <= set(clock.parts)
    assert ("probe" in clock.parts) == (metric == "query")
    assert abs(sum(clock.parts.values()) - wall) <= 0.1 * wall


def test_the_blend_buffers_are_reused_only_when_nothing_holds_the_last_ones():
    """`kv_buffers`: the next prefill takes the last one's K/V memory again once every view of it
    is gone, never while a caller still holds one (its values stay as they were)."""
    from agentmem.kvreuse.fuser import kv_buffers

    cpu = torch.device("cpu")
    k, v = kv_buffers((2, 6, 3, 4), torch.float32, cpu)
    k.fill_(1.0)
    v.fill_(2.0)
    k2, v2 = kv_buffers((2, 6, 3, 4), torch.float32, cpu)  # k, v still held: fresh memory
    assert k2.data_ptr() != k.data_ptr() and v2.data_ptr() != v.data_ptr()
    k2.fill_(5.0)
    assert (k == 1.0).all() and (v == 2.0).all()
    ptr = k2.data_ptr()
    del k, v, k2, v2
    k3, v3 = kv_buffers((2, 5, 3, 4), torch.float32, cpu)  # smaller, nothing held: the same memory
    assert k3.data_ptr() == ptr and v3.data_ptr() == ptr + k3.numel() * 4
    assert k3.shape == v3.shape == (2, 5, 3, 4)
    row = k3[0]  # a view kept of the last result
    del k3, v3
    k4, _ = kv_buffers((2, 5, 3, 4), torch.float32, cpu)
    assert k4.data_ptr() != ptr and row.data_ptr() == ptr
    k5, _ = kv_buffers((2, 5, 3, 4), torch.bfloat16, cpu)  # another dtype: another buffer
    assert k5.dtype == torch.bfloat16
    del k5, _
    with torch.inference_mode():  # made in inference mode: not handed out of it, where it is read-only
        k6, _ = kv_buffers((2, 5, 3, 4), torch.bfloat16, cpu)
        assert k6.is_inference()
    del k6, _
    k7, _ = kv_buffers((2, 5, 3, 4), torch.bfloat16, cpu)
    assert not k7.is_inference()
    k7.fill_(1.0)
