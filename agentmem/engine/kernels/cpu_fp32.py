"""The CPU kernels for fp32 rows (AVX2, FMA and F16C: the engine runs fp32 where the CPU has no
AVX512-BF16): the library's loader, its ctypes signatures and a Python call for each kernel. The
C is csrc/fp32/; docs/kernels.md describes each kernel.

Its first kernel is an int8-weight product: decode's weights read at a quarter of fp32's bytes.
On an AVX2-only CPU the engine runs fp32 (bf16 products there are 8x slower), and a decode
step reads every fp32 weight once: 540 MB per token of SmolLM2-135M, so one stream is bound
by memory bandwidth. torch's own int8 product (`_weight_int8pack_mm`) reads a quarter of
that but runs no faster than fp32 on few rows here. This kernel takes the int8 weights in
`cpu_bf16.pack`'s layout ([N/16, K/2, 16, 2]: 32 bytes hold the input pair (k, k+1) for 16
outputs), quantizes each fp32 input row to int16 with its own scale (|x| <= 8191, as the
AVX-512 `i16` route does), sign-extends the weights to int16 in registers (`vpmovsxbw`) and
multiplies pairs into int32 sums with `vpmaddwd`, which matches the layout: a 32-bit lane
holds one output's input pair. Each 16-output group runs its input rows 4 at a time (8 int32
accumulators, 2 weight vectors and the broadcast pair fit AVX2's 16 registers); each chunk
of I16_CHUNK inputs goes to fp32 before the next, so no int32 sum can overflow.

4-bit weights (`AGENTMEM_WEIGHTS=int4`, `cpu_bf16.pack_q4`'s Q4_1 groups) have their own product
here (`gemv_q4`, and the same `q4` flag through the fused layer calls): the rows quantized to int8
per 64 inputs and multiplied with `vpmaddubsw` (see `tile_q4` in csrc/fp32/gemv_q4.c).

Where the CPU has AVX-512 but no AVX512-BF16 (the engine runs fp32 there too), the same source is
built with 512-bit tiles (`choose_tile`, `wide_tile`): `vnni512` on AVX512-VNNI (Cascade Lake, Ice
Lake), `avx512bw` on AVX-512 without VNNI (Skylake-SP): 16 outputs and 8 rows a tile, the same
integer sums and fp32 arithmetic, so the same bits as the AVX2 tiles.

Its C is csrc/fp32.c and the kernel files it includes (csrc/fp32/), built once by the system's C
compiler into the cache dir and loaded with ctypes (build.py's `load_once`), as the AVX-512
library is; without AVX2/FMA or a compiler, `load` returns None, says why, and int8 stays with
torch's product.

The same library holds fp32 RMSNorm, RoPE, SiLU x up, the paged decode attention (over an
fp32 or an fp16 pool: `Engine.kv_dtype`), the causal attention of fp32 query rows (prefill chunks,
a blend's rows and its probe's key shares: `rows_attention`), a few fp32 rows on fp32 weights
(`gemm_f32`), and a decoder layer of decode rows as one call
(`layer_q8`) and every layer of a decode step as one call (`layers_q8`), built from the same
functions so that they give the separate calls' bits. The Python side of the ops both libraries
hold is `cpu_bf16`'s, given this library's C functions and fp32.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path

import torch

from ...config import engine_switch
from ..measured import cpu_flags, remembered, simd_flags
from . import cpu_bf16
from .build import AVX2_FLAGS as _AVX2_FLAGS
from .build import AVX512BW_FLAGS, FP32_SOURCE, VNNI512_FLAGS, build, kernel_cache, load_once, source_tag

_SOURCE = FP32_SOURCE  # the library's translation unit; its variants' flags are build.py's


def vnni512_ok() -> bool:
    """Whether the CPU can run the products' AVX512-VNNI tile."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags()


