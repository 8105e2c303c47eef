"""The CPU kernels for bf16 rows (AVX512-BF16): the library's loader, its ctypes signatures,
a Python call for each kernel, and the per-machine choices between them.

It holds (the C in csrc/bf16/; docs/kernels.md describes each kernel):
- few-row products of bf16, int8 and 4-bit weights in their packed layouts (`gemv`,
  `gemv_int8`, `gemv_q4`; `pack`, `pack_u8`, `pack_q4`), and how int8 weights multiply here
  (`choose_q8`);
- RMSNorm, RoPE, SiLU x up and kvreuse's drift correction of bf16 rows;
- the decode attention over the paged pool (`decode_attention`, in place of gathering the keys
  for SDPA) and the causal attention of query rows on vdpbf16ps or AMX tiles (`rows_attention`,
  `rows_attention_amx`, `rows_route`);
- the fused decode layer (`qkv_q8u8`, `finish_q8u8`, `layer_q8u8`, `layers_q8u8`);
- the calls both libraries share, given a library's C function and its rows' dtype
  (`run_product`, `norm_rows`, `rotate_rows`, `attend_pool`, `silu_rows`, `decode_step_takes`),
  which cpu_fp32 uses too.

Why a product of its own: a decode step multiplies one row (one per stream) by every weight of
the model, so it is bound by the bytes of weights read. oneDNN's packed bf16 product, the
engine's default for many rows, reads them well below the machine's bandwidth over a whole
SmolLM2-135M token
(121 products of 0.6-3.5 MB and the 56 MB LM head): each product is short and pays a fixed
set-up cost. This kernel reads its own layout, packed once at load (`pack`): the weight
[N, K] as [N/16, K/2, 16, 2], so that one 64-byte load holds an input pair (k, k+1) for 16
outputs and `vdpbf16ps` (bf16 pairs multiplied and summed into fp32) adds it into 16 fp32
sums against the input pair broadcast: no horizontal sums, and each thread streams whole
contiguous 32-output blocks (36 KB at K = 576), which the hardware prefetcher follows (a
software prefetch measured no better). Each block runs every input row while it is in
cache, up to 8 at a time (16 accumulators), so 8 rows cost little more than one.

Measured over a whole token of SmolLM2-135M's products (cold weights, 2 threads, the AMD EPYC
VM with AVX-512 + avx512_bf16, best of 7; /tmp dev scripts): in one run, packed 1 row 12.7 ms
against 17.5 for the earlier kernel over the plain row-major weight and 18.8 for oneDNN, 8 rows
16.4 against 22.3 and 21.7 (a noisy neighbour then; in a quiet run packed 1 row 9.6 ms, 28 GB/s);
8 rows at a time rather than 4, in another run: 8 rows 11.7 against 12.7 ms, 16 rows 16.9
against 17.8. So it takes every decode batch the compiled buckets have (up to MAX_ROWS);
prefill chunks stay with oneDNN.

Its C is csrc/bf16.c and the kernel files it includes (csrc/bf16/), compiled once by the
system's C compiler into the cache dir and loaded with ctypes (build.py; `Engine.load` does it,
`loaded` is what Proj uses); without a compiler, AVX512-BF16, or where the build fails, `load`
returns None, says why once, and the engine keeps oneDNN.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from ...config import engine_switch
from ..measured import best_seconds_each, cpu_flags, remembered, simd_flags
from .build import BF16_FLAGS, BF16_SOURCE, load_once, source_tag
from .build import build as build  # re-exported for callers that build a library variant through this module

MAX_ROWS = 16  # input rows up to which Proj uses the kernel (the largest decode bucket)
BLOCK = 32  # outputs per block: a weight's out_features must be a multiple

_SOURCE, _FLAGS = BF16_SOURCE, BF16_FLAGS  # the library's translation unit and flags (build.py)
_P, _I, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {  # the library's functions and their arguments
    "agentmem_gemv": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32, _I32],
    "agentmem_gemv_q8i16": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32, _I32],
    "agentmem_gemv_q8u8": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32, _I32],
    "agentmem_rms_norm_bf16": [_P, _I, _P, _P, _I, _I, ctypes.c_float],
    "agentmem_rope_bf16": [_P, _I, _P, _P, _P, _I, _I, _I],
    "agentmem_decode_attn_bf16": [_P] * 6 + [_I] * 5 + [ctypes.c_float, _I32],
    "agentmem_rows_attn_bf16": [_P] * 5 + [_I] * 5 + [ctypes.c_float, _I32, _P, _I32],
    "agentmem_rows_attn_amx": [_P] * 5 + [_I] * 5 + [ctypes.c_float, _I32, _P],
    "agentmem_amx_ok": ([], _I32),
    "agentmem_drift_bf16": [_P, _P, _P, _I, _P, _P, _P, _P, _I, _I],
    "agentmem_silu_mul_bf16": [_P, _I, _P, _I, _I],
    "agentmem_gemv_q4u8": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32, _I32],
    "agentmem_qkv_q8u8": [_P, _P, ctypes.c_float, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I32, _I32],
    "agentmem_layer_q8u8": [_P, _P, _P, _P, ctypes.c_float, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I,
                            ctypes.c_float, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I32, _I32],
    "agentmem_finish_q8u8": [_P, _I, _P, _P, _P, _P, _P, ctypes.c_float, _P, _P, _P, _P, _I, _I, _I, _I, _I32,
                             _I32],
    "agentmem_layers_q8u8": [_P, _P, _I, _P, ctypes.c_float, _P, _P, _P, _P, _I, _P, _P, _P, _I, ctypes.c_float]
                            + [_I] * 6 + [_I32, _I32],
}
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
why_not: str | None = None  # why the kernel is not in use, once `load` has been tried


def _cpu_ok() -> bool:
    return "avx512_bf16" in cpu_flags()


def load(cache_dir: Path | str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel (built into `<cache_dir>/kernels` the first time), or None."""
    return load_once(sys.modules[__name__], "gemv_bf16", _cpu_ok, "AVX512-BF16", cache_dir)


COLD_COPIES = 48  # 85 MB of int8 weights: more than a last-level cache, as a decode streams them


