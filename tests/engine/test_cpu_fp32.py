"""kernels/cpu_fp32.py: the AVX2 int8-weight product of fp32 rows against torch, and Proj's
use of it (the int8 route of an fp32 engine)."""

from __future__ import annotations

import pytest
import torch
from _paged import paged_rows

from agentmem.engine.kernels import cpu_bf16, cpu_fp32
from agentmem.engine.linear import make_proj


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def lib(cache):
    lib = cpu_fp32.load(cache)
    if lib is None:
        pytest.skip(f"no AVX2 int8 kernel here: {cpu_fp32.why_not}")
    return lib


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


# rows up to 16 (4-row tiles, or 8-row ones on AVX512-VNNI, and a ragged last one), K past one
# int32 chunk (2,048 inputs), K not a multiple of 16 (the scalar tails of the quantizer)
@pytest.mark.parametrize("rows,out,inp", [(1, 960, 576), (3, 48, 576), (5, 576, 1536), (16, 32, 4100), (2, 16, 34),
                                          (11, 64, 576)])
def test_gemv_q8_matches_the_dequantized_product(lib, rows, out, inp):
    g = torch.Generator().manual_seed(rows * out + inp)
    q, scale = _int8(torch.randn(out, inp, generator=g) * 0.05)
    x = torch.randn(rows, inp, generator=g)
    x[:, 3] *= 40  # an outlier channel, as real activations have: the row's int16 step is set by it
    b = torch.randn(out, generator=g)
    ref = x @ (q.float() * scale[:, None]).t() + b
    y = cpu_fp32.gemv_q8(lib, cpu_bf16.pack(q), scale, x, b)
    assert y.shape == (rows, out) and y.dtype == torch.float32
    # int16 rows keep 13 bits of each row's largest value: the error is a few parts in 10^4 of
    # the row's largest sum, far below int8 weights' own
    assert (y - ref).abs().max() < 2e-3 * ref.abs().max()
    assert not torch.equal(y, torch.zeros_like(y))


_WIDE = [("vnni", cpu_fp32.VNNI512_FLAGS, cpu_fp32.vnni512_ok), ("avx512bw", cpu_fp32.AVX512BW_FLAGS, cpu_fp32.avx512bw_ok)]


@pytest.mark.parametrize("wide,flags,ok", _WIDE, ids=[w[0] for w in _WIDE])
def test_the_avx512_products_give_the_avx2_products_bits(lib, cache, wide, flags, ok):
    """The library built with its AVX-512 tiles (8 rows a tile; `vpdpwssd` for int8 weights and
    `vpdpbusd` for 4-bit ones on VNNI, 512-bit `vpmaddwd` and `vpmaddubsw` without it) and without
    them (4 rows, 256-bit `vpmaddwd`; `vpmaddubsw` over 8 outputs): the same int32 sums and fp32
    arithmetic, so the same bits (the fused layer's tests compare its residual form with the
    separate calls on whichever is loaded)."""
    if not ok():
        pytest.skip(f"the CPU cannot run the {wide} tile")
    libs = {}
    for name, fl in (("avx2", cpu_fp32._AVX2_FLAGS), (wide, cpu_fp32._AVX2_FLAGS + flags)):
        libs[name], why = cpu_bf16.build("gemv_avx2", cpu_fp32._SOURCE, fl, cpu_fp32._SIGNATURES, cache)
        assert libs[name] is not None, why
    g = torch.Generator().manual_seed(5)
    for rows, out, inp in [(1, 960, 576), (8, 576, 1536), (13, 3072, 576), (16, 32, 4100), (7, 16, 34)]:
        q, scale = _int8(torch.randn(out, inp, generator=g) * 0.05)
        x, b = torch.randn(rows, inp, generator=g), torch.randn(out, generator=g)
        ys = {name: cpu_fp32.gemv_q8(lib, cpu_bf16.pack(q), scale, x, b) for name, lib in libs.items()}
        assert torch.equal(ys["avx2"], ys[wide]), (rows, out, inp)
    # 4-bit weights: 16 outputs and 8 rows a tile, or 8 and 4: the same
    for rows, out, inp in [(1, 960, 576), (8, 576, 1536), (13, 3072, 576), (5, 32, 64)]:
        packed, dm = cpu_bf16.pack_q4(torch.randn(out, inp, generator=g) * 0.05)
        x, b = torch.randn(rows, inp, generator=g), torch.randn(out, generator=g)
        ys = {name: cpu_fp32.gemv_q4(lib, packed, dm, x, b) for name, lib in libs.items()}
        assert torch.equal(ys["avx2"], ys[wide]), (rows, out, inp)