def avx512bw_ok() -> bool:
    """Whether the CPU can run the products' AVX-512 tile without VNNI (`avx512bw`)."""
    return {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags()


def wide_tile() -> tuple[str, list[str]] | None:
    """The AVX-512 tile this CPU can run and its extra build flags: `vnni512` where it has
    AVX512-VNNI, else `avx512bw` where it has AVX-512 (F, BW, VL; Skylake-SP), else None."""
    if vnni512_ok():
        return "vnni512", VNNI512_FLAGS
    if avx512bw_ok():
        return "avx512bw", AVX512BW_FLAGS
    return None


_FLAGS = _AVX2_FLAGS  # the loaded library's flags: `load` adds `wide_tile`'s where `choose_tile` takes it
_P, _I, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "agentmem_avx2_gemv_q8": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32],
    "agentmem_avx2_gemv_q4": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32],
    "agentmem_avx2_gemm_f32": [_P, _I, _P, _P, _P, _I, _I, _I, _I32],
    "agentmem_avx2_rms_norm_f32": [_P, _I, _P, _P, _I, _I, ctypes.c_float],
    "agentmem_avx2_rope_f32": [_P, _I, _P, _P, _P, _I, _I, _I],
    "agentmem_avx2_decode_attn_f32": [_P] * 6 + [_I] * 5 + [ctypes.c_float, _I32],
    "agentmem_avx2_decode_attn_f16kv": [_P] * 6 + [_I] * 5 + [ctypes.c_float, _I32],
    "agentmem_avx2_silu_mul_f32": [_P, _I, _P, _I, _I],
    "agentmem_avx2_rows_attn_f32": ([_P] * 5 + [_I] * 5 + [ctypes.c_float, _I32, _P], ctypes.c_int),
    "agentmem_avx2_layers_q8": [_P, _P, _I, _P, ctypes.c_float, _P, _P, _P, _P, _I, _I32, _P, _P, _P, _I,
                                ctypes.c_float] + [_I] * 6 + [_I32, _I32],
    "agentmem_avx2_layer_q8": [_P, _P, _P, _P, ctypes.c_float] + [_P] * 7 + [_I32] + [_P] * 3 + [_I, ctypes.c_float]
                              + [_P] * 7
                              + [_I] * 6 + [_I32, _I32],
}
MAX_ROWS = cpu_bf16.MAX_ROWS  # rows up to which RMSNorm takes the kernel (decode batches)
# Rows up to which Proj's int8 product takes the kernel: past decode's 16, a blend probe's
# question rows and a short prompt's too. On the Zen 3 VM (2026-11-26, 2 threads) the kernel
# against the fp32 copy's torch.mm at 16 / 24 / 32 / 48 / 64 rows: gate_up (3072 x 576) 0.49 /
# 0.61 / 0.82 / 1.28 / 1.63 ms against 0.78 / 0.90 / 1.16 / 1.54 / 2.04; down (576 x 1536) 0.21 /
# 0.32 / 0.42 / 0.63 / 0.92 against 0.28 / 0.39 / 0.48 / 0.70 / 0.79; qkv (960 x 576) even at 64.
# With the AVX512-VNNI tile the kernel wins at every row count (a 2-core Xeon VM, Cascade Lake:
# avx512_vnni, no avx512_bf16, 2026-11-28): alone, kernel / torch.mm in ms, best of 20, gate_up
# at 64 / 128 / 256 / 512 rows 1.25 / 2.17 / 4.35 / 8.88 against 2.53 / 3.13 / 5.98 / 7.53, down
# 0.67 / 0.70 / 1.79 / 4.71 against 1.08 / 1.14 / 2.41 / 5.56, qkv 0.32 / 0.67 / 1.32 / 2.88
# against 0.55 / 0.81 / 1.57 / 3.45; inside the forward, where the fp32 copy streams four times
# the int8 bytes, time to first token (alternated, min of 3) 0.55-0.59 -> 0.43 s at 350 tokens,
# 0.77-0.93 -> 0.62-0.64 at 500, 1.52-1.89 -> 1.29-1.75 at 1,000, and a 2,048-token prefill
# 4.87-5.40 -> 4.03-4.72 s. So there every row takes it and no fp32 copy is made (int8 is then a
# memory format too).
PRODUCT_MAX_ROWS = 48
# fp32 rows up to which fp32 weights take `gemm_f32` (more: MKL's sgemm). Zen 3 VM, 2026-11-29, ms,
# MKL on the transposed weight / the kernel, hot: 18 rows 0.26 / 0.14 (960 x 576), 0.92 / 0.37
# (3,072 x 576), 0.38 / 0.20 (576 x 1,536); 48 rows 1.49 / 0.97 (3,072 x 576).
F32_MAX_ROWS = 48
Q4_MAX_ROWS = 48  # fp32 rows up to which 4-bit weights take `gemv_q4` (more: an fp32 copy, exact as prefill is)
VNNI512_PRODUCT_MAX_ROWS = 1 << 62  # `load` sets PRODUCT_MAX_ROWS to this with the VNNI tile
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
why_not: str | None = None  # why the kernel is not in use, once `load` has been tried