def cold_int8_seconds(candidates: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., object]]],
                      dtype: torch.dtype) -> dict[str, float]:
    """Seconds per product of each candidate `name -> (pack, multiply)` over COLD_COPIES
    3,072 x 576 int8 weights read cold, one row's product plus eight rows' (rows in `dtype`),
    every (candidate, rows) timed in turns (`best_seconds_each`): what the int8 route and tile
    choices compare. `multiply(packed, scale, x)` runs one product."""
    g = torch.Generator().manual_seed(0)
    n, k = 3072, 576
    q = [torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) for _ in range(COLD_COPIES)]
    scale = torch.full((n,), 1e-3)
    rows = {m: torch.randn(m, k, generator=g).to(dtype) for m in (1, 8)}
    packed = {c: [pack_fn(w) for w in q] for c, (pack_fn, _) in candidates.items()}
    runs = {(c, m): (lambda c=c, x=x: [candidates[c][1](p, scale, x) for p in packed[c]])
            for c in candidates for m, x in rows.items()}
    each = best_seconds_each(runs, 6, COLD_COPIES)
    return {c: sum(t for (c_, _m), t in each.items() if c_ == c) for c in candidates}


Q8_ROUTES = ("bf16", "i16", "u8")
# how int8 weights multiply few rows: widened to bf16, or the rows quantized to int16 or int8
# on VNNI (`choose_q8`); a projection's GEMV layout follows the route when it is built
q8_route = "bf16"


def vnni() -> bool:
    return "avx512_vnni" in cpu_flags()


U8_FUSED_SLACK = 1.25  # u8's products may be this much slower than the fastest route's: it has the fused layer


def pick_q8(times: dict[str, float]) -> str:
    """The route `choose_q8` takes from its products' times: u8 unless another is more than
    U8_FUSED_SLACK faster."""
    best = min(times, key=times.get)
    return "u8" if "u8" in times and times["u8"] <= U8_FUSED_SLACK * times[best] else best


def choose_q8(cache_dir: Path | str) -> str:
    """How the int8 GEMV multiplies, for `q8_route`: "bf16" (the weights widened to bf16 in
    registers, `vdpbf16ps`), "i16" (the input rows quantized to int16, `vpdpwssd`) or "u8"
    (the rows quantized to int8 in blocks of U8_BLOCK inputs, `vpdpbusd`); the last two need
    AVX512-VNNI. AGENTMEM_GEMV_Q8 = auto (the default: the fastest over cold weights, one-row
    and eight-row products timed together, once per machine and remembered under `cache_dir`)
    | bf16 | i16 | u8.

    On a 2-core Xeon VM (avx512_bf16, no AMX) a model's 120 int8 products took, at one row,
    6.3-6.8 ms widened, 3.7-4.5 as i16 and 2.9-3.7 as u8; at eight rows 16.3-17.3, 5.8-6.0
    and 4.6-5.2: widening costs five instructions per 32 weights, sign-extending to int16 one,
    and `vpdpbusd` makes twice the products of `vpdpwssd` on the one port both run on. The
    int16 rows keep 14 bits per row's largest value; the int8 ones 8 bits per block's, which
    cost SmolLM2 +0.5% decode perplexity against i16 (8.491 against 8.452, teacher-forced one
    token a step; bf16 weights 8.486), and one scale per whole row +3% (so: blocks).
    `bench engine` measures the route it runs (`decode_perplexity`).

    Only the u8 route has the fused decode layer (`layer_q8u8`, `qkv_q8u8`, `finish_q8u8`: a
    layer of decode rows in one C call), which the products alone do not time. So u8 is taken
    unless another route's products are U8_FUSED_SLACK faster. On a 2-core Zen 4 VM the three
    routes' products were within 8% of each other (i16 180, u8 186, bf16 194 us), i16 was
    taken, and decode ran at 71-74 tok/s against u8's 122 (2026-11-27)."""
    global q8_route
    mode = engine_switch("GEMV_Q8")
    if mode not in ("auto", *Q8_ROUTES):
        raise ValueError(f"AGENTMEM_GEMV_Q8 must be auto, bf16, i16 or u8, got {mode!r}")
    if _lib is None or not vnni():
        q8_route = "bf16"
        return q8_route
    if mode != "auto":
        q8_route = mode
        return q8_route
    key = f"q8-fused|{tag()}|{torch.get_num_threads()}|{simd_flags()}"

    def measure() -> dict:
        times = cold_int8_seconds({r: (pack_u8 if r == "u8" else pack,
                                       lambda p, scale, x, r=r: gemv(_lib, p, x, scale=scale, i16=r == "i16"))
                                   for r in Q8_ROUTES}, torch.bfloat16)
        return {"route": pick_q8(times), "us": {r: round(t * 1e6, 1) for r, t in times.items()}}

    q8_route = remembered(cache_dir, "gemv-choice.json", key, measure)["route"]
    return q8_route


def tag() -> str:
    """The kernels' identity (a hash of their source and build flags): what a measurement of
    them is keyed by."""
    return source_tag("gemv", _SOURCE, _FLAGS)


def loaded() -> ctypes.CDLL | None:
    return _lib


def fits_shape(shape: tuple[int, ...]) -> bool:
    """Whether the kernels' layout takes a weight of this shape: [out, in] with out % 32 == 0
    and in even."""
    return len(shape) == 2 and shape[0] % BLOCK == 0 and shape[1] % 2 == 0


def fits(w: torch.Tensor) -> bool:
    """Whether the kernels' layout takes this weight (on the CPU, `fits_shape`), whatever its dtype."""
    return w.device.type == "cpu" and fits_shape(tuple(w.shape))


def usable(w: torch.Tensor) -> bool:
    """Whether `w` [out, in] can go through the bf16 kernel (bf16, and `fits`)."""
    return w.dtype == torch.bfloat16 and fits(w)


