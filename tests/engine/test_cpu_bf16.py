"""kernels/cpu_bf16.py: the AVX512-BF16 few-row product against torch, and Proj's use of it."""

from __future__ import annotations

import json

import pytest
import torch
from _paged import paged_rows

from agentmem.engine.kernels import cpu_bf16, cpu_fp32
from agentmem.engine.linear import make_proj, onednn_bf16


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = cpu_bf16.load(tmp_path_factory.mktemp("cache"))
    if lib is None:
        pytest.skip(f"no bf16 GEMV kernel here: {cpu_bf16.why_not}")
    return lib


@pytest.mark.parametrize("rows,out,inp", [(1, 960, 576), (3, 992, 576), (4, 576, 1536), (7, 64, 34), (16, 32, 64)])
def test_gemv_matches_torch(lib, rows, out, inp):
    g = torch.Generator().manual_seed(rows * out)
    w = torch.randn(out, inp, generator=g).bfloat16()
    x = torch.randn(rows, inp, generator=g).bfloat16()
    b = torch.randn(out, generator=g).bfloat16()
    ref = x.float() @ w.float().t() + b.float()
    wp = cpu_bf16.pack(w)
    y32 = cpu_bf16.gemv(lib, wp, x, b, torch.float32)
    assert y32.shape == (rows, out) and y32.dtype == torch.float32
    assert (y32 - ref).abs().max() < 1e-4 * ref.abs().max()  # fp32 sums of exact bf16 products
    y16 = cpu_bf16.gemv(lib, wp, x, b)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, y32.to(torch.bfloat16))  # rounded to nearest even, as torch rounds


def test_gemv_reads_strided_rows(lib):
    w = torch.randn(64, 96).bfloat16()
    x = torch.randn(2, 192).bfloat16()[:, :96]  # rows 192 apart
    assert torch.allclose(cpu_bf16.gemv(lib, cpu_bf16.pack(w), x, out_dtype=torch.float32), x.float() @ w.float().t(),
                          atol=1e-3)


def test_gemv_takes_only_what_its_layout_holds(lib):
    assert cpu_bf16.usable(torch.zeros(64, 96).bfloat16())
    assert not cpu_bf16.usable(torch.zeros(963, 576).bfloat16())  # out not a multiple of 32
    assert not cpu_bf16.usable(torch.zeros(64, 95).bfloat16())  # an odd number of inputs
    assert not cpu_bf16.usable(torch.zeros(64, 96))  # fp32
    with pytest.raises(ValueError, match="inputs"):
        cpu_bf16.gemv(lib, cpu_bf16.pack(torch.zeros(64, 96).bfloat16()), torch.zeros(1, 64).bfloat16())
    with pytest.raises(ValueError, match="bf16"):  # x of another dtype would be read as bf16
        cpu_bf16.gemv(lib, cpu_bf16.pack(torch.zeros(64, 96).bfloat16()), torch.zeros(1, 96))
    q = cpu_bf16.pack(torch.zeros(64, 96, dtype=torch.int8))
    with pytest.raises(ValueError, match="needs a scale"):
        cpu_bf16.gemv(lib, q, torch.zeros(1, 96).bfloat16())
    with pytest.raises(ValueError, match="takes no scale"):
        cpu_bf16.gemv(lib, cpu_bf16.pack(torch.zeros(64, 96).bfloat16()), torch.zeros(1, 96).bfloat16(),
                      scale=torch.ones(64))


def test_proj_uses_the_kernel_for_few_rows_only(lib, monkeypatch):
    if not onednn_bf16():
        pytest.skip("bf16 projections are oneDNN-packed only with native bf16")
    w = torch.randn(256, 128).bfloat16()
    p = make_proj(w)
    calls = []
    real = cpu_bf16.gemv
    monkeypatch.setattr(cpu_bf16, "gemv", lambda *a, **k: calls.append(a[2].shape[0]) or real(*a, **k))
    for rows in (1, cpu_bf16.MAX_ROWS, cpu_bf16.MAX_ROWS + 1, 64):
        x = torch.randn(rows, 128).bfloat16()
        assert torch.allclose(p(x).float(), x.float() @ w.float().t(), atol=0.1, rtol=0.02)
    assert calls == [1, cpu_bf16.MAX_ROWS]


# the last three: a row's keys in several chunks, the first ones wholly outside the window
# (the merge skips them), more than 4 heads a KV head, and a width that is no multiple of 64
@pytest.mark.parametrize("rows,heads,kv,hd,width", [(1, 9, 3, 64, 5), (8, 9, 3, 64, 160), (3, 8, 1, 128, 40),
                                                    (2, 4, 4, 32, 17), (1, 9, 3, 64, 1500), (2, 16, 2, 256, 600),
                                                    (3, 6, 2, 96, 700)])