def test_the_products_tile_is_timed_once_per_machine_and_remembered(lib, cache, monkeypatch):
    import json

    monkeypatch.setenv("AGENTMEM_GEMV_VNNI512", "sometimes")
    with pytest.raises(ValueError, match="AGENTMEM_GEMV_VNNI512"):
        cpu_fp32.choose_tile(cache)
    monkeypatch.setenv("AGENTMEM_GEMV_VNNI512", "off")
    assert cpu_fp32.choose_tile(cache) is False
    monkeypatch.setenv("AGENTMEM_GEMV_VNNI512", "auto")
    wide = "-DAGENTMEM_AVX512" in cpu_fp32._FLAGS  # what `load` took for this module's library
    vnni = "-DAGENTMEM_VNNI512" in cpu_fp32._FLAGS
    assert (cpu_fp32.PRODUCT_MAX_ROWS == cpu_fp32.VNNI512_PRODUCT_MAX_ROWS) == vnni
    if cpu_fp32.wide_tile() is None:
        assert not wide and cpu_fp32.choose_tile(cache) is False
        return
    name = cpu_fp32.wide_tile()[0]
    assert name == ("vnni512" if cpu_fp32.vnni512_ok() else "avx512bw")
    chosen = cpu_fp32.choose_tile(cache)  # timed now where `load` did not (AGENTMEM_GEMV_VNNI512 was off)
    (entry,) = json.loads((cache / "avx2-tile-choice.json").read_text()).values()
    assert set(entry["us"]) == {"avx2", name} and entry["tile"] == min(entry["us"], key=entry["us"].get)
    assert chosen == (entry["tile"] == name)
    monkeypatch.setattr(cpu_bf16, "cold_int8_seconds", lambda *a, **k: pytest.fail("timed again"))
    assert cpu_fp32.choose_tile(cache) == chosen  # remembered


def test_gemv_q8_reads_strided_rows_and_checks_its_input(lib):
    q, scale = _int8(torch.randn(32, 96))
    x = torch.randn(2, 192)[:, :96]  # rows 192 apart
    ref = x @ (q.float() * scale[:, None]).t()
    assert torch.allclose(cpu_fp32.gemv_q8(lib, cpu_bf16.pack(q), scale, x), ref, rtol=0, atol=2e-3 * ref.abs().max())
    with pytest.raises(ValueError, match="fp32"):
        cpu_fp32.gemv_q8(lib, cpu_bf16.pack(q), scale, x.bfloat16())
    with pytest.raises(ValueError):
        cpu_fp32.gemv_q8(lib, cpu_bf16.pack(q), scale, torch.randn(1, 64))


