"""The chunk KV store's codec, value-per-byte policy, pins and load-or-recompute choice."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from agentmem.kvreuse import ChunkKV, ChunkStore
from agentmem.kvreuse import codec as kvcodec
from agentmem.kvreuse.policy import ENTRY_OVERHEAD_BYTES, LRUPolicy, Rates, ValuePolicy, victims


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def kv_like(layers=4, tokens=40, kv_heads=3, hd=64, dtype=torch.bfloat16, seed=0) -> ChunkKV:
    """KV shaped like a model's: K with a few large channels shared by all tokens (the outliers
    that make per-channel K scales pay), V without."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, tokens, kv_heads, hd, generator=g)
    k[..., :4] = k[..., :4] * 0.3 + 12.0 * torch.randn(layers, 1, kv_heads, 4, generator=g)
    v = torch.randn(layers, tokens, kv_heads, hd, generator=g) * 0.5
    return ChunkKV(k.to(dtype), v.to(dtype), context="ctx")


# --- the codec -------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", kvcodec.CODECS)
@pytest.mark.parametrize("tokens", [1, 7, 32, 40, 100])
def test_codec_round_trip_stays_within_its_error_bound_per_layer(codec, tokens):
    kv = kv_like(tokens=tokens)
    blob = kvcodec.encode("key", "ns", kv, codec)
    ns, back = kvcodec.decode(blob, "key")
    assert ns == "ns" and back.context == "ctx" and back.k.shape == kv.k.shape and back.k.dtype == kv.k.dtype
    assert back.quantized == (codec != "raw")  # the context is kept; the planner knows it is lossy
    for name, x, y in (("k", kv.k, back.k), ("v", kv.v, back.v)):
        err = (x.float() - y.float()).abs().amax(dim=(1, 2, 3))  # per layer
        # bf16 output rounding on top of the codec's own bound
        bound = kvcodec.error_bound(x, codec, name) + x.float().abs().amax(dim=(1, 2, 3)) * 2.0 ** -8
        assert (err <= bound).all(), (codec, name, err, bound)
        if codec == "raw":
            assert torch.equal(x, y)
    if codec == "int4" and tokens >= 32:
        assert len(blob) <= 0.35 * kv.nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_encoding_leaves_the_entry_as_it_was(codec, dtype):
    kv = kv_like(tokens=64, dtype=dtype)  # 64 tokens: K's groups need no padding (a view of K)
    k, v = kv.k.clone(), kv.v.clone()
    with torch.inference_mode():  # as the engine's entries are made
        held = ChunkKV(kv.k.clone(), kv.v.clone(), "ctx")
    kvcodec.encode("key", "ns", kv, codec)
    kvcodec.encode("key", "ns", held, codec)  # outside inference mode, as the disk writer runs
    assert torch.equal(kv.k, k) and torch.equal(kv.v, v) and torch.equal(held.k, k) and torch.equal(held.v, v)


def test_int4_is_finer_on_k_per_channel_than_per_token_would_be():
    kv = kv_like(tokens=64)
    _, back = kvcodec.decode(kvcodec.encode("k", "", kv, "int4"), "k")
    err = (back.k.float() - kv.k.float()).abs().mean()
    # what per-token scales would give on the same K: the outlier channels set every token's step
    x = kv.k.float()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    per_token = ((x - lo) / step).round() * step + lo
    assert err < 0.5 * (per_token - x).abs().mean()


@pytest.mark.parametrize("codec", kvcodec.CODECS)
@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "empty", "other_key"])
def test_a_corrupt_compressed_blob_is_rejected(codec, damage):
    kv = kv_like(tokens=40)
    blob = bytearray(kvcodec.encode("key", "ns", kv, codec))
    key = "key"
    if damage == "flip":
        blob[-11] ^= 0x10
    elif damage == "truncate":
        blob = blob[: len(blob) - 100]
    elif damage == "header":
        blob[12] ^= 0x01
    elif damage == "empty":
        blob = bytearray()
    else:
        key = "another"
    assert kvcodec.decode(bytes(blob), key) is None


def test_a_corrupt_compressed_file_on_disk_is_a_miss_and_removed(tmp_path):
    store = ChunkStore([("cpu", 1)], tmp_path, codec="int4")  # everything spills to disk, compressed
    store.put("k", "ns", kv_like())
    path = store.disk.path("k", "ns")
    assert kvcodec.codec_of(path.read_bytes()) == "int4"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))
    assert store.get("k") is None and not path.exists() and store.stats()["disk_bytes"] == 0