def pack(w: torch.Tensor) -> torch.Tensor:
    """The kernels' layout of `w` [N, K] (bf16, or int8 for `gemv_int8`): [N/16, K/2, 16, 2] (a copy)."""
    n, k = w.shape
    return w.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_u8(q: torch.Tensor) -> torch.Tensor:
    """The u8 route's layout of int8 weights q [N, K] (`agentmem_gemv_q8u8`): q + 128 as uint8,
    [N/16, K/4, 16, 4] (a 32-bit lane holds one output's four inputs)."""
    n, k = q.shape
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    return u.reshape(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


Q4_GROUP = 32  # inputs per scale and minimum of the q4 route's 4-bit weights (csrc/q4_vnni.h's Q4_GROUP)


def pack_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The q4 route's layout of a weight w [N, K] as 4-bit groups of Q4_GROUP inputs (llama.cpp's
    Q4_1): per output and group an fp16 scale d = (max - min) / 15 and minimum m = min, q =
    round((w - m) / d) in 0..15, w ~ d q + m. Returns (q packed [N/16, K/8, 16, 4] uint8: the
    bytes of a 32-bit lane hold one output's inputs k..k+3 in their low nibbles and k+4..k+7 in
    their high ones; dm [N/16, K/Q4_GROUP, 2, 16] fp16: d then m for 16 outputs). A weight that
    is already of this form (read from a Q4_1 GGUF) is recovered exactly: its group's smallest
    and largest values are m and m + 15 d."""
    n, k = w.shape
    g = w.float().view(n, k // Q4_GROUP, Q4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()
    df, mf = d.float()[..., None], m.float()[..., None]
    q = torch.where(df > 0, (g - mf) / torch.where(df > 0, df, 1.0), 0.0).round().clamp(0, 15).to(torch.uint8)
    qq = q.view(n // 16, 16, k // 8, 2, 4)
    packed = (qq[:, :, :, 0] | (qq[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    dm = torch.stack([d.view(n // 16, 16, -1), m.view(n // 16, 16, -1)], 2).permute(0, 3, 2, 1).contiguous()
    return packed, dm


def unpack_q4(packed: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] that `pack_q4`'s layout holds: d q + m."""
    g16, k8 = packed.shape[0], packed.shape[1]
    lo, hi = packed & 15, packed >> 4  # [N/16, K/8, 16, 4]
    q = torch.stack([lo, hi], 3).permute(0, 2, 1, 3, 4).reshape(g16 * 16, k8 * 8).float()
    n, k = q.shape
    d = dm[:, :, 0].permute(0, 2, 1).reshape(n, -1).float()
    m = dm[:, :, 1].permute(0, 2, 1).reshape(n, -1).float()
    return (q.view(n, -1, Q4_GROUP) * d[..., None] + m[..., None]).view(n, k)


def gemv_q4(lib: ctypes.CDLL, wp: torch.Tensor, dm: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, in] (bf16) @ w.T (+ bias) -> [M, out] (bf16, or fp32 with `out_dtype`) for w held
    as `pack_q4(w)` (`agentmem_gemv_q4u8`: the rows quantized to int8 as on the u8 route)."""
    n, k = wp.shape[0] * 16, wp.shape[1] * 8
    if x.shape[-1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"gemv_q4: x must be bf16 with {k} inputs, got {x.dtype} with {x.shape[-1]}")
    return run_product(lib.agentmem_gemv_q4u8, wp, dm, x, bias, n, out_dtype or x.dtype)


def run_product(fn, w: torch.Tensor, s: torch.Tensor | None, x: torch.Tensor, bias: torch.Tensor | None, n: int,
                out_dtype: torch.dtype, out_flag: bool = True) -> torch.Tensor:
    """y [M, n] in `out_dtype` from a product function of either library, called as
    fn(w, s, x, ldx, y, bias, M, n, k[, fp32 out], threads) (`out_flag`: it takes the output's
    dtype; the AVX2 library's write fp32 only), the rows' last dimension contiguous and the bias
    fp32."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=out_dtype)
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    flag = (int(out_dtype == torch.float32),) if out_flag else ()
    fn(w.data_ptr(), None if s is None else s.data_ptr(), x.data_ptr(), x.stride(0), y.data_ptr(),
       None if bias is None else bias.data_ptr(), x.shape[0], n, x.shape[1], *flag, torch.get_num_threads())
    return y


def fits_u8(w: torch.Tensor) -> bool:
    """Whether the u8 route takes a weight of this shape (`fits`, and in a multiple of its
    quantization block)."""
    return fits(w) and w.shape[1] % U8_BLOCK == 0


U8_BLOCK = 64  # inputs per scale of the u8 route's int8 rows (csrc/bf16/gemv_q8u8.c's U8_BLOCK)


def gemv(lib: ctypes.CDLL, wp: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, scale: torch.Tensor | None = None, i16: bool = False) -> torch.Tensor:
    """x [M, in] (bf16) @ w.T (+ bias) -> [M, out] in `out_dtype` (bf16 or fp32), for `wp` =
    pack(w) of a bf16 weight, or of int8 weights q with `scale` (fp32 [out]): w = q * scale[:, None]
    (`wp` = pack(q), or pack_u8(q) for the u8 route: the input rows quantized to int8)."""
    u8 = wp.dtype == torch.uint8
    n, k = wp.shape[0] * 16, wp.shape[1] * (4 if u8 else 2)
    if x.shape[-1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"gemv: x must be bf16 with {k} inputs, got {x.dtype} with {x.shape[-1]}")
    if (scale is None) != (wp.dtype == torch.bfloat16) or (u8 and k % U8_BLOCK):
        raise ValueError(f"gemv: a {wp.dtype} weight {'takes no' if scale is not None else 'needs a'} scale")
    fn = (lib.agentmem_gemv_q8u8 if u8 else lib.agentmem_gemv_q8i16 if i16 and scale is not None
          else lib.agentmem_gemv)
    return run_product(fn, wp, scale, x, bias, n, out_dtype or x.dtype)


def gemv_int8(lib: ctypes.CDLL, qp: torch.Tensor, scale: torch.Tensor, x: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, i16: bool = False) -> torch.Tensor:
    """`gemv` of int8 weights: x @ (q * scale[:, None]).T (+ bias), for `qp` = pack(q). With
    `i16` (AVX512-VNNI, `vnni()`), the input rows are quantized to int16 and multiplied on
    vpdpwssd (`agentmem_gemv_q8i16`) instead of the weights being widened to bf16."""
    return gemv(lib, qp, x, bias, out_dtype, scale=scale, i16=i16)


# The ops both libraries hold, for bf16 rows here and fp32 rows in `cpu_fp32`: one function an
# op, given the library's C function (and the dtype of the rows it reads), serves both; each
# library's public wrapper names its own.


def norm_rows(fn: Callable[..., None], dtype: torch.dtype, x: torch.Tensor, weight: torch.Tensor,
              eps: float) -> torch.Tensor:
    """RMSNorm of rows x [M, D] (`dtype`, as `weight` [D]) by `fn` (a library's
    `agentmem_*rms_norm*`) in one call, into a new contiguous [M, D] tensor of `dtype`."""
    if x.dim() != 2 or x.stride(-1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty(x.shape, dtype=dtype)
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
    return y


def rope_takes(x: torch.Tensor, cos: torch.Tensor, dtype: torch.dtype, multiple: int) -> bool:
    """Whether a library's `rope` takes x [N, heads, hd] (`dtype` on the CPU, each head's dims
    contiguous and heads adjacent, hd a multiple of `multiple`) with fp32 tables [N, hd]."""
    return (x.dtype == dtype and x.device.type == "cpu" and x.dim() == 3 and cos.dim() == 2
            and x.shape[-1] % multiple == 0 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
            and cos.dtype == torch.float32 and cos.shape == (x.shape[0], x.shape[-1]))


def rotate_rows(fn: Callable[..., None], dtype: torch.dtype, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, heads, hd] (`dtype`) rotated by its positions' tables (`Rotary.cos_sin`) by `fn` (a
    library's `agentmem_*rope*`), into `out` (contiguous, x's shape and `dtype`) or a new
    contiguous tensor (`rope_takes` must hold)."""
    n, heads, hd = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty(n, heads, hd, dtype=dtype) if out is None else out
    fn(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), n, heads, hd)
    return y


MAX_GROUP = 32  # query heads per KV head the bf16 attention kernel takes (the fp32 one, any)
MAX_HEAD_DIM = 256


def attention_takes(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int,
                    kernel_dtype: torch.dtype, multiple: int, max_group: int | None) -> bool:
    """Whether a library's `decode_attention` takes such a query and pool: `kernel_dtype` on the
    CPU, head_dim a multiple of `multiple` up to MAX_HEAD_DIM, query heads a multiple of the KV
    heads and at most `max_group` of them per KV head (None: any number)."""
    return (dtype == kernel_dtype and device.type == "cpu" and head_dim % multiple == 0
            and head_dim <= MAX_HEAD_DIM and heads % kv_heads == 0
            and (max_group is None or heads // kv_heads <= max_group))


def attend_pool(fn: Callable[..., None], q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                idx: torch.Tensor, keep: torch.Tensor, scale: float | None) -> torch.Tensor:
    """One decode query per row over its keys in the paged pool by `fn` (a library's
    `agentmem_decode_attn_*`): q [B, H, hd]; k_pool/v_pool [..., KV, hd] (contiguous, q's dtype);
    idx [B * W] flat slots; keep [B, W] (or [B, 1, 1, W]) which of them the row sees. Returns
    [B, H, hd] in q's dtype."""
    b, h, hd = q.shape
    kv = k_pool.shape[-2]
    w = keep.numel() // b
    if idx.numel() != b * w:
        raise ValueError(f"decode_attention: {idx.numel()} slots for {b} rows of {w} keys")
    if keep.numel() != b * w:
        raise ValueError(f"decode_attention: {keep.numel()} keep flags for {b} rows")
    # the engine passes idx (int64) and keep (uint8), contiguous, made once a step: no conversions then
    if idx.dtype != torch.int64 or not idx.is_contiguous():
        idx = idx.to(torch.int64).contiguous()
    if keep.dtype != torch.uint8 or not keep.is_contiguous():
        keep = keep.to(torch.uint8).contiguous()
    if not q.is_contiguous():
        q = q.contiguous()
    out = torch.empty_like(q)
    fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), idx.data_ptr(), keep.data_ptr(), out.data_ptr(),
       b, h, kv, hd, w, hd ** -0.5 if scale is None else scale, torch.get_num_threads())
    return out


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of bf16 rows x [M, D] by a bf16 weight [D], rounded as `layers.rms_norm` rounds."""
    return norm_rows(lib.agentmem_rms_norm_bf16, torch.bfloat16, x, weight, eps)


def rope_usable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rope` takes x [N, heads, hd] (bf16 on the CPU, each head's dims contiguous and
    heads adjacent, hd a multiple of 32) with fp32 tables [N, hd]."""
    return rope_takes(x, cos, torch.bfloat16, 32)