def test_decode_attention_matches_the_softmax_over_the_visible_keys(lib, rows, heads, kv, hd, width):
    g = torch.Generator().manual_seed(rows * width + hd)
    k_pool = torch.randn(64, 16, kv, hd, generator=g).bfloat16()
    v_pool = torch.randn(64, 16, kv, hd, generator=g).bfloat16()
    q = torch.randn(rows, heads, hd, generator=g).bfloat16()
    idx = torch.randint(0, 64 * 16, (rows, width), generator=g)
    lo = torch.randint(0, max(1, width // 3), (rows,), generator=g)  # a sliding window's start
    hi = torch.randint(width // 2 + 1, width + 1, (rows,), generator=g)
    keep = (torch.arange(width)[None] >= lo[:, None]) & (torch.arange(width)[None] < hi[:, None])
    out = cpu_bf16.decode_attention(lib, q, k_pool, v_pool, idx.view(-1), keep[:, None, None, :])
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    k = k_pool.view(-1, kv, hd)[idx].float().repeat_interleave(heads // kv, dim=2)  # [rows, width, heads, hd]
    v = v_pool.view(-1, kv, hd)[idx].float().repeat_interleave(heads // kv, dim=2)
    s = torch.einsum("bhd,bwhd->bhw", q.float(), k) * hd ** -0.5
    p = torch.softmax(s.masked_fill(~keep[:, None, :], float("-inf")), -1)
    ref = torch.einsum("bhw,bwhd->bhd", p, v)
    assert (out.float() - ref).abs().max() < 1e-2 * max(1.0, ref.abs().max().item())
    # the engine's decode attention (paged_attention) goes through the same kernel
    from agentmem.engine.compiled import paged_attention
    via_op = paged_attention(q, k_pool, v_pool, idx.view(-1), keep[:, None, None, :], width)
    assert torch.equal(via_op, out)


def test_decode_attention_rejects_a_slot_count_that_does_not_match(lib):
    q = torch.zeros(2, 3, 32).bfloat16()
    pool = torch.zeros(4, 16, 1, 32).bfloat16()
    with pytest.raises(ValueError, match="slots"):
        cpu_bf16.decode_attention(lib, q, pool, pool, torch.zeros(7, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize("rows,out,inp", [(1, 960, 576), (5, 64, 34), (8, 576, 1536), (11, 32, 64)])
def test_int8_gemv_matches_the_dequantized_product(lib, rows, out, inp):
    g = torch.Generator().manual_seed(rows + out)
    w = torch.randn(out, inp, generator=g)
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    x = torch.randn(rows, inp, generator=g).bfloat16()
    b = torch.randn(out, generator=g)
    ref = x.float() @ (q.float() * scale[:, None]).t() + b
    y = cpu_bf16.gemv_int8(lib, cpu_bf16.pack(q), scale, x, b, torch.float32)
    assert y.shape == (rows, out)
    assert (y - ref).abs().max() < 1e-4 * ref.abs().max()  # int8 values are exact in bf16
    with pytest.raises(ValueError, match="bf16"):
        cpu_bf16.gemv_int8(lib, cpu_bf16.pack(q), scale, x.float())


def _int8_case(rows: int, out: int, inp: int):
    """Seeded int8 weights (q, per-output scale), bf16 input rows with an outlier channel (as
    real activations have), a bias, the dequantized weight and the exact product."""
    g = torch.Generator().manual_seed(rows + out)
    w = torch.randn(out, inp, generator=g)
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    x = torch.randn(rows, inp, generator=g).bfloat16()
    x[0, 3] = 40.0
    b = torch.randn(out, generator=g)
    deq = q.float() * scale[:, None]
    return q, scale, x, b, deq, x.float() @ deq.t() + b


needs_vnni = pytest.mark.skipif(not cpu_bf16.vnni(), reason="needs AVX512-VNNI")


@needs_vnni
@pytest.mark.parametrize("rows,out,inp", [(1, 960, 576), (5, 64, 34), (8, 576, 1536), (11, 32, 64), (2, 32, 4100)])
def test_int8_gemv_on_int16_rows_stays_within_their_quantization(lib, rows, out, inp):
    """The VNNI route quantizes each input row to int16 (14 bits of its largest value): within
    that rounding of the exact product, and the int32 sums do not overflow past one chunk (4,100
    inputs of the largest values against the largest weights)."""
    q, scale, x, b, deq, ref = _int8_case(rows, out, inp)
    y = cpu_bf16.gemv_int8(lib, cpu_bf16.pack(q), scale, x, b, torch.float32, i16=True)
    step = x.float().abs().amax(1, keepdim=True) / 8191  # per row: the rounding of each input
    bound = 0.5 * step * deq.abs().sum(1)[None, :]  # the worst case of that rounding
    assert ((y - ref).abs() <= bound + 1e-4 * ref.abs().max()).all()
    if inp == 4100:  # every product at its largest: 127 * 8191 * 4100 overflows int32 in one sum
        big = torch.full((1, inp), 3.0).bfloat16()
        ones = torch.full((out, inp), 127, dtype=torch.int8)
        y = cpu_bf16.gemv_int8(lib, cpu_bf16.pack(ones), torch.ones(out), big, None, torch.float32, i16=True)
        assert torch.allclose(y, torch.full_like(y, 3.0 * 127 * inp), rtol=1e-4)


@pytest.mark.parametrize("times, route", [
    ({"bf16": 193.8, "i16": 180.3, "u8": 185.9}, "u8"),  # a near tie: u8, whose fused layer decoded 1.65x
    ({"bf16": 337.1, "i16": 321.9, "u8": 256.4}, "u8"),
    ({"bf16": 300.0, "i16": 100.0, "u8": 130.0}, "i16"),  # products 1.3x faster than u8's: those
    ({"bf16": 100.0, "i16": 200.0}, "bf16"),
])
def test_the_int8_route_favours_u8_which_has_the_fused_layer(times, route):
    assert cpu_bf16.pick_q8(times) == route


@needs_vnni
def test_the_int8_route_is_measured_once_and_can_be_set(lib, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_bf16, "q8_route", "bf16")
    monkeypatch.setenv("AGENTMEM_GEMV_Q8", "i16")
    assert cpu_bf16.choose_q8(tmp_path) == "i16" == cpu_bf16.q8_route
    assert not (tmp_path / "gemv-choice.json").exists()  # set, not measured
    monkeypatch.setenv("AGENTMEM_GEMV_Q8", "int4")
    with pytest.raises(ValueError, match="AGENTMEM_GEMV_Q8"):
        cpu_bf16.choose_q8(tmp_path)
    monkeypatch.setenv("AGENTMEM_GEMV_Q8", "auto")
    route = cpu_bf16.choose_q8(tmp_path)
    saved = json.loads((tmp_path / "gemv-choice.json").read_text())
    (entry,) = saved.values()
    us = entry["us"]
    fastest = min(us, key=us.get)
    assert route == entry["route"] == cpu_bf16.q8_route
    assert route == cpu_bf16.pick_q8(us) and (route == fastest or route == "u8")
    entry["route"] = "bf16" if route == "i16" else "i16"
    (tmp_path / "gemv-choice.json").write_text(json.dumps(saved))
    assert cpu_bf16.choose_q8(tmp_path) == entry["route"]  # remembered, not timed again
    w, x = torch.randn(64, 128).bfloat16(), torch.randn(3, 128).bfloat16()
    routes = {}
    for r in cpu_bf16.Q8_ROUTES:  # a projection takes the layout of the route it was built under
        monkeypatch.setattr(cpu_bf16, "q8_route", r)
        p = make_proj(w, fmt="int8")
        assert p.w_gemv.dtype == (torch.uint8 if r == "u8" else torch.int8)
        routes[r] = p(x).float()
    for r in ("i16", "u8"):
        assert (routes["bf16"] - routes[r]).abs().max() < 0.03 * routes["bf16"].abs().max()


@needs_vnni
@pytest.mark.parametrize("rows,out,inp", [(1, 960, 576), (5, 64, 128), (8, 576, 1536), (11, 32, 64), (16, 96, 4096)])
def test_int8_gemv_on_int8_rows_stays_within_their_quantization(lib, rows, out, inp):
    """The u8 route quantizes each block of U8_BLOCK inputs of a row to int8 at its own scale:
    within that rounding of the exact product (an outlier channel costs only its block), and a
    row's result does not depend on the rows batched with it (the same tokens alone or in a
    batch)."""
    q, scale, x, b, deq, ref = _int8_case(rows, out, inp)
    wu = cpu_bf16.pack_u8(q)
    y = cpu_bf16.gemv_int8(lib, wu, scale, x, b, torch.float32)
    blocks = x.float().reshape(rows, -1, cpu_bf16.U8_BLOCK)
    step = (blocks.abs().amax(-1, keepdim=True) / 127).expand_as(blocks).reshape(rows, inp)  # per input
    bound = 0.5 * step @ deq.abs().t()  # the worst case of that rounding
    assert ((y - ref).abs() <= bound + 1e-4 * ref.abs().max()).all()
    # the outlier's block only: one scale for the whole row would round every input of row 0 that coarsely
    assert (y[0] - ref[0]).abs().mean() < 0.5 * (0.5 * 40.0 / 127 * deq.abs().sum(1)).mean()
    alone = torch.cat([cpu_bf16.gemv_int8(lib, wu, scale, x[i:i + 1], b, torch.float32) for i in range(rows)])
    assert torch.equal(alone, y)
    with pytest.raises(ValueError):  # inputs not a multiple of the block
        cpu_bf16.gemv_int8(lib, cpu_bf16.pack_u8(q[:, :inp - 32]), scale, x[:, :inp - 32])


def test_int8_proj_uses_the_kernel_for_few_rows(lib, monkeypatch):
    w = torch.randn(256, 128).bfloat16()
    p = make_proj(w, fmt="int8")
    calls = []
    real = cpu_bf16.gemv_int8
    monkeypatch.setattr(cpu_bf16, "gemv_int8", lambda *a, **k: calls.append(a[3].shape[0]) or real(*a, **k))
    dequantized = p.packed.float() * p.scale[:, None]
    for rows in (1, cpu_bf16.MAX_ROWS, cpu_bf16.MAX_ROWS + 1):  # the last dequantized to bf16 for the call
        x = torch.randn(rows, 128).bfloat16()
        ref = x.float() @ dequantized.t()
        assert (p(x).float() - ref).abs().max() < 0.02 * ref.abs().max()  # the bf16 output's rounding
    assert calls == [1, cpu_bf16.MAX_ROWS]


def _q4_weight(out: int, inp: int, seed: int) -> torch.Tensor:
    """A weight already in 4-bit groups (d * q + m, d and m fp16), as a Q4_1 GGUF holds them."""
    g = torch.Generator().manual_seed(seed)
    groups = inp // cpu_bf16.Q4_GROUP
    d = (torch.rand(out, groups, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (-8 * d[..., 0] + torch.randn(out, groups, generator=g) * 0.01).half().float()[..., None]
    q = torch.randint(0, 16, (out, groups, cpu_bf16.Q4_GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # each group spans its whole range, as llama.cpp's Q4_1 sets d and m
    return (q * d + m).view(out, inp)


def test_q4_layout_holds_a_4bit_weight_exactly():
    """`pack_q4` of a weight already in Q4_1's form gives back the same weight (what keeps a Q4_1
    GGUF's projections exact under AGENTMEM_WEIGHTS=int4); any other weight is rounded to its
    groups' 16 levels."""
    w = _q4_weight(96, 256, 0)
    packed, dm = cpu_bf16.pack_q4(w)
    assert packed.shape == (6, 32, 16, 4) and packed.dtype == torch.uint8 and dm.shape == (6, 8, 2, 16)
    assert torch.equal(cpu_bf16.unpack_q4(packed, dm), w)
    dense = torch.randn(64, 128)
    back = cpu_bf16.unpack_q4(*cpu_bf16.pack_q4(dense))
    step = (dense.view(64, 4, 32).amax(-1) - dense.view(64, 4, 32).amin(-1)) / 15
    assert ((back - dense).abs().view(64, 4, 32) <= 0.51 * step[..., None] + 1e-3).all()
    flat = torch.full((32, 64), 0.25)  # a constant group: d = 0, every value its minimum
    assert torch.equal(cpu_bf16.unpack_q4(*cpu_bf16.pack_q4(flat)), flat)


@needs_vnni
@pytest.mark.parametrize("rows,out,inp", [(1, 960, 576), (3, 64, 128), (8, 576, 1536), (11, 32, 64),
                                          (70, 32, 128), (200, 64, 576)])  # prefill rows: scales malloc'd
def test_q4_gemv_is_the_groups_sums_of_the_quantized_rows(lib, rows, out, inp):
    """The q4 product computes, for the rows quantized to int8 as the u8 route does (a scale per
    U8_BLOCK inputs), sum over groups of d * (q . x) + m * sum(x): checked against that sum in
    float64; a row's result does not depend on the rows batched with it; bias and bf16 output."""
    w = _q4_weight(out, inp, rows)
    packed, dm = cpu_bf16.pack_q4(w)
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, inp, generator=g).bfloat16()
    x[0, 3] = 40.0  # an outlier channel
    b = torch.randn(out, generator=g)
    y = cpu_bf16.gemv_q4(lib, packed, dm, x, b, torch.float32)
    blocks = x.float().view(rows, -1, cpu_bf16.U8_BLOCK)
    step = blocks.abs().amax(-1, keepdim=True) / 127  # as the kernel: in fp32, x times 1 / step,
    xq = torch.round(blocks * (1 / step)).clamp(-127, 127)  # rounded to nearest even
    ref = (xq.double() * step.double()).view(rows, inp) @ w.double().t() + b.double()
    assert ((y.double() - ref).abs() <= 1e-5 * ref.abs().max()).all()
    exact = x.double() @ w.double().t() + b.double()
    assert (y.double() - exact).abs().max() < 0.05 * exact.abs().max()
    alone = torch.cat([cpu_bf16.gemv_q4(lib, packed, dm, x[i:i + 1], b, torch.float32) for i in range(rows)])
    assert torch.equal(alone, y)
    assert torch.equal(cpu_bf16.gemv_q4(lib, packed, dm, x, b), y.bfloat16())
    with pytest.raises(ValueError):
        cpu_bf16.gemv_q4(lib, packed, dm, x.float())


@needs_vnni
def test_int4_proj_keeps_a_4bit_weight_and_uses_the_kernel_for_few_rows(lib, monkeypatch):
    """An int4 `Proj` on an AVX512-VNNI CPU holds the q4 layout (the LM head of an int4 model stays
    int8), multiplies few bf16 rows on the kernel and more through its dequantized bf16 copy;
    what it multiplies by is the 4-bit weight itself."""
    w = _q4_weight(256, 128, 3)
    p = make_proj(w.bfloat16(), fmt="int4")
    assert p.q8_route == "q4" and torch.equal(p.dequantized(), cpu_bf16.unpack_q4(p.w_gemv, p.scale))
    assert (p.dequantized() - w).abs().max() <= 2 ** -8 * w.abs().max()  # from its bf16 copy: bf16's rounding at most
    calls = []
    real = cpu_bf16.gemv_q4
    monkeypatch.setattr(cpu_bf16, "gemv_q4", lambda *a, **k: calls.append(a[3].shape[0]) or real(*a, **k))
    for rows in (1, cpu_bf16.MAX_ROWS, cpu_bf16.MAX_ROWS + 1):
        x = torch.randn(rows, 128).bfloat16()
        ref = x.float() @ p.dequantized().t()
        assert (p(x).float() - ref).abs().max() < 0.03 * ref.abs().max()
    assert calls == [1, cpu_bf16.MAX_ROWS]
    x = torch.randn(2, 128)  # fp32 rows: the AVX2 q4 kernel (its rows in int8) where loaded, else an fp32 copy
    assert (p(x) - x @ p.dequantized().t()).abs().max() < 0.02 * (x @ p.dequantized().t()).abs().max()
    monkeypatch.setattr(cpu_fp32, "_lib", None)
    assert (p(x) - x @ p.dequantized().t()).abs().max() < 1e-4


@pytest.mark.parametrize("rows,dim", [(1, 576), (8, 960), (3, 100), (2048, 576)])
def test_rms_norm_rounds_as_the_torch_path(lib, rows, dim):
    import torch.nn.functional as F

    from agentmem.engine.layers import rms_norm

    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(rows, dim, generator=g) * 3).bfloat16()
    w = (torch.rand(dim, generator=g) + 0.5).bfloat16()
    ref = w * F.rms_norm(x.float(), w.shape, eps=1e-5).to(torch.bfloat16)  # the engine's bf16 rule
    assert torch.equal(cpu_bf16.rms_norm(lib, x, w, 1e-5), ref)
    assert torch.equal(rms_norm(x, w, 1e-5), ref)  # what the layers call, decode rows and prefill (its rows shared out)


def _causal_reference(q, k, v, q_pos):
    """fp32 softmax over the keys at or before each row's position (GQA: heads share KV heads)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(g, dim=1), v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,thd->nht", q.float(), kk) * q.shape[-1] ** -0.5
    seen = torch.arange(k.shape[0])[None, None, :] <= q_pos[:, None, None]
    return torch.einsum("nht,thd->nhd", torch.softmax(s.masked_fill(~seen, float("-inf")), -1), vv)


def _rows_case(keys: int, rows: int, heads: int, kv: int, hd: int, how: str, seed: int):
    """Random bf16 q [rows, heads, hd], k/v [keys, kv, hd] and the rows' positions: a prefill
    from 0, the last chunk, or scattered ascending rows (CacheBlend's recomputed ones)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, hd, generator=g).bfloat16()
    k = torch.randn(keys, kv, hd, generator=g).bfloat16()
    v = torch.randn(keys, kv, hd, generator=g).bfloat16()
    if how == "prefill":
        pos = torch.arange(rows)
    elif how == "chunk":
        pos = torch.arange(keys - rows, keys)
    else:
        pos = torch.randperm(keys, generator=g)[:rows].sort().values
    return q, k, v, pos


def _assert_causal(out, q, k, v, pos) -> torch.Tensor:
    """out is causal attention of q at pos over k/v: within bf16 rounding of an fp32 softmax and
    no worse on average than torch's bf16 SDPA; returns the reference."""
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    ref = _causal_reference(q, k, v, pos)
    # fp32 scores and softmax, the weights rounded to bf16 (or two bf16 each): the error is the bf16 roundings'
    assert (out.float() - ref).abs().max() < 2e-2 * max(1.0, ref.abs().max().item())
    from agentmem.engine.kernels.reference import sdpa
    torch_bf16 = sdpa(q, k, v, torch.arange(k.shape[0])[None, :] <= pos[:, None]).float()
    assert (out.float() - ref).abs().mean() <= 1.1 * (torch_bf16 - ref).abs().mean() + 1e-6  # no worse than SDPA
    return ref


@pytest.mark.parametrize("keys,rows,heads,kv,hd,how", [
    (37, 37, 9, 3, 64, "prefill"), (300, 100, 9, 3, 64, "chunk"), (130, 61, 8, 1, 128, "scattered"),
    (17, 5, 4, 4, 32, "scattered"), (1, 1, 2, 1, 64, "prefill"), (515, 256, 6, 2, 64, "scattered")])
def test_rows_attention_matches_causal_softmax(lib, keys, rows, heads, kv, hd, how):
    """Prefill chunks (rows start..end-1) and CacheBlend's recomputed rows (any ascending
    positions) over keys of any length (not a multiple of 16), with and without GQA; the
    weights as one bf16 each (the default) and as hi + lo (AGENTMEM_ATTN_P=split), which is
    closer still to the fp32 softmax."""
    q, k, v, pos = _rows_case(keys, rows, heads, kv, hd, how, keys * rows + hd)
    out = cpu_bf16.rows_attention(lib, q, k, v, pos)
    ref = _assert_causal(out, q, k, v, pos)
    split = cpu_bf16.rows_attention(lib, q, k, v, pos, split=True)
    _assert_causal(split, q, k, v, pos)
    if keys > 1:  # one key: both exact
        assert (split.float() - ref).abs().mean() < 0.95 * (out.float() - ref).abs().mean()


def test_rows_attention_p_setting(lib, monkeypatch):
    """AGENTMEM_ATTN_P picks the weights' form when the call does not: bf16 by default, split
    gives the hi + lo bits; anything else is refused with the setting's name."""
    q, k, v, pos = _rows_case(300, 100, 9, 3, 64, "chunk", 5)
    one, two = (cpu_bf16.rows_attention(lib, q, k, v, pos, split=s) for s in (False, True))
    assert not torch.equal(one, two)
    monkeypatch.delenv("AGENTMEM_ATTN_P", raising=False)
    assert torch.equal(cpu_bf16.rows_attention(lib, q, k, v, pos), one)
    monkeypatch.setenv("AGENTMEM_ATTN_P", "split")
    assert torch.equal(cpu_bf16.rows_attention(lib, q, k, v, pos), two)
    monkeypatch.setenv("AGENTMEM_ATTN_P", "fp16")
    with pytest.raises(ValueError, match="AGENTMEM_ATTN_P"):
        cpu_bf16.rows_attention(lib, q, k, v, pos)


@pytest.mark.parametrize("keys,rows,heads,kv,hd", [(2048, 40, 9, 3, 64), (37, 1, 4, 4, 64), (300, 7, 8, 2, 64),
                                                    (200, 19, 4, 2, 128), (130, 33, 6, 3, 32)])
@pytest.mark.parametrize("way", ["vdpbf16ps", "amx"])
def test_rows_attention_adds_each_keys_share_as_the_probe_computes_it(lib, keys, rows, heads, kv, hd, way):
    """`share`: per key, attention weight x |v|, summed over rows and heads, added to what the
    buffer holds (the kvreuse probe sums it over layers), against the fuser's torch path; by
    the vdpbf16ps kernel and on AMX tiles (rows past a row tile's last one are not counted)."""
    from agentmem.kvreuse.fuser import _attend_and_share, causal_bias

    if way == "amx" and not cpu_bf16.amx_usable(lib):
        pytest.skip("no AMX here (the CPU lacks amx_bf16/amx_tile, or Linux refused the tile state)")
    attend = cpu_bf16.rows_attention if way == "vdpbf16ps" else cpu_bf16.rows_attention_amx
    g = torch.Generator().manual_seed(keys + rows)
    q = torch.randn(rows, heads, hd, generator=g).bfloat16()
    k = torch.randn(keys, kv, hd, generator=g).bfloat16()
    v = (torch.randn(keys, kv, hd, generator=g) * torch.rand(keys, kv, 1, generator=g) * 3).bfloat16()
    pos = torch.randperm(keys - 1, generator=g)[: rows - 1].sort().values
    pos = torch.cat([pos, torch.tensor([keys - 1])])
    out_ref, share_ref = _attend_and_share(q, k, v, causal_bias(pos, keys, heads // kv))
    share = torch.full((keys,), 0.5)
    out = attend(lib, q, k, v, pos, share=share)
    assert (out.float() - out_ref.float()).abs().max() < 3e-2
    share -= 0.5  # it adds to the buffer
    assert torch.allclose(share, share_ref, rtol=2e-2, atol=2e-2 * share_ref.max().item())
    top = min(keys, 50)
    assert len(set(share.topk(top).indices.tolist()) & set(share_ref.topk(top).indices.tolist())) >= 0.9 * top
    assert torch.equal(attend(lib, q, k, v, pos), out)  # the share changes nothing in the attention
    with pytest.raises(ValueError, match="share"):
        attend(lib, q, k, v, pos, share=torch.zeros(keys, dtype=torch.float64))
    with pytest.raises(ValueError, match="share"):
        attend(lib, q, k, v, pos, share=torch.zeros(keys + 1))


def test_rows_attention_is_what_prefill_and_blend_use(lib, monkeypatch):
    """attend_chunk (prefill) and RowAttention (blend) take the kernel for bf16 where it is the
    route (AGENTMEM_ATTN_KERNEL=on here), SDPA with AGENTMEM_ATTN_KERNEL=off or in fp32, and fp32
    SDPA on widened rows with the route fp32; all agree."""
    from agentmem.engine.model_runner import attend_chunk
    from agentmem.kvreuse.fuser import RowAttention

    g = torch.Generator().manual_seed(5)
    q = torch.randn(48, 9, 64, generator=g).bfloat16()
    k = torch.randn(200, 3, 64, generator=g).bfloat16()
    v = torch.randn(200, 3, 64, generator=g).bfloat16()
    calls = []
    real = cpu_bf16.rows_attention
    monkeypatch.setattr(cpu_bf16, "rows_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("AGENTMEM_ATTN_KERNEL", "on")
    fast = attend_chunk(q, k[:200], v[:200], 152)
    rows = torch.tensor(sorted(torch.randperm(200, generator=g)[:48].tolist()))
    blend = RowAttention(rows, 200, torch.bfloat16)(q, k, v)
    assert calls == [1, 1]
    monkeypatch.setenv("AGENTMEM_ATTN_KERNEL", "off")
    assert cpu_bf16.rows_kernel(q, k) is None
    slow = attend_chunk(q, k[:200], v[:200], 152)
    blend_slow = RowAttention(rows, 200, torch.bfloat16)(q, k, v)
    assert calls == [1, 1]
    assert (fast.float() - slow.float()).abs().max() < 3e-2
    assert (blend.float() - blend_slow.float()).abs().max() < 3e-2
    assert cpu_bf16.rows_kernel(q.float(), k.float()) is None
    monkeypatch.setenv("AGENTMEM_ATTN_KERNEL", "fp32")
    assert cpu_bf16.rows_kernel(q, k) is None and cpu_bf16.widen_rows(q, k)
    assert not cpu_bf16.widen_rows(q.float(), k.float())
    wide = attend_chunk(q, k[:200], v[:200], 152)
    blend_wide = RowAttention(rows, 200, torch.bfloat16)(q, k, v)
    assert calls == [1, 1] and wide.dtype == blend_wide.dtype == torch.bfloat16
    assert (fast.float() - wide.float()).abs().max() < 3e-2
    assert (blend.float() - blend_wide.float()).abs().max() < 3e-2
    with pytest.raises(ValueError, match="rows_attention"):
        real(lib, q, k, v[:100], torch.arange(48))
    if not cpu_bf16.amx_usable(lib):
        return
    # the route amx: prefill, the blend's rows and its probe (with the share) on AMX tiles
    amx_calls = []
    real_amx = cpu_bf16.rows_attention_amx
    monkeypatch.setattr(cpu_bf16, "rows_attention_amx", lambda *a, **kw: amx_calls.append(1) or real_amx(*a, **kw))
    monkeypatch.setenv("AGENTMEM_ATTN_KERNEL", "amx")
    tiles = attend_chunk(q, k[:200], v[:200], 152)
    blend_tiles = RowAttention(rows, 200, torch.bfloat16)(q, k, v)
    assert amx_calls == [1, 1] and calls == [1, 1]
    share = torch.zeros(200)
    assert cpu_bf16.rows_attend(q, k, v, rows, share=share) is not None and amx_calls == [1, 1, 1]
    assert share.sum() > 0 and calls == [1, 1]
    assert (fast.float() - tiles.float()).abs().max() < 3e-2
    assert (blend.float() - blend_tiles.float()).abs().max() < 3e-2


def test_rows_route_is_measured_once_and_remembered(lib, tmp_path, monkeypatch):
    """choose_rows_route times the kernel, widened fp32 SDPA, bf16 SDPA and (where usable) the AMX
    kernel, keeps the fastest for those shapes (AGENTMEM_ATTN_KERNEL=auto), and a second call reads
    the memo instead of timing."""
    monkeypatch.setattr(cpu_bf16, "_ROUTES", {})
    monkeypatch.setenv("AGENTMEM_ATTN_KERNEL", "auto")
    assert cpu_bf16.rows_route(4, 2, 32) == "kernel"  # not measured yet: the kernel
    route = cpu_bf16.choose_rows_route(tmp_path, 4, 2, 32)
    saved = json.loads((tmp_path / "attention-choice.json").read_text())
    (entry,) = saved.values()
    ways = {"kernel", "fp32", "bf16"} | ({"amx"} if cpu_bf16.amx_usable(lib) else set())
    assert route in ways and entry["route"] == route
    assert set(entry["ms"]) == ways and route == min(entry["ms"], key=entry["ms"].get)
    assert cpu_bf16.rows_route(4, 2, 32) == route
    other = "fp32" if route == "kernel" else "kernel"
    entry["route"] = other  # a remembered choice is used as it is
    (tmp_path / "attention-choice.json").write_text(json.dumps(saved))
    assert cpu_bf16.choose_rows_route(tmp_path, 4, 2, 32) == other == cpu_bf16.rows_route(4, 2, 32)
    monkeypatch.setenv("AGENTMEM_ATTN_KERNEL", "off")
    assert cpu_bf16.rows_route(4, 2, 32) == "bf16"
    monkeypatch.setenv("AGENTMEM_ATTN_KERNEL", "yes")  # a typo is an error, not the default
    with pytest.raises(ValueError, match="AGENTMEM_ATTN_KERNEL"):
        cpu_bf16.rows_route(4, 2, 32)
    monkeypatch.setenv("AGENTMEM_ATTN_KERNEL", "amx")  # asked for: AMX where usable, else bf16 SDPA
    assert cpu_bf16.rows_route(4, 2, 32) == ("amx" if cpu_bf16.amx_usable(lib) else "bf16")
    monkeypatch.setenv("AGENTMEM_ATTN_KERNEL", "off")
    assert cpu_bf16.choose_rows_route(tmp_path, 4, 2, 24) == "bf16"  # hd 24: the kernel cannot take it


@pytest.mark.parametrize("rows,heads,hd", [(1, 12, 64), (7, 4, 32), (16, 6, 128), (300, 12, 64)])
def test_rope_kernel_rotates_as_the_torch_path(lib, rows, heads, hd, monkeypatch):
    """Rows inside the fused qkv output (heads adjacent, rows strided), decode's few or a
    prefill's many (the kernel's threads split those), are rotated in one C call, to what
    `layers.rotate`'s torch ops give (fp32 products and sum, bf16 rounding)."""
    from agentmem.engine import layers

    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, heads + 3, hd, generator=g).bfloat16()
    x = qkv[:, :heads]  # q and k of the fused projection: a strided view
    cos, sin = layers.Rotary(hd, 10000.0, 4096).cos_sin(torch.randint(0, 4096, (rows,), generator=g))
    assert cpu_bf16.rope_usable(x, cos)
    calls = []
    real = cpu_bf16.rope
    monkeypatch.setattr(cpu_bf16, "rope", lambda *a: calls.append(1) or real(*a))
    fast = layers.rotate(x, cos, sin)
    assert calls == [1] and fast.shape == x.shape and fast.dtype == torch.bfloat16
    monkeypatch.setattr(cpu_bf16, "loaded", lambda: None)  # the torch ops
    slow = layers.rotate(x, cos, sin)
    assert (fast.float() - slow.float()).abs().max() <= 1e-2 * slow.float().abs().max()
    assert (fast != slow).float().mean() < 0.01  # the same rounding but for rare ties
    assert not cpu_bf16.rope_usable(x.float(), cos) and not cpu_bf16.rope_usable(x[..., :16], cos[:, :16])


def _fake_model(hd: int = 64):
    """What _Drift.bind and place_k read of a model: its RoPE and the device of its weights."""
    from types import SimpleNamespace

    from agentmem.engine.layers import Rotary

    return SimpleNamespace(rotary=Rotary(hd, 10000.0, 4096), embed_tokens=SimpleNamespace(weight=torch.zeros(1)))


def test_drift_kernel_shifts_each_group_as_the_torch_path(lib, monkeypatch):
    """kvreuse's drift correction of one layer in C (bf16): each group's span, rows included,
    moves by its mean drift, K rotated to each position; equal to the torch path up to one
    bf16 rounding (the kernel sums in fp32 and rounds once)."""
    from agentmem.kvreuse.fuser import _Drift

    g = torch.Generator().manual_seed(3)
    n_tok, layers, kv, hd = 700, 2, 3, 64
    token_group = torch.full((n_tok,), -1)
    token_group[20:300], token_group[300:650] = 0, 1
    pos = torch.tensor([40, 120, 250, 330, 480, 600])
    d = _Drift(pos, torch.tensor([0, 0, 0, 1, 1, 1]), torch.randn(layers, 6, kv, hd, generator=g).bfloat16(),
               torch.randn(layers, 6, kv, hd, generator=g).bfloat16(), token_group, 2)
    rows = torch.cat([pos, torch.tensor([10, 690])]).sort().values
    k_raw = torch.randn(len(rows), kv, hd, generator=g).bfloat16()
    v = torch.randn(len(rows), kv, hd, generator=g).bfloat16()
    k_l = torch.randn(n_tok, kv, hd, generator=g).bfloat16()
    v_l = torch.randn(n_tok, kv, hd, generator=g).bfloat16()
    outs = []
    for use in (None, lib):
        monkeypatch.setattr(cpu_bf16, "_lib", use)
        d.bind(_fake_model(hd), rows)
        assert (d.lib is None) == (use is None)
        k2, v2 = k_l.clone(), v_l.clone()
        d.apply(1, k_raw, v, k2, v2)
        outs.append((k2.float(), v2.float()))
    (kt, vt), (kk, vk) = outs
    assert not torch.equal(kt, k_l.float())  # it moved
    assert torch.equal(kk[:20], k_l[:20].float()) and torch.equal(kk[650:], k_l[650:].float())  # outside the spans: not
    tol = 2 ** -7 * (kt.abs() + 1)  # one bf16 rounding (the torch path rounds after each of its two steps)
    assert ((kk - kt).abs() <= tol).all() and ((vk - vt).abs() <= 2 ** -7 * (vt.abs() + 1)).all()
    with pytest.raises(ValueError, match="drift"):
        cpu_bf16.drift(lib, k_l, v_l, torch.tensor([[0, 800]]), torch.zeros(1, kv, hd), torch.zeros(1, kv, hd),
                       *_fake_model(hd).rotary.tables())


def test_place_k_writes_rotated_chunks_where_it_is_told(lib, monkeypatch):
    """place_k into the blend's K (the kernel a layer at a time, in bf16) equals the model's own
    rotation, and without the kernel the same lands there too."""
    from agentmem.kvreuse.fuser import place_k

    model = _fake_model()
    g = torch.Generator().manual_seed(4)
    k = torch.randn(3, 50, 3, 64, generator=g).bfloat16()
    positions = torch.arange(200, 250)
    ref = model.rotary.apply(k, positions)
    for use in (lib, None):
        monkeypatch.setattr(cpu_bf16, "_lib", use)
        dest = torch.zeros(3, 300, 3, 64).bfloat16()
        got = place_k(model, k, positions, out=dest[:, 200:250])
        assert torch.equal(dest[:, 200:250], ref) and torch.equal(got, ref)
        assert not dest[:, :200].any() and not dest[:, 250:].any()
    assert torch.equal(place_k(model, k, positions), ref)


@pytest.mark.parametrize("rows,inner", [(2, 1536), (300, 1536), (5, 40)])
def test_silu_mul_rounds_as_torch(lib, rows, inner, monkeypatch):
    """SwiGLU's silu(gate) * up in one C call: the same bf16 values as torch's two ops, for
    the fused gate/up output (a width not a multiple of 16 too); Block.finish takes it for
    more than one bf16 row."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(rows)
    gu = (torch.randn(rows, 2 * inner, generator=g) * 4).bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    got = cpu_bf16.silu_mul(lib, gu)
    ref = F.silu(gate) * up
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    assert (got != ref).float().mean() < 1e-3 and (got.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max()
    with pytest.raises(ValueError, match="silu_mul"):
        cpu_bf16.silu_mul(lib, gu.float())
    calls = []
    real = cpu_bf16.silu_mul
    monkeypatch.setattr(cpu_bf16, "silu_mul", lambda *a: calls.append(1) or real(*a))
    from agentmem.engine import model as M
    from agentmem.engine.model import Block, ModelArgs

    args = ModelArgs(dim=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32, vocab_size=10, hidden_dim=inner,
                     norm_eps=1e-5, rope_theta=10000.0, max_seq_len=64)
    block = Block(args, 0).to(torch.bfloat16)
    block.fuse()
    block.pack("bf16")
    h, att = torch.randn(rows, 64, generator=g).bfloat16(), torch.randn(rows, 2, 32, generator=g).bfloat16()
    fast = block.finish(h, att)
    assert calls == [1]
    monkeypatch.setattr(cpu_bf16, "loaded", lambda: None)  # torch's ops (and products), chosen at packing
    block.pack("bf16")
    assert block.kernels is M.fused_decode.REFERENCE
    slow = block.finish(h, att)
    assert calls == [1] and (slow.float() - fast.float()).abs().max() <= 2e-2 * slow.float().abs().max()


@needs_vnni
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_fused_finish_is_bit_identical_to_the_separate_calls(lib, monkeypatch, fmt, rows):
    """A layer's second half (o, residual, norm, gate/up, silu * up, down, residual) as one C call
    on the u8 route gives the same bits as the seven calls it replaces; more rows than a tile,
    or weights off the u8 route, take the separate calls."""
    from agentmem.engine import model as M

    monkeypatch.setattr(cpu_bf16, "q8_route", "u8")
    args = M.ModelArgs(vocab_size=64, dim=128, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=192, head_dim=32)
    torch.manual_seed(rows)
    block = M.Block(args, 0).to(torch.bfloat16)
    block.post_norm.weight.data = (1 + 0.1 * torch.randn(128)).bfloat16()
    block.fuse()
    block.pack(fmt)
    h, attn = torch.randn(rows, 128).bfloat16(), torch.randn(rows, 4, 32).bfloat16()
    calls = []
    real = cpu_bf16.finish_q8u8
    monkeypatch.setattr(cpu_bf16, "finish_q8u8", lambda *a: calls.append(1) or real(*a))
    assert isinstance(block.kernels, M.fused_decode.Bf16Fused)
    fused = block.finish(h, attn)
    block.set_kernels(fused=False)
    separate = block.finish(h, attn)
    assert calls == [1] and torch.equal(fused, separate) and fused.abs().max() > 0
    block.set_kernels(fused=True)
    many = torch.randn(cpu_bf16.MAX_FINISH_ROWS + 1, 128).bfloat16()
    block.finish(many, torch.randn(len(many), 4, 32).bfloat16())
    assert calls == [1]  # nine rows: the separate calls


@needs_vnni
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_layer_halves_are_bit_identical_to_the_separate_calls(lib, monkeypatch, fmt, rows):
    """A whole decode layer with both fused halves (norm, qkv and RoPE of q and k in one call;
    `finish` in another) gives the same bits as the separate calls, through any attention."""
    from agentmem.engine import model as M
    from agentmem.engine.layers import Rotary

    monkeypatch.setattr(cpu_bf16, "q8_route", "u8")
    args = M.ModelArgs(vocab_size=64, dim=128, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=192, head_dim=32)
    torch.manual_seed(10 + rows)
    block = M.Block(args, 0).to(torch.bfloat16)
    block.input_norm.weight.data = (1 + 0.1 * torch.randn(128)).bfloat16()
    block.fuse()
    block.pack(fmt)
    rotary = Rotary(32, 10000.0, 512)
    seen = []

    def attn(i, q, k_raw, k_rot, v):  # uses every input, records them
        seen.append((q.clone(), k_raw.clone(), k_rot.clone(), v.clone()))
        return q + (k_rot + k_raw - v).repeat_interleave(2, dim=1)

    h, pos = torch.randn(rows, 128).bfloat16(), torch.arange(100, 100 + rows)
    calls = []
    real = cpu_bf16.qkv_q8u8
    monkeypatch.setattr(cpu_bf16, "qkv_q8u8", lambda *a: calls.append(1) or real(*a))
    fused = block(h, pos, rotary, attn)
    block.set_kernels(fused=False)
    separate = block(h, pos, rotary, attn)
    assert calls == [1] and torch.equal(fused, separate)
    assert all(torch.equal(a, b) for a, b in zip(seen[0], seen[1], strict=True))


@needs_vnni
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_fused_decode_layer_over_a_paged_pool_is_bit_identical(lib, monkeypatch, fmt):
    """Three decode rows of different lengths, each with its keys scattered over a paged pool:
    the whole layer as one call (`layer_q8u8`) writes the same K/V into the pool and returns the
    same bits as the separate calls (write, then `decode_attention`)."""
    from types import SimpleNamespace

    from agentmem.engine import model as M
    from agentmem.engine.layers import Rotary

    monkeypatch.setattr(cpu_bf16, "q8_route", "u8")
    args = M.ModelArgs(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=192, head_dim=32)
    torch.manual_seed(7)
    block = M.Block(args, 1).to(torch.bfloat16)
    block.fuse()
    block.pack(fmt)
    g = torch.Generator().manual_seed(7)
    k0, v0 = (torch.randn(2, 64, 2, 32, generator=g).bfloat16() for _ in range(2))  # [layers, slots, KV, hd]
    lens = [5, 17, 9]  # keys per row, its new one last
    perm = torch.randperm(64, generator=g)
    rows_slots, at = [], 0
    for n in lens:
        rows_slots.append(perm[at:at + n].tolist())
        at += n
    width = max(lens)
    idx = torch.tensor([s + s[:1] * (width - len(s)) for s in rows_slots])
    keep = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in rows_slots], dtype=torch.uint8)
    slots = torch.tensor([s[-1] for s in rows_slots])
    h, pos = torch.randn(3, 128, generator=g).bfloat16(), torch.tensor([n - 1 for n in lens])
    rotary = Rotary(32, 10000.0, 512)
    fused_pool = SimpleNamespace(k=k0.clone(), v=v0.clone())

    def fused_attn(i, q, k_raw, k_rot, v):
        raise AssertionError("the fused layer attends itself")

    fused_attn.decode_pool = (fused_pool, slots, idx.flatten().contiguous(), keep)
    fused = block(h, pos, rotary, fused_attn)
    pool = SimpleNamespace(k=k0.clone(), v=v0.clone())

    def attn(i, q, k_raw, k_rot, v):
        pool.k[i].index_copy_(0, slots, k_rot)
        pool.v[i].index_copy_(0, slots, v)
        return cpu_bf16.decode_attention(lib, q, pool.k[i], pool.v[i], idx.flatten(), keep)

    block.set_kernels(fused=False)
    separate = block(h, pos, rotary, attn)
    assert torch.equal(fused, separate) and torch.equal(fused_pool.k, pool.k) and torch.equal(fused_pool.v, pool.v)
    assert not torch.equal(pool.k, k0)  # the rows' keys were written


@needs_vnni
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_whole_bf16_decode_step_in_one_call_is_bit_identical(lib, monkeypatch, fmt):
    """`Transformer.forward` of bf16 decode rows over a paged pool, every weight int8 on the u8
    route, runs every layer in one C call (`layers_q8u8`): the same logits and the same K/V in
    every layer's pool as the layers one by one (each a `layer_q8u8` call), for one row and for
    several of different lengths; a model whose layers the call does not take (a q/k norm,
    Qwen3's) runs them one by one."""
    from types import SimpleNamespace

    from agentmem.engine import model as M

    monkeypatch.setattr(cpu_bf16, "q8_route", "u8")
    args = M.ModelArgs(vocab_size=96, dim=128, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=192, head_dim=32)
    torch.manual_seed(5)
    model = M.Transformer(args).to(torch.bfloat16)
    for blk in model.layers:
        blk.input_norm.weight.data = (1 + 0.1 * torch.randn(128)).bfloat16()
        blk.fuse()
    model.pack(fmt)
    whole, per_layer = [], []
    real_all, real_one = cpu_bf16.layers_q8u8, cpu_bf16.layer_q8u8
    monkeypatch.setattr(cpu_bf16, "layers_q8u8",
                        lambda *a: (out := real_all(*a)) is not None and whole.append(1) or out)
    monkeypatch.setattr(cpu_bf16, "layer_q8u8",
                        lambda *a: (out := real_one(*a)) is not None and per_layer.append(1) or out)
    tables = {}

    def run(lens: list[int], fused: bool):
        if tuple(lens) not in tables:  # the same pool and rows for both ways
            tables[tuple(lens)] = paged_rows(lens, 3, 96, torch.bfloat16, torch.Generator().manual_seed(len(lens)))
        k0, v0, idx, keep, slots = tables[tuple(lens)]
        ids = torch.arange(len(lens)) * 7 % 96
        pool = SimpleNamespace(k=k0.clone(), v=v0.clone())

        def attn(i, q, k_raw, k_rot, v):
            raise AssertionError("decode rows over the pool attend inside the C calls")

        attn.decode_pool = (pool, slots, idx, keep)
        kept = model._u8_layers
        if not fused:  # the layers one by one: a table that says "not taken"
            model._u8_layers = False
        try:
            return model(ids, torch.tensor([n - 1 for n in lens]), attn), pool
        finally:
            if not fused:
                model._u8_layers = kept

    for lens in ([12], [5, 17, 9, 2]):
        whole.clear(), per_layer.clear()
        (one_call, p1), (layers, p2) = run(lens, True), run(lens, False)
        assert whole == [1] and per_layer == [1, 1, 1]
        assert torch.equal(one_call, layers) and torch.equal(p1.k, p2.k) and torch.equal(p1.v, p2.v)
        k0 = tables[tuple(lens)][0]
        assert all(not torch.equal(p1.k[i], k0[i]) for i in range(3))  # the rows' keys written in every layer
    model.layers[1].q_norm = M.RMSNorm(32, 1e-5).to(torch.bfloat16)  # Qwen3-style: not taken
    model.layers[1].k_norm = M.RMSNorm(32, 1e-5).to(torch.bfloat16)
    model.pack(fmt)  # resets the table of pointers
    assert model._u8_layers is None
    whole.clear()
    with pytest.raises(AssertionError, match="attend inside"):  # layer 1 runs its separate calls
        run([4], True)
    assert whole == [] and model._u8_layers is False


@pytest.fixture(scope="module")
def amx_lib(lib):
    if not cpu_bf16.amx_usable(lib):
        pytest.skip("no AMX here (the CPU lacks amx_bf16/amx_tile, or Linux refused the tile state)")
    return lib


@pytest.mark.parametrize("keys,rows,heads,kv,hd,how", [
    (300, 300, 9, 3, 64, "prefill"),      # a chunk at 0: rows not a multiple of 16, keys not of 64
    (37, 37, 9, 3, 64, "prefill"),
    (300, 100, 9, 3, 64, "chunk"),        # a chunk at 200 over all the keys before it
    (700, 129, 8, 8, 64, "chunk"),
    (500, 40, 9, 3, 64, "scattered"),     # the blend's recomputed rows
    (130, 61, 8, 8, 128, "scattered"),
    (257, 257, 8, 8, 128, "prefill"),
    (200, 33, 4, 2, 96, "chunk"),
    (17, 5, 4, 4, 32, "scattered"),
    (64, 64, 6, 2, 32, "prefill"),
    (90, 20, 2, 1, 256, "chunk"),
    (150, 50, 3, 3, 160, "scattered"),
    (1, 1, 2, 1, 64, "prefill"),
    (515, 256, 6, 2, 64, "scattered")])
def test_rows_attention_amx_matches_causal_softmax(amx_lib, keys, rows, heads, kv, hd, how):
    """The AMX kernel: what `rows_attention` computes, for prefill chunks and CacheBlend's rows,
    any row and key count, GQA or not, head_dim 32 to 128; as close to an fp32 softmax as the
    vdpbf16ps kernel (the weights as hi + lo bf16) and no worse than torch's bf16 SDPA."""
    q, k, v, pos = _rows_case(keys, rows, heads, kv, hd, how, keys * rows + hd + 1)
    out = cpu_bf16.rows_attention_amx(amx_lib, q, k, v, pos)
    ref = _assert_causal(out, q, k, v, pos)
    old = cpu_bf16.rows_attention(amx_lib, q, k, v, pos, split=True).float()
    assert (out.float() - ref).abs().mean() <= 1.1 * (old - ref).abs().mean() + 1e-6


def test_rows_attention_amx_keeps_large_and_growing_scores(amx_lib):
    """Scores that grow along the keys (the running max raised block after block, O rescaled),
    a large first key (an attention sink) and rows that see one key only; a non-default scale;
    strided inputs."""
    g = torch.Generator().manual_seed(11)
    keys, heads, kv, hd = 400, 6, 3, 64
    q = (torch.randn(keys, heads, hd, generator=g) * 3).bfloat16()
    k = torch.randn(keys, kv, hd, generator=g) * torch.linspace(0.2, 4.0, keys)[:, None, None]
    k[0] *= 6
    k = k.bfloat16()
    v = torch.randn(keys, kv, 2 * hd, generator=g).bfloat16()[..., ::2]  # not contiguous
    pos = torch.arange(keys)
    for scale in (None, 0.3):
        out = cpu_bf16.rows_attention_amx(amx_lib, q, k, v, pos, scale)
        ref = _causal_reference(q, k, v, pos) if scale is None else _scaled_reference(q, k, v, pos, scale)
        assert torch.isfinite(out.float()).all()
        assert (out.float() - ref).abs().max() < 2e-2 * max(1.0, ref.abs().max().item())
        assert (out.float() - ref).abs().mean() < 2e-3
    assert torch.equal(out[0].float(), v[0].float().repeat_interleave(heads // kv, 0))  # row 0 sees key 0 only


def _scaled_reference(q, k, v, q_pos, scale):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, dim=1), v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,thd->nht", q.double(), kk) * scale
    seen = torch.arange(k.shape[0])[None, None, :] <= q_pos[:, None, None]
    return torch.einsum("nht,thd->nhd", torch.softmax(s.masked_fill(~seen, float("-inf")), -1), vv).float()


def test_rows_attention_amx_rejects_what_it_does_not_take(amx_lib):
    q = torch.randn(4, 4, 64).bfloat16()
    k = torch.randn(8, 2, 64).bfloat16()
    with pytest.raises(ValueError):
        cpu_bf16.rows_attention_amx(amx_lib, q, k, k[:7], torch.arange(4))
    with pytest.raises(ValueError):
        cpu_bf16.rows_attention_amx(amx_lib, q.float(), k.float(), k.float(), torch.arange(4))
    with pytest.raises(ValueError):
        cpu_bf16.rows_attention_amx(amx_lib, q[..., :48], k[..., :48], k[..., :48], torch.arange(4))
    with pytest.raises(ValueError):
        cpu_bf16.rows_attention_amx(amx_lib, q[:, :3], k, k, torch.arange(4))
    with pytest.raises(ValueError):
        cpu_bf16.rows_attention_amx(amx_lib, q, k, k, torch.arange(4), scale=-1.0)


def test_amx_usable_needs_the_cpu_flags_and_is_remembered(lib, monkeypatch):
    """No AMX flags: not usable, without asking the library; the answer is kept."""
    monkeypatch.setattr(cpu_bf16, "_amx", None)
    monkeypatch.setattr(cpu_bf16, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_tile"}))
    assert cpu_bf16.amx_usable(lib) is False
    monkeypatch.setattr(cpu_bf16, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    assert cpu_bf16.amx_usable(lib) is False  # remembered