def cpu_ok() -> bool:
    """AVX2, FMA and F16C (which every AVX2 CPU has: the fp16 pool's loads and stores). The engine
    loads this library only for fp32 rows (`Engine.load`: on a CPU with AVX512-BF16 it runs bf16
    and `cpu_bf16`'s kernels), but it builds and runs on any."""
    return {"avx2", "fma", "f16c"} <= cpu_flags()


def load(cache_dir: Path | str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel (built into `<cache_dir>/kernels` the first time), or None. Its
    products' tile is `choose_tile`'s."""
    global _FLAGS, PRODUCT_MAX_ROWS
    with _lock:
        if not _tried and cpu_ok() and engine_switch("GEMV") != "off" and choose_tile(cache_dir):
            name, flags = wide_tile()
            _FLAGS = _AVX2_FLAGS + flags
            if name == "vnni512":
                PRODUCT_MAX_ROWS = VNNI512_PRODUCT_MAX_ROWS
    return load_once(sys.modules[__name__], "gemv_avx2", cpu_ok, "AVX2/FMA/F16C", cache_dir)


def choose_tile(cache_dir: Path | str | None) -> bool:
    """Whether the products take the AVX-512 tile (`wide_tile`: AVX512-VNNI's, or plain AVX-512's
    where the CPU has no VNNI): AGENTMEM_GEMV_VNNI512 = auto (the default: on a CPU that has
    AVX-512, both builds' products timed in turns over cold weights, one row and eight together,
    once per machine and remembered under `cache_dir`) | on | off. The two give the same bits, so
    this is a choice of speed alone. On the Cascade Lake VM (2026-11-28) the VNNI tile took eight
    rows' products from 16.2 to 8.7-10.9 ms and one row's from 7.4-7.8 to 7.2-7.6."""
    mode = engine_switch("GEMV_VNNI512")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"AGENTMEM_GEMV_VNNI512 must be auto, on or off, got {mode!r}")
    wide = wide_tile()
    if mode == "off" or wide is None:
        return False
    if mode == "on":
        return True
    cache_dir = kernel_cache(cache_dir)
    key = f"avx2-tile|{source_tag('t', _SOURCE, _AVX2_FLAGS + wide[1])}|{torch.get_num_threads()}|{simd_flags()}"

    def measure() -> dict:
        libs = {}
        for name, flags in (("avx2", _AVX2_FLAGS), (wide[0], _AVX2_FLAGS + wide[1])):
            libs[name], why = build("gemv_avx2", _SOURCE, flags, _SIGNATURES, cache_dir)  # load's file
            if libs[name] is None:
                return {"tile": "avx2", "why": why}
        times = cpu_bf16.cold_int8_seconds({t: (cpu_bf16.pack, lambda p, scale, x, lib=lib: gemv_q8(lib, p, scale, x))
                                            for t, lib in libs.items()}, torch.float32)
        us = {t: round(v * 1e6, 1) for t, v in times.items()}
        return {"tile": min(us, key=us.get), "us": us}

    return remembered(cache_dir, "avx2-tile-choice.json", key, measure)["tile"] == wide[0]


def loaded() -> ctypes.CDLL | None:
    return _lib


def tag() -> str:
    """The kernel's identity, for keys of measurements of it."""
    return source_tag("gemv-avx2", _SOURCE, _FLAGS)


def gemv_q8(lib: ctypes.CDLL, qp: torch.Tensor, scale: torch.Tensor, x: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] (fp32) @ (q * scale[:, None]).T (+ bias) -> [M, out] fp32, for `qp` =
    cpu_bf16.pack(q) of int8 weights q [out, in] and fp32 scale [out]."""
    n, k = qp.shape[0] * 16, qp.shape[1] * 2
    if x.dim() != 2 or x.shape[-1] != k or x.dtype != torch.float32 or qp.dtype != torch.int8:
        raise ValueError(f"gemv_q8: x must be fp32 [M, {k}] and the weight int8, got {x.dtype} {tuple(x.shape)}")
    return cpu_bf16.run_product(lib.agentmem_avx2_gemv_q8, qp, scale, x, bias, n, torch.float32, out_flag=False)


def gemv_q4(lib: ctypes.CDLL, wp: torch.Tensor, dm: torch.Tensor, x: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] (fp32) @ w.T (+ bias) -> [M, out] fp32, for w held as `cpu_bf16.pack_q4(w)`
    (`agentmem_avx2_gemv_q4`: the rows quantized to int8 per 64 inputs, `vpmaddubsw`)."""
    n, k = wp.shape[0] * 16, wp.shape[1] * 8
    if x.dim() != 2 or x.shape[-1] != k or x.dtype != torch.float32 or wp.dtype != torch.uint8 or k % 64:
        raise ValueError(f"gemv_q4: x must be fp32 [M, {k}] and the weight packed by pack_q4, got {x.dtype} "
                         f"{tuple(x.shape)}")
    return cpu_bf16.run_product(lib.agentmem_avx2_gemv_q4, wp, dm, x, bias, n, torch.float32, out_flag=False)


def gemm_f32(lib: ctypes.CDLL, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
             ) -> torch.Tensor | None:
    """x [M, in] (fp32) @ w.T (+ bias) for an fp32 weight w [out, in] as it is
    (`agentmem_avx2_gemm_f32`): [M, out] fp32, or None where the shapes are not its (out a
    multiple of 4, in of 8, contiguous weight and rows)."""
    n, k = w.shape
    if (x.dtype != torch.float32 or w.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or n % 4 or k % 8
            or not w.is_contiguous() or x.stride(1) != 1 or (bias is not None and bias.dtype != torch.float32)):
        return None
    y = torch.empty(x.shape[0], n)
    b = bias.contiguous() if bias is not None else None
    lib.agentmem_avx2_gemm_f32(x.data_ptr(), x.stride(0), w.data_ptr(), y.data_ptr(), b.data_ptr() if b is not None else None,
                               x.shape[0], n, k, torch.get_num_threads())
    return y


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 rows x [M, D] by an fp32 weight [D] (what F.rms_norm computes, in one call)."""
    return cpu_bf16.norm_rows(lib.agentmem_avx2_rms_norm_f32, torch.float32, x, weight, eps)


def rope_usable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rope` takes x [N, heads, hd] (fp32 on the CPU, each head's dims contiguous and
    heads adjacent, hd a multiple of 16) with fp32 tables [N, hd]."""
    return cpu_bf16.rope_takes(x, cos, torch.float32, 16)


def rope(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd] rotated by its positions' tables, as `layers.rotate` computes it, into a
    new contiguous tensor (`rope_usable` must hold)."""
    return cpu_bf16.rotate_rows(lib.agentmem_avx2_rope_f32, torch.float32, x, cos, sin)


def rope_into(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """`rope` of x [N, heads, hd] written into `out` (a contiguous fp32 tensor of x's shape, e.g. a
    slice of the blend's K of one layer) instead of a new tensor (`rope_usable` must hold)."""
    if not (rope_usable(x, cos) and out.dtype == torch.float32 and out.shape == x.shape and out.is_contiguous()):
        raise ValueError(f"rope_into: x {x.dtype} {tuple(x.shape)}, out {out.dtype} {tuple(out.shape)}")
    cpu_bf16.rotate_rows(lib.agentmem_avx2_rope_f32, torch.float32, x, cos, sin, out=out)


KV_DTYPES = (torch.float32, torch.float16)  # the pools `decode_attention` and `layer_q8` read (fp32 queries)


def attention_usable(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `decode_attention` takes such a pool (`dtype`: fp32 or fp16) with fp32 queries: on
    the CPU, head_dim a multiple of 8 up to 256 (any number of query heads per KV head)."""
    return dtype in KV_DTYPES and cpu_bf16.attention_takes(torch.float32, device, heads, kv_heads, head_dim,
                                                           torch.float32, 8, None)


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     idx: torch.Tensor, keep: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """`cpu_bf16.decode_attention` for fp32 queries: one decode query per row over its keys in
    the paged pool (q [B, H, hd]; pools [..., KV, hd], contiguous, fp32 or fp16; idx [B * W] flat
    slots; keep [B, W] which of them the row sees). Returns [B, H, hd] fp32."""
    if q.dtype != torch.float32 or k_pool.dtype != v_pool.dtype or k_pool.dtype not in KV_DTYPES:
        raise ValueError(f"decode_attention: fp32 queries over an fp32 or fp16 pool, got {q.dtype} over "
                         f"{k_pool.dtype}/{v_pool.dtype}")
    fn = lib.agentmem_avx2_decode_attn_f16kv if k_pool.dtype == torch.float16 else lib.agentmem_avx2_decode_attn_f32
    return cpu_bf16.attend_pool(fn, q, k_pool, v_pool, idx, keep, scale)


ROWS_MIN = 8  # fewer rows go to SDPA: the kernel computes 8 rows a task whatever their number
# Keys past which the AVX2 build's rows go to SDPA: a head's packed K (256 bytes a key at hd 64)
# leaves L2. Zen 3 VM, 2026-11-29, 512 rows after 7,680 keys: 142.2 ms a layer against SDPA's
# 123.6; after 3,584: 53.7 against 66.9 (prefill chunks and a blend's rows alike).
AVX2_ROWS_MAX_KEYS = 4096


def rows_kernel(q: torch.Tensor, k: torch.Tensor) -> ctypes.CDLL | None:
    """The loaded library where `rows_attention` takes these rows: fp32 CPU tensors, a head dim it
    takes (either build: AVX-512's 16 keys a vector, AVX2's 8), and on the AVX2 build at most
    AVX2_ROWS_MAX_KEYS keys. AGENTMEM_ATTN_KERNEL=off leaves them to torch's SDPA, as it does bf16
    rows."""
    if (q.dtype != torch.float32 or q.device.type != "cpu" or q.dim() != 3 or k.dim() != 3 or q.shape[0] < ROWS_MIN
            or q.shape[2] % 16 or q.shape[2] > 256 or engine_switch("ATTN_KERNEL") == "off"
            or (rows_build() == "avx2" and k.shape[0] > AVX2_ROWS_MAX_KEYS)):
        return None
    return loaded()


def f32_kernel() -> ctypes.CDLL | None:
    """The loaded library where few fp32 rows on fp32 weights take `gemm_f32`: the AVX2 build, on
    the AVX2-only CPUs it was measured on (Zen 3, 2026-11-29); an AVX-512 CPU keeps MKL's 512-bit sgemm,
    not measured against it."""
    return loaded() if rows_build() == "avx2" else None


def rows_build() -> str:
    """Which build's rows kernel the loaded library holds: `avx512` or `avx2`."""
    return "avx512" if "-DAGENTMEM_AVX512" in _FLAGS else "avx2"


def rows_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_pos: torch.Tensor, scale: float | None = None, share: torch.Tensor | None = None
                   ) -> torch.Tensor | None:
    """Causal attention of fp32 query rows q [Nq, H, hd] at ascending positions `q_pos` over k/v
    [T, KV, hd] at 0..T-1 (`agentmem_avx2_rows_attn_f32`): [Nq, H, hd] fp32, or None where the
    shapes are not its (the caller runs SDPA). With `share` (fp32 [T], contiguous; the AVX2 build
    only), what each key adds to the rows' outputs, the attention paid to it times its value's
    norm summed over rows and heads, is added into it, as the blend's probe computes it
    (`fuser._attend_and_share`); where the build has none: None and `share` untouched."""
    nq, h, hd = q.shape
    t, kv = k.shape[0], k.shape[1]
    if (q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32
            or k.shape != v.shape or k.shape[2] != hd or h % kv or hd % 16 or hd > 256 or q_pos.shape != (nq,)):
        return None
    if share is not None and (share.dtype != torch.float32 or share.shape != (t,) or not share.is_contiguous()):
        raise ValueError(f"share must be a contiguous fp32 [{t}] tensor, got {share.dtype} {tuple(share.shape)}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    pos = q_pos.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    done = lib.agentmem_avx2_rows_attn_f32(q.data_ptr(), pos.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                           nq, h, kv, hd, t, hd ** -0.5 if scale is None else scale,
                                           torch.get_num_threads(), share.data_ptr() if share is not None else None)
    return out if done else None


def silu_mul(lib: ctypes.CDLL, gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u of fp32 rows gu [N, 2I] (g = gu[:, :I], u = gu[:, I:]; each row contiguous) in
    one call: [N, I] fp32, the bits the fused layer computes (SiLU's exponential within ~1e-7 of
    torch's)."""
    return cpu_bf16.silu_rows(lib.agentmem_avx2_silu_mul_f32, torch.float32, gu)


def _on_kernel(*projs) -> bool:
    """Whether every `Proj` is on one of this library's product routes (its GEMV layout built):
    int8 (`avx2`) or 4-bit (`q4` with fp32 rows: `gemv_q4`)."""
    routes = {p.q8_route if p is not None and p.fmt in ("int8", "int4") else None for p in projs}
    return len(routes) == 1 and routes <= {"avx2", "q4"} and all(p.w_gemv is not None for p in projs)



def _fp32_or_none(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous())


def _block_takes(block) -> bool:
    """The parts of `layer_q8`'s conditions that depend on the block alone (its weights' formats,
    biases and options): what `layers_q8` checks once per model."""
    a = block.args
    projs = (block.qkv_p, block.o_p, block.gate_up_p, block.down_p)
    return (_on_kernel(*projs) and block.gate_up_p.bias is None and block.down_p.bias is None
            and _fp32_or_none(block.qkv_p.bias) and _fp32_or_none(block.o_p.bias) and block.q_norm is None
            and block.input_norm.eps == block.post_norm.eps
            and block.input_norm.weight.dtype == block.post_norm.weight.dtype == torch.float32
            and block.input_norm.weight.is_contiguous() and block.post_norm.weight.is_contiguous()
            and a.sliding_window is None and a.head_dim % 16 == 0 and a.head_dim <= cpu_bf16.MAX_HEAD_DIM
            and a.n_heads % a.n_kv_heads == 0)


def _step_takes(h: torch.Tensor, hd: int, *pool_and_tables: torch.Tensor) -> bool:
    """The parts that depend on the step (`cpu_bf16.decode_step_takes`): fp32 decode rows, an fp32
    or fp16 pool, their tables and the key slots."""
    return cpu_bf16.decode_step_takes(h, torch.float32, MAX_ROWS, KV_DTYPES, hd, *pool_and_tables)


def _layer_ptrs(block) -> list[int | None]:
    """A block's weights in `agentmem_avx2_layer_q8`'s order (LAYER_PTRS of them)."""
    def ptr(t):
        return None if t is None else t.data_ptr()

    q, o, gu, d = block.qkv_p, block.o_p, block.gate_up_p, block.down_p
    return [ptr(block.input_norm.weight), ptr(block.post_norm.weight), ptr(q.w_gemv), ptr(q.scale), ptr(q.bias),
            ptr(o.w_gemv), ptr(o.scale), ptr(o.bias), ptr(gu.w_gemv), ptr(gu.scale), ptr(d.w_gemv), ptr(d.scale)]


def layers_q8(lib: ctypes.CDLL, model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool,
              slots: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
    """Every decoder layer of a decode step (`Transformer.forward`'s loop) in one C call
    (`agentmem_avx2_layers_q8`: `layer_q8` a layer, no Python between them): fp32 rows h [M, D]
    in, the last layer's out; pool: the runner's KVPool (k/v [L, slots, KV, hd]). The table of
    the layers' weight pointers is built once a model (`model._avx2_layers`, reset by `pack`);
    None where a layer or the step is not taken (the caller runs the layers one by one)."""
    table = cpu_bf16.layer_table(model, "_avx2_layers", _block_takes, _layer_ptrs)
    a = model.args
    if table is False or not _step_takes(h, a.head_dim, cos, pool.k, pool.v, slots, idx, keep):
        return None
    m = h.shape[0]
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty_like(h)
    lib.agentmem_avx2_layers_q8(
        h.data_ptr(), out.data_ptr(), a.n_layers, table, model.layers[0].input_norm.eps, cos.data_ptr(),
        sin.data_ptr(), pool.k.data_ptr(), pool.v.data_ptr(), pool.k[0].numel(), int(pool.k.dtype == torch.float16),
        slots.contiguous().data_ptr(), idx.data_ptr(), keep.data_ptr(), keep.numel() // m, a.head_dim ** -0.5, m,
        h.shape[1], a.n_heads, a.n_kv_heads, a.head_dim, model.layers[0].down_p.in_features,
        cpu_bf16.q4_flag(model.layers[0].down_p),
        torch.get_num_threads())
    return out


def layer_q8(lib: ctypes.CDLL, block, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor,
             keep: torch.Tensor) -> torch.Tensor | None:
    """A whole decoder layer (`Block.forward`) for fp32 decode rows h [M, D] in one call
    (`agentmem_avx2_layer_q8`): norm, qkv (+ its bias), RoPE, the rows' K/V written to this layer's
    paged pool (k_pool/v_pool [..., KV, hd], fp32 or fp16) at `slots` [M], the decode attention over each
    row's keys (idx [M * W] flat slots, keep [M, W] uint8, as `decode_attention`), then
    `Block.finish`. The separate calls' arithmetic, except SiLU's exponential (this library's
    polynomial, within ~1e-7 of torch's). None where it does not take these (the caller runs the
    separate calls)."""
    a = block.args
    m = h.shape[0] if h.dim() == 2 else 0
    w = keep.numel() // max(m, 1)
    if not (_step_takes(h, a.head_dim, cos, k_pool, v_pool, slots, idx, keep) and _block_takes(block)):
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = slots.contiguous()
    out = torch.empty_like(h)
    bq, bo = block.qkv_p.bias, block.o_p.bias
    lib.agentmem_avx2_layer_q8(
        h.data_ptr(), out.data_ptr(), block.input_norm.weight.data_ptr(), block.post_norm.weight.data_ptr(),
        block.input_norm.eps, block.qkv_p.w_gemv.data_ptr(), block.qkv_p.scale.data_ptr(),
        None if bq is None else bq.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
        int(k_pool.dtype == torch.float16), slots.data_ptr(), idx.data_ptr(), keep.data_ptr(), w, a.head_dim ** -0.5, block.o_p.w_gemv.data_ptr(),
        block.o_p.scale.data_ptr(), None if bo is None else bo.data_ptr(), block.gate_up_p.w_gemv.data_ptr(),
        block.gate_up_p.scale.data_ptr(), block.down_p.w_gemv.data_ptr(), block.down_p.scale.data_ptr(), m,
        h.shape[1], a.n_heads, a.n_kv_heads, a.head_dim, block.down_p.in_features, cpu_bf16.q4_flag(block.down_p),
        torch.get_num_threads())
    return out