def rope(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd] rotated by its positions' tables (`Rotary.cos_sin`), as `layers.rotate`
    computes it, into a new contiguous bf16 tensor (`rope_usable` must hold)."""
    return rotate_rows(lib.agentmem_rope_bf16, torch.bfloat16, x, cos, sin)


def rope_into(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """`rope` of x [N, heads, hd] written into `out` (a contiguous bf16 tensor of x's shape, e.g. a
    slice of the blend's K of one layer) instead of a new tensor (`rope_usable` must hold)."""
    if not (rope_usable(x, cos) and out.dtype == torch.bfloat16 and out.shape == x.shape and out.is_contiguous()):
        raise ValueError(f"rope_into: x {x.dtype} {tuple(x.shape)}, out {out.dtype} {tuple(out.shape)}")
    rotate_rows(lib.agentmem_rope_bf16, torch.bfloat16, x, cos, sin, out=out)


def silu_mul(lib: ctypes.CDLL, gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u of bf16 rows gu [N, 2I] (g = gu[:, :I], u = gu[:, I:]; each row contiguous),
    as torch's two ops compute and round it, in one call: [N, I] bf16."""
    return silu_rows(lib.agentmem_silu_mul_bf16, torch.bfloat16, gu)


def silu_rows(fn: Callable[..., None], dtype: torch.dtype, gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u of rows gu [N, 2I] (`dtype` on the CPU, each row contiguous) by `fn` (a
    library's `agentmem_*silu_mul*`) in one call: [N, I] of `dtype`."""
    n, two_i = gu.shape
    if gu.dtype != dtype or gu.device.type != "cpu" or two_i % 2 or gu.stride(1) != 1:
        raise ValueError(f"silu_mul: gu {gu.dtype} {tuple(gu.shape)} strides {gu.stride()}")
    y = torch.empty(n, two_i // 2, dtype=dtype)
    fn(gu.data_ptr(), gu.stride(0), y.data_ptr(), n, two_i // 2)
    return y


MAX_FINISH_ROWS = 8  # the fused halves' rows (one tile of the u8 products)


def _fused_rows(h: torch.Tensor, norm_w: torch.Tensor) -> bool:
    """Rows the fused layer functions take: 1 to MAX_FINISH_ROWS contiguous bf16 rows on the
    CPU, normed by a bf16 weight."""
    return (h.dtype == norm_w.dtype == torch.bfloat16 and h.device.type == "cpu" and h.dim() == 2
            and 0 < h.shape[0] <= MAX_FINISH_ROWS and h.is_contiguous())


def _on_u8(*projs) -> bool:
    """Whether every `Proj` is on one route of the fused layer functions, without a bias: int8
    on the u8 route, or int4 on the q4 route (their GEMV layouts built)."""
    routes = {p.q8_route if p.fmt in ("int8", "int4") else None for p in projs}
    return (len(routes) == 1 and routes <= {"u8", "q4"}
            and all(p.w_gemv is not None and p.bias is None for p in projs))


def q4_flag(p) -> int:
    """Both libraries' fused layer calls' `q4` argument for a projection on their routes: 1 for
    4-bit weights (the q4 layout), 0 for int8."""
    return int(p.q8_route == "q4")


def finish_takes(h: torch.Tensor, attn: torch.Tensor, projs: tuple, norm_w: torch.Tensor) -> bool:
    """Whether `finish_q8u8` takes this layer's second half: `_fused_rows`, contiguous bf16
    attention rows, and o, gate/up and down all `_on_u8`."""
    return _fused_rows(h, norm_w) and attn.dtype == torch.bfloat16 and attn.is_contiguous() and _on_u8(*projs)


def qkv_takes(h: torch.Tensor, qkv, norm_w: torch.Tensor, cos: torch.Tensor, hd: int) -> bool:
    """Whether `qkv_q8u8` takes these rows: `_fused_rows`, the fused qkv projection `_on_u8`,
    and fp32 RoPE tables [M, hd] (hd a multiple of 32)."""
    return (_fused_rows(h, norm_w) and _on_u8(qkv) and hd % 32 == 0
            and cos.dtype == torch.float32 and cos.shape == (h.shape[0], hd))


def qkv_q8u8(lib: ctypes.CDLL, h: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv, cos: torch.Tensor,
             sin: torch.Tensor, qk_heads: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The un-rotated q, k, v of decode rows h [M, D] ([M, heads, hd], as `Block.qkv_fused`)
    and the first `qk_heads` of them (q and k) rotated ([M, qk_heads, hd], as `rotate`), in one
    call (`agentmem_qkv_q8u8`, `qkv_takes`), bit-identical to the three calls it replaces."""
    m, d = h.shape
    out = torch.empty(m, qkv.out_features // hd, hd, dtype=torch.bfloat16)
    qk = torch.empty(m, qk_heads, hd, dtype=torch.bfloat16)
    cos, sin = cos.contiguous(), sin.contiguous()
    lib.agentmem_qkv_q8u8(h.data_ptr(), norm_w.data_ptr(), eps, qkv.w_gemv.data_ptr(), qkv.scale.data_ptr(),
                          cos.data_ptr(), sin.data_ptr(), out.data_ptr(), qk.data_ptr(), m, d, qkv.out_features,
                          qk_heads, hd, q4_flag(qkv), torch.get_num_threads())
    return out, qk


def finish_q8u8(lib: ctypes.CDLL, h: torch.Tensor, attn: torch.Tensor, o, gate_up, down, norm_w: torch.Tensor,
                eps: float) -> torch.Tensor:
    """`Block.finish` of few decode rows in one C call (`agentmem_finish_q8u8`): h + o(attn),
    then the SwiGLU MLP of its RMSNorm added, bit-identical to the separate calls. h [M, D] and
    attn [M, H*hd] bf16 (`finish_takes`); o, gate_up, down: the layer's int8 `Proj`s."""
    m, d = h.shape
    out = torch.empty_like(h)
    lib.agentmem_finish_q8u8(attn.data_ptr(), attn.shape[1], h.data_ptr(), out.data_ptr(),
                             o.w_gemv.data_ptr(), o.scale.data_ptr(), norm_w.data_ptr(), eps,
                             gate_up.w_gemv.data_ptr(), gate_up.scale.data_ptr(), down.w_gemv.data_ptr(),
                             down.scale.data_ptr(), m, attn.shape[1], d, down.in_features, q4_flag(down),
                             torch.get_num_threads())
    return out


def _u8_block_takes(block) -> bool:
    """The parts of `layer_q8u8`'s conditions that depend on the block alone (its weights'
    formats and options): what `layers_q8u8` checks once per model."""
    a = block.args
    return (_on_u8(block.qkv_p, block.o_p, block.gate_up_p, block.down_p) and block.q_norm is None
            and block.input_norm.eps == block.post_norm.eps
            and block.input_norm.weight.dtype == block.post_norm.weight.dtype == torch.bfloat16
            and block.input_norm.weight.is_contiguous() and block.post_norm.weight.is_contiguous()
            and a.sliding_window is None and a.head_dim % 32 == 0 and a.head_dim <= MAX_HEAD_DIM
            and a.n_heads % a.n_kv_heads == 0 and a.n_heads // a.n_kv_heads <= MAX_GROUP)


def decode_step_takes(h: torch.Tensor, dtype: torch.dtype, max_rows: int, pool_dtypes: tuple, hd: int,
                      cos: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                      idx: torch.Tensor, keep: torch.Tensor) -> bool:
    """Whether a fused decode call (a layer, or every layer of the step) takes this step: 1 to
    `max_rows` contiguous rows of `dtype` on the CPU, fp32 RoPE tables [M, hd], a contiguous
    pool in one of `pool_dtypes` (K and V alike), and the rows' slot tables. This library's
    calls (bf16 rows and pool) and cpu_fp32's (fp32 rows, fp32 or fp16 pool) share it."""
    m = h.shape[0] if h.dim() == 2 else 0
    w = keep.numel() // max(m, 1)
    return (h.dtype == dtype and h.device.type == "cpu" and 0 < m <= max_rows and h.is_contiguous()
            and cos.dtype == torch.float32 and cos.shape == (m, hd)
            and k_pool.dtype == v_pool.dtype and k_pool.dtype in pool_dtypes and k_pool.is_contiguous()
            and v_pool.is_contiguous() and slots.dtype == idx.dtype == torch.int64 and keep.dtype == torch.uint8
            and slots.numel() == m and idx.numel() == keep.numel() == m * w and idx.is_contiguous()
            and keep.is_contiguous())


def _u8_step_takes(h: torch.Tensor, hd: int, *pool_and_tables: torch.Tensor) -> bool:
    """`decode_step_takes` for bf16 rows (at most MAX_FINISH_ROWS) over a bf16 pool."""
    return decode_step_takes(h, torch.bfloat16, MAX_FINISH_ROWS, (torch.bfloat16,), hd, *pool_and_tables)


def layer_q8u8(lib: ctypes.CDLL, block, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor,
               keep: torch.Tensor) -> torch.Tensor | None:
    """A whole decoder layer (`Block.forward`) for decode rows h [M, D] in one call
    (`agentmem_layer_q8u8`): norm, qkv, RoPE, the rows' K/V written to this layer's paged pool
    (k_pool/v_pool [..., KV, hd]) at `slots` [M], the decode attention over each row's keys
    (idx [M * W] flat slots, keep [M, W] uint8, as `decode_attention`), then `finish`;
    bit-identical to the separate calls. None where it does not take these (the caller runs
    the separate calls)."""
    a = block.args
    m = h.shape[0] if h.dim() == 2 else 0
    w = keep.numel() // max(m, 1)
    if not (_u8_step_takes(h, a.head_dim, cos, k_pool, v_pool, slots, idx, keep) and _u8_block_takes(block)):
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = slots.contiguous()
    out = torch.empty_like(h)
    lib.agentmem_layer_q8u8(h.data_ptr(), out.data_ptr(), block.input_norm.weight.data_ptr(),
                            block.post_norm.weight.data_ptr(), block.input_norm.eps, block.qkv_p.w_gemv.data_ptr(),
                            block.qkv_p.scale.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_pool.data_ptr(),
                            v_pool.data_ptr(), slots.data_ptr(), idx.data_ptr(), keep.data_ptr(), w,
                            a.head_dim ** -0.5, block.o_p.w_gemv.data_ptr(), block.o_p.scale.data_ptr(),
                            block.gate_up_p.w_gemv.data_ptr(), block.gate_up_p.scale.data_ptr(),
                            block.down_p.w_gemv.data_ptr(), block.down_p.scale.data_ptr(), m, h.shape[1],
                            a.n_heads, a.n_kv_heads, a.head_dim, block.down_p.in_features, q4_flag(block.down_p),
                            torch.get_num_threads())
    return out


def layer_table(model, attr: str, takes: Callable, ptrs: Callable):
    """The table of every layer's weight pointers a whole-step decode call reads (`ptrs(block)`
    a layer, side by side), kept on the model as `attr` (reset by `Transformer.pack`); False,
    kept too, when a layer is not taken (`takes(block)`), or the layers' norms differ in eps or
    their weights in format (the call takes one `q4` flag for all: `q4_flag`)."""
    table = getattr(model, attr, None)
    if table is None:
        blocks = list(model.layers)
        ok = (bool(blocks) and all(takes(b) for b in blocks) and len({b.input_norm.eps for b in blocks}) == 1
              and len({q4_flag(p) for b in blocks for p in (b.qkv_p, b.o_p, b.gate_up_p, b.down_p)}) == 1)
        flat = [p for b in blocks for p in ptrs(b)] if ok else []
        table = (ctypes.c_void_p * len(flat))(*flat) if ok else False
        setattr(model, attr, table)
    return table


def _u8_layer_ptrs(block) -> list[int]:
    """A block's weights in `agentmem_layer_q8u8`'s order (U8_LAYER_PTRS of them)."""
    q, o, gu, d = block.qkv_p, block.o_p, block.gate_up_p, block.down_p
    return [block.input_norm.weight.data_ptr(), block.post_norm.weight.data_ptr(), q.w_gemv.data_ptr(),
            q.scale.data_ptr(), o.w_gemv.data_ptr(), o.scale.data_ptr(), gu.w_gemv.data_ptr(), gu.scale.data_ptr(),
            d.w_gemv.data_ptr(), d.scale.data_ptr()]


def layers_q8u8(lib: ctypes.CDLL, model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool,
                slots: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
    """Every decoder layer of a decode step (`Transformer.forward`'s loop) in one C call
    (`agentmem_layers_q8u8`: `layer_q8u8` a layer, one team of threads and one scratch for the
    step, no Python between the layers): bf16 rows h [M, D] in, the last layer's out; pool: the
    runner's KVPool (k/v [L, slots, KV, hd]). The table of the layers' weight pointers is built
    once a model (`model._u8_layers`, reset by `pack`); None where a layer or the step is not
    taken (the caller runs the layers one by one). Bit-identical to them."""
    table = layer_table(model, "_u8_layers", _u8_block_takes, _u8_layer_ptrs)
    a = model.args
    if table is False or not _u8_step_takes(h, a.head_dim, cos, pool.k, pool.v, slots, idx, keep):
        return None
    m = h.shape[0]
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty_like(h)
    lib.agentmem_layers_q8u8(
        h.data_ptr(), out.data_ptr(), a.n_layers, table, model.layers[0].input_norm.eps, cos.data_ptr(),
        sin.data_ptr(), pool.k.data_ptr(), pool.v.data_ptr(), pool.k[0].numel(), slots.contiguous().data_ptr(),
        idx.data_ptr(), keep.data_ptr(), keep.numel() // m, a.head_dim ** -0.5, m, h.shape[1], a.n_heads,
        a.n_kv_heads, a.head_dim, model.layers[0].down_p.in_features, q4_flag(model.layers[0].down_p),
        torch.get_num_threads())
    return out


def drift_usable(k: torch.Tensor) -> bool:
    """Whether `drift` takes a layer's K (and V) [T, KV, hd]: bf16, contiguous, on the CPU, hd a
    multiple of 32."""
    return (k.dtype == torch.bfloat16 and k.device.type == "cpu" and k.dim() == 3 and k.is_contiguous()
            and k.shape[-1] % 32 == 0)


def drift(lib: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, spans: torch.Tensor, dk: torch.Tensor,
          dv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> None:
    """Add each group's mean drift to its span of one layer's k, v [T, KV, hd] in place (bf16;
    `drift_usable`): v += dv[g], k += dk[g] rotated to each position by the fp32 tables
    [positions, hd] (`Rotary`'s whole tables). spans int64 [G, 2] (first, end); dk, dv fp32
    [G, KV, hd]. What kvreuse's `_Drift.apply` computes in torch, in one call."""
    g = spans.shape[0]
    if not (drift_usable(k) and v.shape == k.shape and v.dtype == k.dtype and v.is_contiguous()
            and dk.shape == dv.shape == (g, *k.shape[1:]) and dk.dtype == dv.dtype == torch.float32
            and cos_table.dtype == sin_table.dtype == torch.float32 and cos_table.shape[-1] == k.shape[-1]
            and (g == 0 or int(spans.max()) <= min(k.shape[0], cos_table.shape[0]))):
        raise ValueError(f"drift: k {k.dtype} {tuple(k.shape)}, v {tuple(v.shape)}, spans {tuple(spans.shape)}, "
                         f"dk {dk.dtype} {tuple(dk.shape)}, tables {tuple(cos_table.shape)}")
    spans = spans.to(torch.int64).contiguous()
    dk, dv = dk.contiguous(), dv.contiguous()
    cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
    lib.agentmem_drift_bf16(k.data_ptr(), v.data_ptr(), spans.data_ptr(), g, dk.data_ptr(), dv.data_ptr(),
                            cos_table.data_ptr(), sin_table.data_ptr(), k.shape[1], k.shape[2])


def attention_usable(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `decode_attention` takes such a query and pool: bf16 on the CPU, head_dim a
    multiple of 32 up to 256, at most 32 query heads per KV head."""
    return attention_takes(dtype, device, heads, kv_heads, head_dim, torch.bfloat16, 32, MAX_GROUP)


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     idx: torch.Tensor, keep: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One decode query per row over its keys in the paged pool: q [B, H, hd]; k_pool/v_pool
    [..., KV, hd] (contiguous); idx [B * W] flat slots; keep [B, W] (or [B, 1, 1, W]) which of
    them the row sees. Returns [B, H, hd] (bf16). What `paged_attention` computes with
    gathers and SDPA, in one pass over the keys (attention_usable must hold). idx as int64
    and keep as uint8, both contiguous, are used as they are (the engine makes them once a step)."""
    return attend_pool(lib.agentmem_decode_attn_bf16, q, k_pool, v_pool, idx, keep, scale)


def rows_kernel(q: torch.Tensor, k: torch.Tensor, route: str = "kernel") -> ctypes.CDLL | None:
    """The library where `rows_attention` ("kernel") or `rows_attention_amx` ("amx") takes such
    q [Nq, H, hd] and k [T, KV, hd] (bf16 on the CPU, `attention_usable`) and is this machine's
    way for them (`rows_route`), else None."""
    lib = _lib
    if lib is None or q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or q.dim() != 3 or k.dim() != 3:
        return None
    if not attention_usable(q.dtype, q.device, q.shape[1], k.shape[1], q.shape[2]):
        return None
    return lib if rows_route(q.shape[1], k.shape[1], q.shape[2]) == route else None


def rows_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                share: torch.Tensor | None = None) -> torch.Tensor | None:
    """Causal attention of bf16 query rows at `q_pos` over k/v by this machine's C way for the
    shapes (`rows_route`: the vdpbf16ps kernel, or AMX tiles where they measured faster), or
    None where the route is torch's SDPA (the caller runs it). Both C ways add the kvreuse
    probe's per-key signal to `share` where it is given."""
    if (lib := rows_kernel(q, k)) is not None:
        return rows_attention(lib, q, k, v, q_pos, share=share)
    if (lib := rows_kernel(q, k, "amx")) is not None:
        return rows_attention_amx(lib, q, k, v, q_pos, share=share)
    return None


def widen_rows(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether bf16 rows attention of these shapes runs faster widened to fp32 (SDPA) here."""
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.dim() == 3 and k.dim() == 3
            and rows_route(q.shape[1], k.shape[1], q.shape[2]) == "fp32")


ATTN_MODES = {"on": "kernel", "off": "bf16", "bf16": "bf16", "fp32": "fp32", "amx": "amx"}  # AGENTMEM_ATTN_KERNEL -> route
_ROUTES: dict[tuple[int, int, int], str] = {}  # (heads, kv_heads, head_dim) -> the route measured


def rows_route(heads: int, kv_heads: int, head_dim: int) -> str:
    """How causal attention of bf16 query rows runs: "kernel" (`rows_attention`), "amx"
    (`rows_attention_amx`, AMX tiles), "fp32" (q, k and v widened for torch's SDPA) or "bf16"
    (SDPA in bf16). AGENTMEM_ATTN_KERNEL = auto (the default: what `choose_rows_route` measured
    for these shapes, else the kernel) | on (the kernel) | off (SDPA in bf16) | fp32 | amx (where
    `amx_usable`, else bf16 SDPA)."""
    mode = engine_switch("ATTN_KERNEL")
    if mode == "auto":
        return _ROUTES.get((heads, kv_heads, head_dim), "kernel")
    if mode not in ATTN_MODES:
        raise ValueError(f"AGENTMEM_ATTN_KERNEL must be auto, {', '.join(ATTN_MODES)}, got {mode!r}")
    if mode == "amx" and not amx_usable(_lib):
        return "bf16"
    return ATTN_MODES[mode]


def choose_rows_route(cache_dir: Path | str, heads: int, kv_heads: int, head_dim: int) -> str:
    """Time a 2,048-token causal prefill's attention (four 512-row chunks) with the kernel,
    widened to fp32, through SDPA in bf16 and on AMX tiles (`amx_usable`), once per machine and shape (remembered under
    `cache_dir`), and keep the fastest for `rows_route`. No way wins everywhere: on the AMD
    EPYC VMs the kernel ran 2,048 tokens 3x faster than SDPA; on a Xeon VM with avx512_bf16
    (no AMX), where vdpbf16ps issues at half the rate of fp32 FMAs, it took 50 ms a layer
    against fp32 SDPA's 36; on a Xeon VM with AMX, bf16 SDPA (oneDNN's AMX flash attention)
    took 13 ms against the kernel's 40 and fp32's 33 (2026-11-27), and where AMX is usable the
    engine's own AMX kernel is a fourth candidate: 4.7-5.2 ms against bf16 SDPA's 12 there
    (2026-11-27)."""
    if _lib is None or not attention_usable(torch.bfloat16, torch.device("cpu"), heads, kv_heads, head_dim):
        return "bf16"
    from ..model_runner import sdpa_chunk  # lazy: the runner imports this module

    key = f"rows-attention-4|{tag()}|{torch.__version__}|{heads},{kv_heads},{head_dim}|{torch.get_num_threads()}|" \
          + simd_flags()

    def measure() -> dict:
        n, chunk = 2048, 512
        g = torch.Generator().manual_seed(0)
        q = torch.randn(n, heads, head_dim, generator=g).to(torch.bfloat16)
        k = torch.randn(n, kv_heads, head_dim, generator=g).to(torch.bfloat16)
        v = torch.randn(n, kv_heads, head_dim, generator=g).to(torch.bfloat16)
        pos = torch.arange(n)

        def kernel():
            for s in range(0, n, chunk):
                rows_attention(_lib, q[s:s + chunk], k[:s + chunk], v[:s + chunk], pos[s:s + chunk])

        def widened():
            qf, kf, vf = q.float(), k.float(), v.float()
            for s in range(0, n, chunk):  # what attend_chunk does with the route fp32
                sdpa_chunk(qf[s:s + chunk], kf[:s + chunk], vf[:s + chunk], s).to(torch.bfloat16)

        def bf16():
            for s in range(0, n, chunk):  # the route bf16
                sdpa_chunk(q[s:s + chunk], k[:s + chunk], v[:s + chunk], s)

        def amx():
            for s in range(0, n, chunk):
                rows_attention_amx(_lib, q[s:s + chunk], k[:s + chunk], v[:s + chunk], pos[s:s + chunk])

        runs = (("kernel", kernel), ("fp32", widened), ("bf16", bf16)) + ((("amx", amx),) if amx_usable(_lib) else ())
        times = best_seconds_each(dict(runs), 3)
        return {"route": min(times, key=times.get), "ms": {k_: round(t * 1e3, 2) for k_, t in times.items()}}

    route = remembered(cache_dir, "attention-choice.json", key, measure)["route"]
    _ROUTES[(heads, kv_heads, head_dim)] = route
    return route


def p_split() -> bool:
    """Whether `rows_attention` multiplies V by each softmax weight as two bf16 (hi + lo, ~16 bits:
    AGENTMEM_ATTN_P=split) or as one (bf16, the default), as flash attention does on GPUs."""
    mode = engine_switch("ATTN_P")
    if mode not in ("bf16", "split"):
        raise ValueError(f"AGENTMEM_ATTN_P must be bf16 or split, got {mode!r}")
    return mode == "split"


def rows_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                   scale: float | None = None, share: torch.Tensor | None = None,
                   split: bool | None = None) -> torch.Tensor:
    """Causal attention of query rows q [Nq, H, hd] at ascending positions `q_pos` [Nq] over
    keys k/v [T, KV, hd] at positions 0..T-1 (a query sees the keys at or before its own
    position): a prefill chunk (q_pos = start..start+n-1) or CacheBlend's recomputed rows.
    bf16 in and out, fp32 scores and softmax (`attention_usable` must hold for the shapes).
    What `sdpa` with a causal mask computes, on vdpbf16ps (csrc/bf16/attention_rows.c).
    `share` (fp32 [T], contiguous): added to, per key, its attention weight times the norm of
    its value, summed over the rows and heads (what the kvreuse probe ranks cached tokens by)."""
    nq, h, hd = q.shape
    t, kv = k.shape[0], k.shape[1]
    if v.shape != k.shape or k.shape[-1] != hd or q_pos.shape != (nq,):
        raise ValueError(f"rows_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"q_pos {tuple(q_pos.shape)}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_pos = q_pos.to(torch.int64).contiguous()
    if share is not None and (share.dtype != torch.float32 or share.shape != (t,) or not share.is_contiguous()):
        raise ValueError(f"rows_attention: share must be a contiguous fp32 [{t}], got {share.dtype} "
                         f"{tuple(share.shape)}")
    out = torch.empty_like(q)
    lib.agentmem_rows_attn_bf16(q.data_ptr(), q_pos.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                nq, h, kv, hd, t, hd ** -0.5 if scale is None else scale, torch.get_num_threads(),
                                None if share is None else share.data_ptr(), int(p_split() if split is None else split))
    return out


_amx: bool | None = None  # `amx_usable`, once asked of a loaded library


def amx_usable(lib: ctypes.CDLL | None = None) -> bool:
    """Whether `rows_attention_amx` runs here: the CPU has AMX (amx_bf16 and amx_tile) and the
    kernel's library (`lib`, else the loaded one) got the process's permission to use the tiles
    (`agentmem_amx_ok`: Linux asks each process to request it). Asked once a process; False,
    not remembered, while no library is loaded."""
    global _amx
    if _amx is None:
        lib = lib if lib is not None else _lib
        if lib is None:
            return False
        flags = cpu_flags()
        ok = False
        if "amx_bf16" in flags and "amx_tile" in flags:
            ok = lib.agentmem_amx_ok() == 1
        _amx = ok
    return _amx


def rows_attention_amx(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                       scale: float | None = None, share: torch.Tensor | None = None) -> torch.Tensor:
    """`rows_attention` on AMX tiles: causal attention of bf16 query rows q [Nq, H, hd] at
    ascending positions `q_pos` [Nq] over keys k/v [T, KV, hd] at 0..T-1, fp32 scores and
    softmax, bf16 out; flash-attention style (QK^T and PV on TDPBF16PS, the online softmax in
    AVX-512; see csrc/bf16/attention_amx.c). head_dim a multiple of 32 up to 256, H a multiple of KV, scale
    > 0; only where `amx_usable()` holds. `share` (fp32 [T], contiguous), as `rows_attention`'s:
    added to, per key, its attention weight times the norm of its value, summed over the rows
    and heads (the kvreuse probe's signal; a second pass over each row tile's keys once its
    softmax is final)."""
    nq, h, hd = q.shape
    t, kv = k.shape[0], k.shape[1]
    if v.shape != k.shape or k.shape[-1] != hd or q_pos.shape != (nq,):
        raise ValueError(f"rows_attention_amx: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"q_pos {tuple(q_pos.shape)}")
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or q.device.type != "cpu":
        raise ValueError(f"rows_attention_amx: bf16 CPU tensors only, got {q.dtype}, {k.dtype}, {v.dtype} on {q.device}")
    if hd % 32 or not 0 < hd <= 256 or kv == 0 or h % kv:
        raise ValueError(f"rows_attention_amx: head_dim {hd} (a multiple of 32 up to 256), heads {h}, kv_heads {kv}")
    scale = hd ** -0.5 if scale is None else scale
    if not scale > 0:
        raise ValueError(f"rows_attention_amx: scale must be > 0, got {scale}")
    if share is not None and (share.dtype != torch.float32 or share.shape != (t,) or not share.is_contiguous()
                              or share.device.type != "cpu"):
        raise ValueError(f"rows_attention_amx: share must be a contiguous fp32 [{t}] on the CPU, got {share.dtype} "
                         f"{tuple(share.shape)}")
    if not amx_usable(lib):  # the tile instructions would fault
        raise RuntimeError("rows_attention_amx: no AMX here (see amx_usable)")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_pos = q_pos.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    lib.agentmem_rows_attn_amx(q.data_ptr(), q_pos.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                               nq, h, kv, hd, t, scale, torch.get_num_threads(),
                               None if share is None else share.data_ptr())
    return out


# decode attention as one opaque op, so that the compiled decode step (compiled.py) calls the
# kernel too; it reads the pool after the step's K/V write, which the graph orders before it
_OPS = torch.library.Library("agentmem", "FRAGMENT")
_OPS.define("decode_attn(Tensor q, Tensor k_pool, Tensor v_pool, Tensor idx, Tensor keep) -> Tensor")


def _decode_attn(q, k_pool, v_pool, idx, keep):
    if q.dtype == torch.float32:  # fp32 rows: the AVX2 library's kernel (compiled.paged_attention)
        from . import cpu_fp32

        return cpu_fp32.decode_attention(cpu_fp32.loaded(), q, k_pool, v_pool, idx, keep)
    return decode_attention(_lib, q, k_pool, v_pool, idx, keep)


_OPS.impl("decode_attn", _decode_attn, "CPU")


@torch.library.register_fake("agentmem::decode_attn")
def _(q, k_pool, v_pool, idx, keep):
    return torch.empty_like(q)