def test_the_raw_format_of_before_still_reads():
    import hashlib
    import json

    kv = kv_like(tokens=5)
    payload = kv.k.view(torch.uint8).numpy().tobytes() + kv.v.view(torch.uint8).numpy().tobytes()
    header = json.dumps({"key": "k", "namespace": "n", "context": None, "dtype": str(kv.k.dtype),
                         "k_shape": list(kv.k.shape), "v_shape": list(kv.v.shape), "payload": len(payload),
                         "digest": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
    old = b"AMKV1\n" + len(header).to_bytes(4, "little") + header + payload
    ns, back = kvcodec.decode(old, "k")
    assert ns == "n" and torch.equal(back.k, kv.k) and torch.equal(back.v, kv.v)


def test_ram_tier_with_the_codec_holds_about_three_times_the_chunks(tmp_path):
    one = kv_like(tokens=64).nbytes
    plain = ChunkStore([("cpu", 4 * one)])
    packed = ChunkStore([("cpu", 4 * one)], codec="int4", ram_codec=True)
    for i in range(12):
        plain.put(f"c{i}", "", kv_like(tokens=64, seed=i))
        packed.put(f"c{i}", "", kv_like(tokens=64, seed=i))
    assert len(plain.tiers[0].entries) == 4 and len(packed.tiers[0].entries) == 12
    back = packed.get("c3")
    assert back is not None and back.k.dtype == torch.bfloat16
    assert (back.k.float() - kv_like(tokens=64, seed=3).k.float()).abs().amax() < 1.5


# --- the policy --------------------------------------------------------------------------------
def brute_value_per_byte(history: list[float], stored_at: float, tokens: int, nbytes: int, now: float,
                         half_life: float, prior: float, s_per_token: float, share: float) -> float:
    """Value per byte from its definition: each use counts 1, halving every half-life; a chunk
    also carries its kind's prior, decayed from its last use (or its storing)."""
    last = max(history) if history else stored_at
    uses = sum(2.0 ** (-(now - t) / half_life) for t in history)
    reuse = uses + prior * 2.0 ** (-(now - last) / half_life)
    return reuse * tokens * s_per_token * (1 - share) / (nbytes + ENTRY_OVERHEAD_BYTES)


@pytest.mark.parametrize("seed", range(8))
def test_the_policy_orders_chunks_as_brute_force_value_per_byte_does(seed):
    rng = random.Random(seed)
    clock = Clock()
    rates = Rates(prefill_s_per_token=4e-4, recompute_share=0.15)
    pol = ValuePolicy(clock, rates, half_life_s=60.0)
    chunks = {f"c{i}": (rng.randint(16, 300), rng.choice(["system", "recall", "turn"])) for i in range(6)}
    history: dict[str, list[float]] = {k: [] for k in chunks}
    stored_at: dict[str, float] = {}
    for k, (tokens, kind) in chunks.items():
        pol.stored(k, tokens, kind)
        stored_at[k] = clock.t
    for _ in range(30):
        clock.t += rng.uniform(0, 40)
        k = rng.choice(list(chunks))
        pol.used(k, chunks[k][0], chunks[k][1])
        history[k].append(clock.t)
    clock.t += 5
    sizes = {k: tokens * 2000 for k, (tokens, _) in chunks.items()}
    brute = {k: brute_value_per_byte(history[k], stored_at[k], chunks[k][0], sizes[k], clock.t, 60.0,
                                     pol.prior(chunks[k][1]), 4e-4, 0.15) for k in chunks}
    by_policy = sorted(chunks, key=lambda k: pol.priority(k, sizes[k]))
    assert by_policy == sorted(chunks, key=lambda k: brute[k])
    for k in chunks:  # the priority is log(value per byte) plus a term common to all
        assert math.isclose(pol.priority(k, sizes[k]) - clock.t * math.log(2) / 60.0, math.log(brute[k]),
                            rel_tol=1e-9, abs_tol=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_eviction_takes_the_lowest_value_first_and_admits_only_over_them(seed):
    rng = random.Random(100 + seed)
    entries = [(f"e{i}", rng.randint(1, 10), rng.uniform(0, 10), False) for i in range(5)]
    new_prio, over = rng.uniform(0, 10), rng.randint(1, 30)
    got = victims(entries, over, new_prio, False)
    # brute force: the smallest prefix of entries by ascending priority that frees `over`
    order = sorted(entries, key=lambda e: e[2])
    want = None
    for n in range(len(order) + 1):
        if sum(e[1] for e in order[:n]) >= over:
            prefix = order[:n]
            want = [e[0] for e in prefix] if all(e[2] < new_prio for e in prefix) else None
            break
    assert got == want
    # and no other set of the same size frees enough with lower total value per byte
    if want:
        for combo in itertools.combinations(entries, len(want)):
            if sum(e[1] for e in combo) >= over:
                assert max(e[2] for e in combo) >= max(e[2] for e in order[: len(want)])


def test_a_shared_persona_outlives_a_flood_of_one_off_memories():
    """LRU evicts the persona every user sends as readily as a one-off line; value per byte keeps it."""
    size = kv_like(tokens=64).nbytes
    results = {}
    for name in ("lru", "value"):
        clock = Clock()
        pol = LRUPolicy(clock) if name == "lru" else ValuePolicy(clock, half_life_s=300.0)
        store = ChunkStore([("cpu", 3 * size)], policy=pol)
        hits = 0
        for turn in range(40):
            clock.t += 10
            flood = [(f"once{turn}-{j}", "recall") for j in range(3)]
            for key, kind in [("persona", "system"), *flood]:
                if store.get(key, tokens=64, kind=kind, user=f"u{turn % 5}") is not None:
                    hits += key == "persona"
                else:
                    store.put(key, "", kv_like(tokens=64), kind=kind)
        results[name] = hits
    assert results["lru"] == 0 and results["value"] >= 38


def test_chunks_shorter_than_the_minimum_are_not_admitted():
    store = ChunkStore([("cpu", 1 << 30)], policy=ValuePolicy(Clock(), min_tokens=16))
    short = kv_like(tokens=8)
    short.context = None  # an approximation: a short exact one is kept (the prefix after it stays exact)
    assert not store.put("tiny", "", short)
    assert store.put("ok", "", kv_like(tokens=16))
    assert "tiny" not in store and "ok" in store and store.stats()["rejected"] == 1


def test_load_or_recompute_follows_the_measured_rates(tmp_path):
    clock = Clock()
    rates = Rates(prefill_s_per_token=1e-4, recompute_share=0.15)
    store = ChunkStore([("cpu", 1)], tmp_path, policy=ValuePolicy(clock, rates, min_tokens=1))
    store.put("c", "", kv_like(tokens=40))
    assert store.get("c", tokens=40) is not None  # unmeasured: loaded (and measured)
    assert store.stats()["recompute_chosen"] == 0 and store.stats()["disk_read_bytes"] > 0
    rates.read_s_per_byte["disk"] = 1.0  # a disk that reads a byte a second
    kv, info = store.lookup("c", tokens=40)
    assert kv is None and info["choice"] == "recompute" and store.stats()["recompute_chosen"] == 1
    rates.read_s_per_byte["disk"] = 1e-12
    assert store.get("c", tokens=40) is not None


# --- pins --------------------------------------------------------------------------------------
def test_a_pinned_chunk_survives_pressure_from_unpinned_ones_until_it_expires():
    clock = Clock()
    size = kv_like(tokens=64).nbytes
    store = ChunkStore([("cpu", 2 * size)], policy=ValuePolicy(clock))
    store.put("turn", "", kv_like(tokens=64), kind="turn")
    assert store.pin("turn", 30.0)
    for i in range(6):  # hot chunks, each worth more than the turn
        clock.t += 1
        for _ in range(5):
            store.get(f"hot{i}", tokens=64, kind="system")
        store.put(f"hot{i}", "", kv_like(tokens=64), kind="system")
    kv, info = store.lookup("turn", tokens=64)
    assert kv is not None and info == {"tier": "ram", "pin": "held"}
    clock.t += 31  # expired: an ordinary entry again, and the hot ones push it out
    for i in range(6, 9):
        for _ in range(5):
            store.get(f"hot{i}", tokens=64, kind="system")
        store.put(f"hot{i}", "", kv_like(tokens=64), kind="system")
    assert "turn" not in store and store.stats()["pinned"] == 0


def test_pressure_from_other_pins_evicts_a_pin_and_the_lookup_says_so():
    clock = Clock()
    size = kv_like(tokens=64).nbytes
    store = ChunkStore([("cpu", 2 * size)], policy=ValuePolicy(clock))
    for i in range(3):
        store.put(f"t{i}", "", kv_like(tokens=64), kind="turn")
        assert store.pin(f"t{i}", 60.0, kv_like(tokens=64))
        clock.t += 1
    kv, info = store.lookup("t0", tokens=64)
    assert kv is None and info.get("pin") == "evicted"
    assert store.lookup("t2", tokens=64)[1].get("pin") == "held"


def test_a_pin_brings_a_chunk_not_admitted_into_memory():
    clock = Clock()
    store = ChunkStore([("cpu", 1 << 30)], policy=ValuePolicy(clock, min_tokens=100))
    kv = kv_like(tokens=40)
    kv.context = None
    assert not store.put("short", "", kv)
    assert store.pin("short", 10.0, kv) and store.get("short", tokens=40) is not None


@pytest.mark.parametrize("codec", kvcodec.CODECS)
def test_a_blobs_layout_accounts_for_every_byte(codec):
    kv = kv_like(tokens=40)
    blob = kvcodec.encode("key", "ns", kv, codec, entropy=False)
    parts = kvcodec.layout(blob)
    assert sum(parts.values()) == len(blob) and parts["header"] < 512
    if codec == "int4":  # two codes a byte; per channel K scales in groups of 20 tokens, V in groups of 32
        assert parts["k_codes"] == parts["v_codes"] == kv.k.numel() // 2
        assert parts["k_scales"] == 4 * kv.k.numel() // 20 and parts["v_scales"] == 4 * kv.v.numel() // 32