@pytest.mark.parametrize("rows,out,inp", [(1, 960, 576), (3, 64, 128), (4, 576, 1536), (7, 32, 64), (9, 96, 192)])
def test_gemv_q4_is_the_groups_sums_of_the_quantized_rows(lib, rows, out, inp):
    """The AVX2 4-bit product (`vpmaddubsw` on the q4 layout) computes, for the rows quantized to
    int8 per 64 inputs, sum over groups of d * (q . x) + m * sum(x): checked against that sum in
    float64 (int16 lane sums of a whole group cannot overflow: q <= 15, |x| <= 127); a row's
    result does not depend on the rows batched with it; a bias is added."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out, inp, generator=g) * 0.05
    packed, dm = cpu_bf16.pack_q4(w)
    wq = cpu_bf16.unpack_q4(packed, dm)
    x = torch.randn(rows, inp, generator=g)
    x[0, 5] = 60.0  # an outlier channel: its block's step only
    b = torch.randn(out, generator=g)
    y = cpu_fp32.gemv_q4(lib, packed, dm, x, b)
    blocks = x.view(rows, -1, 64)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(blocks * (1 / step)).clamp(-127, 127)
    ref = (xq.double() * step.double()).view(rows, inp) @ wq.double().t() + b.double()
    assert ((y.double() - ref).abs() <= 1e-5 * ref.abs().max()).all()
    full = torch.full((out, inp), 0.5)  # every q = 15 against x = +-127: the largest lane sums
    pf, dmf = cpu_bf16.pack_q4(full + torch.arange(inp) % 2 * 0.25)
    xs = torch.where(torch.arange(inp) % 2 == 0, 1.0, -1.0).expand(rows, inp).contiguous()
    want = xs @ cpu_bf16.unpack_q4(pf, dmf).t()
    assert (cpu_fp32.gemv_q4(lib, pf, dmf, xs) - want).abs().max() < 1e-4 * want.abs().max() + 1e-4
    alone = torch.cat([cpu_fp32.gemv_q4(lib, packed, dm, x[i:i + 1], b) for i in range(rows)])
    assert torch.equal(alone, y)
    with pytest.raises(ValueError):
        cpu_fp32.gemv_q4(lib, packed, dm, x.bfloat16())


def test_an_fp32_int8_projection_takes_the_kernel_for_few_rows_and_a_dequantized_copy_for_many(lib, monkeypatch):
    if cpu_bf16.loaded() is not None:
        monkeypatch.setattr(cpu_bf16, "_lib", None)  # as on an AVX2-only CPU: no AVX512-BF16 kernels
    # with the AVX512-VNNI tile every row count takes the kernel (`load`); the AVX2 tile's bound here
    monkeypatch.setattr(cpu_fp32, "PRODUCT_MAX_ROWS", 48)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(192, 576, generator=g) * 0.05
    b = torch.randn(192, generator=g)
    p = make_proj(w, b, fmt="int8")
    assert p.q8_route == "avx2" and p.w_gemv is not None
    ref_w = p.packed.float() * p.scale[:, None]
    calls = []
    real = cpu_fp32.gemv_q8
    monkeypatch.setattr(cpu_fp32, "gemv_q8", lambda *a, **k: calls.append(1) or real(*a, **k))
    for rows in (1, 8, cpu_fp32.PRODUCT_MAX_ROWS, cpu_fp32.PRODUCT_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 576, generator=g)
        ref = x @ ref_w.t() + b
        y = p(x)
        assert y.shape == (rows, 192) and y.dtype == torch.float32
        assert (y - ref).abs().max() < 2e-3 * ref.abs().max()
    assert len(calls) == 3  # the rows up to PRODUCT_MAX_ROWS; more went through the fp32 copy
    assert p._rows_w_t is not None and p._rows_w_t.shape == (576, 192)
    # the copy multiplies exactly as the dense fp32 format would
    x = torch.randn(cpu_fp32.PRODUCT_MAX_ROWS + 12, 576, generator=g)
    assert torch.allclose(p(x), x @ ref_w.t() + b, atol=1e-4)


def test_rms_norm_and_rope_match_torch(lib, monkeypatch):
    import torch.nn.functional as F

    from agentmem.engine.layers import rotate

    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 576, generator=g)[:, :570]  # rows 576 apart, a width not a multiple of 8
    w = torch.randn(570, generator=g)
    assert torch.allclose(cpu_fp32.rms_norm(lib, x, w, 1e-5), F.rms_norm(x, (570,), w, 1e-5), rtol=1e-5, atol=1e-6)
    qkv = torch.randn(3, 15 * 64, generator=g)  # q (9 heads) and k (3) inside a fused output, then v
    q = qkv[:, :9 * 64].view(3, 9, 64)
    cos, sin = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    assert cpu_fp32.rope_usable(q, cos) and not cpu_fp32.rope_usable(q.bfloat16(), cos)
    swapped = q.reshape(3, 9, 2, 32).flip(-2).reshape(3, 9, 64)
    ref = q * cos[:, None, :] + swapped * sin[:, None, :]
    y = cpu_fp32.rope(lib, q, cos, sin)
    assert y.is_contiguous() and torch.allclose(y, ref, atol=1e-6)
    assert torch.allclose(rotate(q, cos, sin), ref, atol=1e-6)  # what the engine's layers call
    many = torch.randn(300, 15 * 64, generator=g)[:, :12 * 64].view(300, 12, 64)  # a prefill's q and k
    cos, sin = torch.randn(300, 64, generator=g), torch.randn(300, 64, generator=g)
    ref = many * cos[:, None, :] + many.reshape(300, 12, 2, 32).flip(-2).reshape(300, 12, 64) * sin[:, None, :]
    calls = []
    real = cpu_fp32.rope
    monkeypatch.setattr(cpu_fp32, "rope", lambda *a: calls.append(1) or real(*a))
    assert torch.allclose(rotate(many, cos, sin), ref, atol=1e-6) and calls == [1]  # any number of rows


# past the first three: a row's keys in several chunks (1500 keys: 8 of `da_chunk`'s at one row
# and 2 threads), the first chunks wholly outside a sliding window (the merge skips them), more
# than 4 query heads a KV head (V summed in several passes), 17 a KV head (past the 16 scored
# together), hd 96 and 256 (V's dims in passes of 4 and a ragged last one), hd 8, a row with no
# kept key (zeros)
@pytest.mark.parametrize("rows,width,heads,kv_heads,hd,window", [
    (1, 300, 9, 3, 64, False), (3, 37, 8, 8, 32, False), (2, 5, 4, 1, 128, False), (1, 1500, 9, 3, 64, False),
    (2, 1500, 9, 3, 64, True), (3, 700, 12, 2, 96, True), (2, 600, 16, 2, 256, True), (2, 300, 17, 1, 40, True),
    (4, 90, 10, 2, 8, False), (5, 1000, 7, 1, 64, True)])
def test_decode_attention_matches_sdpa_over_gathered_keys(lib, rows, width, heads, kv_heads, hd, window):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(rows * width + hd)
    k_pool = torch.randn(64, 16, kv_heads, hd, generator=g)  # [blocks, block size, KV, hd], as KVPool
    v_pool = torch.randn(64, 16, kv_heads, hd, generator=g)
    q = torch.randn(rows, heads, hd, generator=g) * 2
    idx = torch.randint(0, 64 * 16, (rows * width,), generator=g)
    if window:  # a sliding window's start past the first chunks, and an end before the last keys
        lo = torch.randint(width // 3, width // 2, (rows,), generator=g)
        hi = torch.randint(width // 2 + 1, width + 1, (rows,), generator=g)
        keep = (torch.arange(width)[None] >= lo[:, None]) & (torch.arange(width)[None] < hi[:, None])
    else:
        keep = torch.rand(rows, width, generator=g) < 0.7
        keep[:, 0] = True
    out = cpu_fp32.decode_attention(lib, q, k_pool, v_pool, idx, keep)
    k = k_pool.view(-1, kv_heads, hd)[idx].view(rows, width, kv_heads, hd).transpose(1, 2)
    v = v_pool.view(-1, kv_heads, hd)[idx].view(rows, width, kv_heads, hd).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=keep[:, None, None, :], enable_gqa=True)[:, :, 0]
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5)
    if rows > 1:  # a row that sees no key: zeros, the other rows unchanged
        keep[1] = False
        again = cpu_fp32.decode_attention(lib, q, k_pool, v_pool, idx, keep)
        assert not again[1].any() and torch.equal(again[0], out[0])
    with pytest.raises(ValueError, match="slots"):
        cpu_fp32.decode_attention(lib, q, k_pool, v_pool, idx[:-1], keep)


@pytest.mark.parametrize("rows,width,heads,kv_heads,hd", [(1, 300, 9, 3, 64), (8, 1500, 9, 3, 64), (3, 90, 12, 2, 96),
                                                         (2, 40, 4, 4, 8)])
def test_decode_attention_over_an_fp16_pool_reads_it_as_fp32(lib, rows, width, heads, kv_heads, hd):
    """An fp16 pool (an fp32 engine's on this route, `Engine.kv_dtype`): the same attention as over
    the pool's values widened to fp32, exactly as the fp32 kernel computes it, and within fp16's
    rounding of attention over the unrounded keys."""
    g = torch.Generator().manual_seed(rows + width)
    k32 = torch.randn(64, 16, kv_heads, hd, generator=g) * 3
    v32 = torch.randn(64, 16, kv_heads, hd, generator=g)
    k16, v16 = k32.half(), v32.half()
    q = torch.randn(rows, heads, hd, generator=g)
    idx = torch.randint(0, 64 * 16, (rows * width,), generator=g)
    keep = torch.rand(rows, width, generator=g) < 0.8
    keep[:, 0] = True
    assert cpu_fp32.attention_usable(torch.float16, torch.device("cpu"), heads, kv_heads, hd)
    assert not cpu_fp32.attention_usable(torch.bfloat16, torch.device("cpu"), heads, kv_heads, hd)
    out = cpu_fp32.decode_attention(lib, q, k16, v16, idx, keep)
    assert out.dtype == torch.float32
    assert torch.equal(out, cpu_fp32.decode_attention(lib, q, k16.float(), v16.float(), idx, keep))
    exact = cpu_fp32.decode_attention(lib, q, k32, v32, idx, keep)
    assert (out - exact).abs().max() < 2e-2 and not torch.equal(out, exact)
    with pytest.raises(ValueError, match="fp16"):
        cpu_fp32.decode_attention(lib, q, k16, v32, idx, keep)


def test_place_k_rotates_fp32_chunks_with_the_kernel_into_the_blend(lib, monkeypatch):
    """kvreuse.place_k in fp32: the AVX2 RoPE kernel a layer at a time, written into the blend's
    K, equals the model's own rotation; without the library the torch path lands the same."""
    from types import SimpleNamespace

    from agentmem.engine.layers import Rotary
    from agentmem.kvreuse.fuser import place_k

    model = SimpleNamespace(rotary=Rotary(64, 10000.0, 4096))
    g = torch.Generator().manual_seed(6)
    k = torch.randn(3, 50, 3, 64, generator=g)
    positions = torch.arange(200, 250)
    ref = model.rotary.apply(k, positions)
    monkeypatch.setattr(cpu_bf16, "_lib", None)  # the bf16 library is not the route for fp32
    calls = []
    real = cpu_fp32.rope_into
    monkeypatch.setattr(cpu_fp32, "rope_into", lambda *a: calls.append(1) or real(*a))
    for use in (lib, None):
        monkeypatch.setattr(cpu_fp32, "_lib", use)
        dest = torch.zeros(3, 300, 3, 64)
        got = place_k(model, k, positions, out=dest[:, 200:250])
        assert torch.allclose(dest[:, 200:250], ref, atol=1e-6) and got.data_ptr() == dest[:, 200:250].data_ptr()
        assert not dest[:, :200].any() and not dest[:, 250:].any()
    assert calls == [1, 1, 1]  # one call a layer with the library, none without
    with pytest.raises(ValueError, match="rope_into"):
        cpu_fp32.rope_into(lib, k[0], *model.rotary.cos_sin(positions), torch.zeros(50, 3, 64).bfloat16())


def test_silu_mul_matches_torch(lib):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(9)
    gu = torch.randn(40, 2 * 1540, generator=g) * 6  # rows past 16 (shared by threads), a width not of 8
    gu[0, :8] = torch.tensor([-200.0, -88.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 200.0])  # past exp's range
    gate, up = gu.chunk(2, dim=-1)
    y = cpu_fp32.silu_mul(lib, gu)
    assert y.shape == (40, 1540) and torch.allclose(y, F.silu(gate) * up, rtol=2e-6, atol=1e-6)
    assert torch.isfinite(y).all()
    with pytest.raises(ValueError):
        cpu_fp32.silu_mul(lib, gu.bfloat16())


@pytest.mark.parametrize("lens,bias,kv", [([5, 17, 9], False, torch.float32), ([12], False, torch.float32),
                                         ([3, 30, 8, 1, 22, 14], True, torch.float32),
                                         ([5, 17, 9], False, torch.float16), ([3, 30, 8, 1, 22, 14], True, torch.float16)])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_fused_fp32_decode_layer_over_a_paged_pool_is_bit_identical(lib, monkeypatch, lens, bias, kv, fmt):
    """Decode rows of different lengths, each with its keys scattered over a paged pool: the whole
    layer as one call (`cpu_fp32.layer_q8`: 1 row, 3, and 6 in a 4-row tile and a ragged one, with
    Qwen2's q/k/v biases and an o bias) writes the same K/V into the pool and returns the same
    bits as the separate calls (Proj's kernel, RMSNorm, RoPE, the write, `decode_attention`)."""
    from types import SimpleNamespace

    from agentmem.engine import model as M
    from agentmem.engine.layers import Rotary

    monkeypatch.setattr(cpu_bf16, "_lib", None)  # as on an AVX2-only CPU: the projections take this kernel
    # int4's products take inputs in whole blocks of 64 (down's: the hidden width)
    args = M.ModelArgs(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                       hidden_dim=208 if fmt == "int8" else 192, head_dim=32, qkv_bias=bias, o_bias=bias)
    torch.manual_seed(len(lens))
    block = M.Block(args, 1)
    if bias:
        for lin in (block.q_proj, block.k_proj, block.v_proj, block.o_proj):
            torch.nn.init.normal_(lin.bias)
    block.fuse()
    block.pack(fmt)
    assert block.o_p.q8_route == ("avx2" if fmt == "int8" else "q4")
    g = torch.Generator().manual_seed(len(lens))
    k0, v0, idx, keep, slots = paged_rows(lens, 2, 128, kv, g)
    h, pos = torch.randn(len(lens), 128, generator=g), torch.tensor([n - 1 for n in lens])
    rotary = Rotary(32, 10000.0, 512)
    fused_pool = SimpleNamespace(k=k0.clone(), v=v0.clone())

    def fused_attn(i, q, k_raw, k_rot, v):
        raise AssertionError("the fused layer attends itself")

    fused_attn.decode_pool = (fused_pool, slots, idx, keep)
    calls = []
    real = cpu_fp32.layer_q8
    monkeypatch.setattr(cpu_fp32, "layer_q8", lambda *a: calls.append(1) or real(*a))
    fused = block(h, pos, rotary, fused_attn)
    pool = SimpleNamespace(k=k0.clone(), v=v0.clone())

    def attn(i, q, k_raw, k_rot, v):  # what the runner does: KVPool.write (rounds to the pool's dtype), attention
        pool.k[i].index_copy_(0, slots, k_rot.to(kv))
        pool.v[i].index_copy_(0, slots, v.to(kv))
        return cpu_fp32.decode_attention(lib, q, pool.k[i], pool.v[i], idx, keep)

    assert isinstance(block.kernels, M.fused_decode.Fp32Fused)
    block.set_kernels(fused=False)
    separate = block(h, pos, rotary, attn)
    assert calls == [1] and torch.equal(fused, separate)
    assert torch.equal(fused_pool.k, pool.k) and torch.equal(fused_pool.v, pool.v)
    assert not torch.equal(pool.k, k0)  # the rows' keys were written
    # and the layer is what the dense fp32 weights compute, to int8's precision
    monkeypatch.setattr(cpu_fp32, "_lib", None)
    block.pack("fp32")
    pool = SimpleNamespace(k=k0.clone(), v=v0.clone())
    dense = block(h, pos, rotary, attn)
    # 4-bit groups of dense random weights round each weight by up to a 30th of its group's range
    assert (dense - fused).abs().max() < (0.05 if fmt == "int8" else 0.2) * dense.abs().max()
    assert fused_pool.k.dtype == kv


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_whole_fp32_decode_step_in_one_call_is_bit_identical(lib, monkeypatch, kv, fmt):
    """`Transformer.forward` of decode rows over a paged pool runs every layer in one C call
    (`layers_q8`): the same logits and the same K/V in every layer's pool as the layers one by
    one; a model whose layers the call does not take (a q/k norm, Qwen3's) runs them one by one."""
    from types import SimpleNamespace

    from agentmem.engine import model as M

    monkeypatch.setattr(cpu_bf16, "_lib", None)  # as on an AVX2-only CPU
    args = M.ModelArgs(vocab_size=96, dim=128, n_layers=3, n_heads=4, n_kv_heads=2,
                       hidden_dim=208 if fmt == "int8" else 192, head_dim=32)
    torch.manual_seed(3)
    model = M.Transformer(args)
    for blk in model.layers:
        blk.fuse()
    model.pack(fmt)
    g = torch.Generator().manual_seed(3)
    lens = [7, 20, 11, 3]
    k0, v0, idx, keep, slots = paged_rows(lens, 3, 96, kv, g)
    ids, pos = torch.randint(0, 96, (4,), generator=g), torch.tensor([n - 1 for n in lens])
    calls = []
    real = cpu_fp32.layers_q8
    monkeypatch.setattr(cpu_fp32, "layers_q8", lambda *a: (out := real(*a)) is not None and calls.append(1) or out)

    def run(fused: bool):
        pool = SimpleNamespace(k=k0.clone(), v=v0.clone())

        def attn(i, q, k_raw, k_rot, v):
            pool.k[i].index_copy_(0, slots, k_rot.to(kv))
            pool.v[i].index_copy_(0, slots, v.to(kv))
            return cpu_fp32.decode_attention(lib, q, pool.k[i], pool.v[i], idx, keep)

        attn.decode_pool = (pool, slots, idx, keep)
        model.set_kernels(fused=fused)
        return model(ids, pos, attn), pool

    (one_call, p1), (separate, p2) = run(True), run(False)
    assert calls == [1] and torch.equal(one_call, separate)
    assert torch.equal(p1.k, p2.k) and torch.equal(p1.v, p2.v) and not torch.equal(p1.k, k0)
    model.layers[1].q_norm, model.layers[1].k_norm = M.RMSNorm(32, 1e-5), M.RMSNorm(32, 1e-5)  # not taken
    model.pack(fmt)  # resets the table of pointers
    calls.clear()
    assert model._avx2_layers is None
    run(True)
    assert calls == [] and model._avx2_layers is False


def test_rows_attention_of_fp32_rows_matches_sdpa_on_both_builds(cache):
    """Each build's causal attention of fp32 query rows (prefill chunks, a blend's recomputed rows)
    against torch's SDPA with the causal mask of their positions: one row and one key, ragged row
    blocks (not a multiple of 8, nor of the AVX2 build's 4-row halves), GQA groups of 1-4, head dims
    16-256, rows anywhere among the keys. The AVX-512 build is checked where the CPU has AVX-512."""
    from agentmem.engine.kernels.reference import sdpa

    builds = [cpu_fp32._AVX2_FLAGS] + ([cpu_fp32._AVX2_FLAGS + cpu_fp32.AVX512BW_FLAGS] if cpu_fp32.avx512bw_ok() else [])
    g = torch.Generator().manual_seed(7)
    for flags in builds:
        lib, why = cpu_bf16.build("gemv_avx2", cpu_fp32._SOURCE, flags, cpu_fp32._SIGNATURES, cache)
        assert lib is not None, why
        for nq, t, h, kv, hd in [(1, 1, 9, 3, 64), (7, 20, 9, 3, 64), (33, 100, 4, 4, 16), (50, 300, 8, 2, 128),
                                 (17, 17, 6, 3, 32), (130, 700, 9, 3, 64), (9, 9, 9, 3, 64), (6, 40, 2, 1, 256)]:
            pos = torch.sort(torch.randperm(t, generator=g)[:nq]).values
            q, k, v = (torch.randn(n, m, hd, generator=g) for n, m in ((nq, h), (t, kv), (t, kv)))
            ref = sdpa(q, k, v, torch.arange(t)[None, :] <= pos[:, None])
            out = cpu_fp32.rows_attention(lib, q, k, v, pos)
            assert out is not None and out.shape == ref.shape
            assert (out - ref).abs().max() < 1e-5, (flags, nq, t, h, kv, hd)
        # shapes it does not take: None, not a wrong answer
        assert cpu_fp32.rows_attention(lib, torch.randn(2, 4, 24), torch.randn(4, 2, 24), torch.randn(4, 2, 24),
                                       torch.arange(2, 4)) is None


def test_the_avx2_rows_kernel_leaves_long_histories_to_sdpa(monkeypatch):
    """On the AVX2 build, rows over more than AVX2_ROWS_MAX_KEYS keys go to SDPA (the packed K
    leaves L2 there and the kernel measured slower); the AVX-512 build keeps them; fewer than
    ROWS_MIN rows and AGENTMEM_ATTN_KERNEL=off always go to SDPA."""
    q = torch.randn(cpu_fp32.ROWS_MIN, 9, 64)
    monkeypatch.setattr(cpu_fp32, "_lib", object())
    monkeypatch.setattr(cpu_fp32, "_FLAGS", cpu_fp32._AVX2_FLAGS)
    assert cpu_fp32.rows_kernel(q, torch.randn(cpu_fp32.AVX2_ROWS_MAX_KEYS, 3, 64)) is cpu_fp32._lib
    assert cpu_fp32.rows_kernel(q, torch.randn(cpu_fp32.AVX2_ROWS_MAX_KEYS + 1, 3, 64)) is None
    assert cpu_fp32.rows_kernel(q[:-1], torch.randn(100, 3, 64)) is None
    monkeypatch.setattr(cpu_fp32, "_FLAGS", cpu_fp32._AVX2_FLAGS + cpu_fp32.AVX512BW_FLAGS)
    assert cpu_fp32.rows_kernel(q, torch.randn(cpu_fp32.AVX2_ROWS_MAX_KEYS + 1, 3, 64)) is cpu_fp32._lib
    monkeypatch.setenv("AGENTMEM_ATTN_KERNEL", "off")
    assert cpu_fp32.rows_kernel(q, torch.randn(100, 3, 64)) is None


def test_gemm_f32_matches_torch_and_a_rows_sums_do_not_depend_on_the_others(lib):
    """The fp32-weight product of a few fp32 rows (decode, a blend's probe): torch's within fp32
    rounding, with and without a bias, on strided rows; each row's result bit-identical whether
    it is multiplied alone or among others (ragged 3-row tiles); shapes it does not take: None."""
    g = torch.Generator().manual_seed(3)
    for m, n, k in [(1, 960, 576), (2, 4, 8), (7, 576, 1536), (18, 3072, 576), (48, 64, 40)]:
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        x = torch.randn(m, k + 8, generator=g)[:, 4:4 + k]  # rows k + 8 apart
        for bias in (None, b):
            out = cpu_fp32.gemm_f32(lib, w, x, bias)
            ref = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert out is not None and out.shape == (m, n)
            assert (out.double() - ref).abs().max() < 1e-5 * (k ** 0.5) * 4, (m, n, k)
            for i in (0, m - 1):
                assert torch.equal(cpu_fp32.gemm_f32(lib, w, x[i:i + 1], bias), out[i:i + 1])
    w = torch.randn(10, 16)  # 10 outputs: not a multiple of 4
    assert cpu_fp32.gemm_f32(lib, w, torch.randn(2, 16)) is None
    assert cpu_fp32.gemm_f32(lib, torch.randn(8, 12), torch.randn(2, 12)) is None  # 12 inputs: not of 8
    assert cpu_fp32.gemm_f32(lib, torch.randn(8, 16), torch.randn(2, 16, dtype=torch.float64)) is None


def test_fp32_projections_take_gemm_f32_for_few_rows_only(lib, monkeypatch):
    """Proj with fp32 weights on the AVX2 build: up to F32_MAX_ROWS fp32 rows on the kernel, more
    on torch's sgemm, both within fp32 rounding of each other; an AVX-512 build keeps sgemm."""
    calls = []
    real = cpu_fp32.gemm_f32
    monkeypatch.setattr(cpu_fp32, "gemm_f32", lambda *a: calls.append(a[2].shape[0]) or real(*a))
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(64, 576, generator=g), torch.randn(64, generator=g)
    p = make_proj(w, b, "fp32")
    few, many = torch.randn(cpu_fp32.F32_MAX_ROWS, 576, generator=g), torch.randn(cpu_fp32.F32_MAX_ROWS + 1, 576, generator=g)
    out_few, out_many = p(few), p(many)
    assert calls == ([cpu_fp32.F32_MAX_ROWS] if cpu_fp32.rows_build() == "avx2" else [])
    assert torch.allclose(out_few, torch.nn.functional.linear(few, w, b), atol=1e-4)
    assert torch.allclose(out_many, torch.nn.functional.linear(many, w, b), atol=1e-4)
    calls.clear()
    monkeypatch.setattr(cpu_fp32, "_FLAGS", cpu_fp32._AVX2_FLAGS + cpu_fp32.AVX512BW_FLAGS)  # an AVX-512 build: MKL
    assert torch.allclose(p(few), out_few, atol=1e-4) and calls == []


def test_the_avx2_rows_kernel_adds_each_keys_share_as_the_probe_computes_it(lib, cache):
    """With `share`, the AVX2 build adds what each key gives the rows' outputs (attention times
    the value's norm, over rows and heads) to it: the blend probe's torch computation
    (`fuser._attend_and_share`) within fp32 rounding, outputs unchanged; a wrong share is a clear
    error; the AVX-512 build declines (None, share untouched) and the probe keeps torch's."""
    from agentmem.kvreuse import fuser

    g = torch.Generator().manual_seed(11)
    for nq, t, h, kv, hd in [(18, 700, 9, 3, 64), (8, 30, 4, 2, 32), (13, 200, 6, 3, 64)]:
        pos = torch.sort(torch.randperm(t, generator=g)[:nq]).values
        q, k, v = (torch.randn(n, m, hd, generator=g) for n, m in ((nq, h), (t, kv), (t, kv)))
        ref_out, ref_share = fuser._attend_and_share(q, k, v, fuser.causal_bias(pos, t, h // kv))
        share = torch.full((t,), 0.5)
        out = cpu_fp32.rows_attention(lib, q, k, v, pos, share=share) if cpu_fp32.rows_build() == "avx2" else None
        if out is None:
            pytest.skip("the loaded library is the AVX-512 build: no share there")
        assert torch.equal(out, cpu_fp32.rows_attention(lib, q, k, v, pos))
        assert (out - ref_out).abs().max() < 1e-5
        assert (share - 0.5 - ref_share).abs().max() < 1e-5 * max(1.0, ref_share.abs().max().item())
    with pytest.raises(ValueError, match="share"):
        cpu_fp32.rows_attention(lib, q, k, v, pos, share=torch.zeros(t + 1))
    if cpu_fp32.avx512bw_ok():
        wide, why = cpu_bf16.build("gemv_avx2", cpu_fp32._SOURCE, cpu_fp32._AVX2_FLAGS + cpu_fp32.AVX512BW_FLAGS,
                                   cpu_fp32._SIGNATURES, cache)
        assert wide is not None, why
        share = torch.zeros(t)
        assert cpu_fp32.rows_attention(wide, q, k, v, pos, share=share) is None and not share.any()
