"""A projection's weight in the form this machine multiplies fastest, and the choice of form.

`AGENTMEM_WEIGHTS` names the format of every projection weight (q/k/v, o, gate/up, down and
the LM head); norms, embeddings, attention and the KV cache stay in the engine dtype:

- `fp32` / `bf16`: dense. On a CPU with native bf16 (AVX512-BF16/AMX) a bf16 weight is
  packed once into oneDNN's blocked layout: one decode row then runs 2-3x faster than
  `F.linear` on the plain weight (which repacks it at every call), and a 2k-row prefill is no
  slower. Up to `cpu_bf16.MAX_ROWS` rows (decode) the product is the engine's own AVX512-BF16
  kernel over its own packed copy instead (kernels/cpu_bf16.py; ~30% faster over a token,
  and 8 rows cost little more than one). fp32
  keeps a transposed copy for few-row products (see `DenseProj`).
- `int8`: weight-only int8, one scale per output channel (symmetric), activations in the
  engine dtype (`_weight_int8pack_mm`): half the bytes of bf16 per decode step. Up to
  `cpu_bf16.MAX_ROWS` rows on AVX512-BF16, the engine's int8 kernel instead (the weights
  widened to bf16 in registers, then as the bf16 kernel; a whole token 6.4 ms against 8.5
  for bf16 and 9.8 for `_weight_int8pack_mm` at one row, 9.1 / 10.7 / 26.4 at eight), and
  more rows (prefill) through a bf16 copy packed for oneDNN at the first such call: with the
  kernels int8 buys decode speed, not memory. (fbgemm's
  int8 x int8 product, which also quantizes each activation row, ran 2x faster per row but
  raised SmolLM2's perplexity by 15%: the activations have outlier channels.) On an AVX2-only
  CPU (fp32 engine) up to `cpu_fp32.PRODUCT_MAX_ROWS` (48; any number on AVX512-VNNI) rows take
  `kernels/cpu_fp32.py`'s product (the rows quantized to int16 with a scale each, `vpmaddwd`, or
  `vpdpwssd` on a CPU with AVX512-VNNI but no AVX512-BF16), more rows a transposed fp32 copy of
  the dequantized weight: on a Zen 3 VM a token's products 9 ms against 48 for fp32 (`torch.mm`)
  and 114 for `_weight_int8pack_mm`.
- `int4`: 4-bit weights in groups of 32 along the input, each group with its own scale and
  minimum. On AVX512-VNNI (the u8 route's CPUs) in llama.cpp's Q4_1 form (`cpu_bf16.pack_q4`:
  w = d q + m, d and m fp16, q in 0..15), multiplied by the `q4` kernel for few rows (the rows
  quantized to int8 as on the u8 route) and by a dequantized bf16 copy for many, like int8
  (`AGENTMEM_Q4_ROWS=kernel` takes the kernel for many rows too: faster, and fewer answers
  right in `bench memory`, `resolve_q4_rows`). A
  model read from a Q4_1 GGUF (the default one) is held exactly so: its groups' smallest and
  largest values are m and m + 15 d, so the file's own 4-bit weights come back bit for bit (tested
  on the shipped model), where int8's one scale a row rounds them. Half int8's bytes a decode
  step: on a 2-core Zen 4 VM one stream 156-180 -> 207-238 tok/s, while eight streams, bound by
  `vpdpbusd` rather than memory, stay where int8's are (836-1,044 against 875-1,031 tok/s in two
  A/Bs; 2026-11-28). With fp32 rows (AVX2) the AVX2 library's q4 product (`vpmaddubsw`) takes
  up to `cpu_fp32.Q4_MAX_ROWS` rows, an fp32 copy more. The LM head stays int8 under int4 (model.py). Elsewhere
  `_weight_int4pack_mm_for_cpu` (groups with a scale and an offset: perplexity +3.8% over bf16
  when it was measured, docs/engine.md).

`auto` (the default) takes, per machine, the faster measured format of those whose quality
the benchmark accepted: fp32 or bf16 (the engine dtype) and int8, and int4 in int8's place for a
model whose projections are 4-bit already (`is_four_bit`: nothing is lost) where its one-row
product is faster still (`pick_weights`). int8 is taken where a one-row
product of the model's widest projection runs faster (over cold weights, as a decode streams
them) and a 512-row one (prefill) at most 1.15x slower (`fastest`); measured once and cached
under the cache dir, keyed by the CPU flags, the torch version and the kernels. An explicit `--dtype float32` (the
exactness the tests need) keeps dense fp32 weights under `auto`.

int8 and int4 are CPU formats; on CUDA they are refused.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from .kernels import cpu_bf16, cpu_fp32
from .measured import cpu_flags, remembered, simd_flags

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
_DENSE = {"fp32": torch.float32, "bf16": torch.bfloat16}
INT4_GROUP = 32

# Up to this many rows the product with the weight stored transposed ([in, out]) is faster
# with MKL on the CPU in fp32: ~1.5-2x for one row (decode), 5-20% for 24-320 rows (the blend
# probe's question rows, a blend's recomputed rows), while at 2k rows (a full prefill) the
# [out, in] layout is ~3% ahead (interleaved A/B, 2-core AMD EPYC, qkv and gate/up shapes).
TRANSPOSED_MAX_ROWS = 512


def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bf16 natively here (AVX512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


class Proj:
    """x @ w.T (+ bias) for x [N, in] in the dtype of x, with the weight w [out, in] held in
    format `fmt` (one of WEIGHT_FORMATS). One subclass a format, built by `make_proj` once at
    load: `DenseProj` (fp32, and bf16 off a native-bf16 CPU), `Bf16Proj`, `Int8Proj`, `Int4Proj`.
    `out_features` and `fmt` say what it is; the tensors it keeps depend on the format and the
    device. Every class has the fields the planners and hugepages.py read (`w_gemv`, `scale`,
    `packed`, `q8_route`, `rows_math`, `q4_rows`, `_prefill_w`), None or their default where the
    format has no such thing."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                 transposed_max_rows: int = TRANSPOSED_MAX_ROWS):
        self.out_features, self.in_features = w.shape
        self.fmt = fmt
        self.bias = bias
        self.max_rows = transposed_max_rows
        self.w: torch.Tensor | None = None
        self.w_gemv: torch.Tensor | None = None  # the GEMV kernel's layout (cpu_bf16.pack)
        self.scale: torch.Tensor | None = None
        self.q8_route = "bf16"  # int8: how the GEMV multiplies this weight (cpu_bf16.q8_route when built)
        self._prefill_w: torch.Tensor | None = None  # int8/int4 with the kernels: the bf16 weight for many rows
        self.w_t: torch.Tensor | None = None
        self.packed = None
        self._key: torch.Tensor | None = None
        # how a bf16 product of many rows multiplies on the CPU ("bf16": oneDNN; "fp32": the
        # activations and weight widened to fp32 for MKL's sgemm, the faster where oneDNN has
        # no native bf16 GEMM; see `rows_math`). Set for the whole model by Engine.load.
        self.rows_math = "bf16"
        # bf16 rows up to which int4 weights (the q4 route) multiply on the engine's own kernel,
        # past the decode rows (`resolve_q4_rows`; set for the whole model by Engine.load)
        self.q4_rows = cpu_bf16.MAX_ROWS

    @property
    def key(self) -> torch.Tensor:
        """This projection as a tensor argument of `agentmem::proj` (compiled code cannot take a
        oneDNN-packed weight as an input; one graph serves every layer through the key)."""
        if self._key is None:
            _REGISTRY[len(_REGISTRY)] = weakref.ref(self)
            self._key = torch.tensor(len(_REGISTRY) - 1)
        return self._key

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.agentmem.proj(x, self.key, self.out_features)
        return self.multiply(x)

    def multiply(self, x: torch.Tensor, out_dtype: torch.dtype | None = None,
                 residual: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x @ W.T (+ bias). `out_dtype` (fp32 for bf16 rows: the LM head's logits) is honoured
        where the engine's own kernels run the product, which then store their fp32 sums as they
        are instead of rounding them to bf16; elsewhere the result is in the rows' dtype.
        `residual` (`plus`'s): a one-element list whose tensor a oneDNN product adds inside it,
        emptying the list; every other route leaves it there for the caller to add."""
        raise NotImplementedError

    def plus(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """h + x @ W.T (+ bias): a layer's residual added to its o or down product. Where many
        bf16 rows multiply in oneDNN (`multiply` takes `_onednn` for them), the sum is its
        binary post-op: the residual joins the fp32 sums before the one rounding to bf16, as the
        decode kernels add it in their product's store, and no separate pass reads and writes
        the [N, dim] rows again (2,048 rows x 1,536 -> 576, AMX Xeon VM: 2.26-2.60 ms against
        2.45-2.75 for the product and the add, mean error against fp64 0.044 against 0.059).
        Elsewhere h + multiply(x). `multiply` routes the product as always: the residual rides
        along and only `_onednn` takes it."""
        if (torch.compiler.is_compiling() or not h.dtype == x.dtype == torch.bfloat16
                or h.shape != (x.shape[0], self.out_features)):
            return h + self(x)
        pending = [h]
        out = self.multiply(x, residual=pending)
        return h + out if pending else out


class DenseProj(Proj):
    """A dense weight as it is (fp32; bf16 on a CPU without native bf16, or off the CPU), with a
    transposed copy for few rows on the CPU (TRANSPOSED_MAX_ROWS) and, for a few fp32 rows, the
    AVX2 library's fp32 product (`cpu_fp32.F32_MAX_ROWS`)."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                 transposed_max_rows: int = TRANSPOSED_MAX_ROWS):
        super().__init__(w, bias, fmt, transposed_max_rows)
        self.w = w
        if w.device.type == "cpu" and transposed_max_rows > 0:
            self.w_t = w.t().contiguous()

    def multiply(self, x: torch.Tensor, out_dtype: torch.dtype | None = None,
                 residual: list[torch.Tensor] | None = None) -> torch.Tensor:
        if (x.dtype == torch.float32 and x.shape[0] <= cpu_fp32.F32_MAX_ROWS and self.w.device.type == "cpu"
                and (lib := cpu_fp32.f32_kernel()) is not None
                and (out := cpu_fp32.gemm_f32(lib, self.w, x, self.bias)) is not None):
            return out  # a few fp32 rows on fp32 weights: decode, a blend's probe (cpu_fp32.F32_MAX_ROWS)
        if self.w_t is not None and x.shape[0] <= self.max_rows:
            return torch.mm(x, self.w_t) if self.bias is None else torch.addmm(self.bias, x, self.w_t)
        return F.linear(x, self.w, self.bias)


class Bf16Proj(Proj):
    """A bf16 weight on a CPU with native bf16 (`onednn_bf16`), packed once into oneDNN's blocked
    layout for many rows, and into the engine's GEMV layout for up to `cpu_bf16.MAX_ROWS`
    (decode) where that library loaded."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                 transposed_max_rows: int = TRANSPOSED_MAX_ROWS):
        super().__init__(w, bias, fmt, transposed_max_rows)
        self.w_plain = w  # the model keeps its dense weights: no copy (rows_math fp32 widens it)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
        if cpu_bf16.loaded() is not None and cpu_bf16.usable(w):  # few rows: the GEMV kernel
            self.w_gemv = cpu_bf16.pack(w)

    def multiply(self, x: torch.Tensor, out_dtype: torch.dtype | None = None,
                 residual: list[torch.Tensor] | None = None) -> torch.Tensor:
        if self.w_gemv is not None and x.shape[0] <= cpu_bf16.MAX_ROWS and (lib := cpu_bf16.loaded()):
            return cpu_bf16.gemv(lib, self.w_gemv, x, self.bias, out_dtype)
        if self.rows_math == "fp32":
            return _widened(x, self.w_plain, self.bias)
        return _onednn(x, self.packed, self.bias, residual)


class _Compact(Proj):
    """What int8 and int4 share: the dense copies they multiply many rows by, made at the first
    such call (with the kernels int8 and int4 buy decode speed, not memory)."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                 transposed_max_rows: int = TRANSPOSED_MAX_ROWS):
        if w.device.type != "cpu":
            raise ValueError(f"weights {fmt!r} run on the CPU only; on {w.device.type} use bf16 or fp32")
        super().__init__(w, bias, fmt, transposed_max_rows)
        self._rows_w_t: torch.Tensor | None = None  # the fp32 weight [in, out] for many fp32 rows

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [out, in] this projection holds."""
        raise NotImplementedError

    def _many_rows(self, x: torch.Tensor, residual: list[torch.Tensor] | None = None) -> torch.Tensor:
        """bf16 rows past the kernels' (prefill) for int8 or int4 weights: the dequantized weight
        in bf16, oneDNN-packed once at the first such call and kept (512 rows of the widest
        projection: 4.2 ms so, 4.6 dequantizing at every call, which cost a short prompt ~40 ms a
        forward, and 12.6 through `_weight_int8pack_mm`). So with the kernels int8 and int4 are
        speed formats, not memory ones: the compact weights for decode, bf16 for prefill."""
        if self._prefill_w is None:
            w = self.dequantized().to(torch.bfloat16)
            pack = onednn_bf16() and self.rows_math == "bf16"
            self._prefill_w = torch.ops.mkldnn._reorder_linear_weight(w, 1) if pack else w
        if self.rows_math == "fp32":
            return _widened(x, self._prefill_w, self.bias)
        if onednn_bf16():
            return _onednn(x, self._prefill_w, self.bias, residual)
        return F.linear(x, self._prefill_w, self.bias)

    def _fp32_rows(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 rows past the AVX2 kernels' for int8 or int4 (q4) weights: the dequantized weight
        in fp32, transposed as the dense fp32 format keeps it, made at the first such call."""
        if self._rows_w_t is None:
            self._rows_w_t = self.dequantized().t().contiguous()
        return torch.mm(x, self._rows_w_t) if self.bias is None else torch.addmm(self.bias, x, self._rows_w_t)


class Int8Proj(_Compact):
    """Weight-only int8, one scale per output channel (symmetric). Few rows on the engine's int8
    GEMV: bf16 rows on the AVX-512 library's route for this machine (`q8_route`: u8, i16 or bf16,
    `cpu_bf16.choose_q8`), fp32 rows on the AVX2 library's (`avx2`); many rows on a dense copy
    (`_many_rows`, `_fp32_rows`); torch's `_weight_int8pack_mm` without a library."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, fmt: str = "int8",
                 transposed_max_rows: int = TRANSPOSED_MAX_ROWS):
        super().__init__(w, bias, fmt, transposed_max_rows)
        wf = w.float()
        self.scale = (wf.abs().amax(dim=1) / 127).clamp(min=1e-12)
        self.packed = (wf / self.scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        if cpu_bf16.loaded() is not None and cpu_bf16.fits(w):  # few rows: the int8 kernel
            # the route chosen for this machine, kept: the layout is built for it
            self.q8_route = cpu_bf16.q8_route
            if self.q8_route == "u8" and not cpu_bf16.fits_u8(w):
                self.q8_route = "i16" if cpu_bf16.vnni() else "bf16"
            u8 = self.q8_route == "u8"
            self.w_gemv = cpu_bf16.pack_u8(self.packed) if u8 else cpu_bf16.pack(self.packed)
        elif cpu_fp32.loaded() is not None and cpu_bf16.fits(w):  # AVX2 only: fp32 rows on int16
            self.q8_route = "avx2"
            self.w_gemv = cpu_bf16.pack(self.packed)

    def dequantized(self) -> torch.Tensor:
        return self.packed.float() * self.scale[:, None]

    def multiply(self, x: torch.Tensor, out_dtype: torch.dtype | None = None,
                 residual: list[torch.Tensor] | None = None) -> torch.Tensor:
        if self.q8_route == "avx2" and x.dtype == torch.float32:
            # few rows through cpu_fp32's kernel; more (prefill, a blend's recomputed rows)
            # through an fp32 copy of the dequantized weight
            if x.shape[0] <= cpu_fp32.PRODUCT_MAX_ROWS and (lib := cpu_fp32.loaded()):
                return cpu_fp32.gemv_q8(lib, self.w_gemv, self.scale, x, self.bias)
            return self._fp32_rows(x)
        if self.w_gemv is not None and x.dtype == torch.bfloat16:
            if x.shape[0] <= cpu_bf16.MAX_ROWS and (lib := cpu_bf16.loaded()):
                return cpu_bf16.gemv_int8(lib, self.w_gemv, self.scale, x, self.bias, out_dtype,
                                          i16=self.q8_route == "i16")
            return self._many_rows(x, residual)
        out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.packed, self.scale.to(x.dtype))
        return out if self.bias is None else out + self.bias


class Int4Proj(_Compact):
    """4-bit weights in groups of INT4_GROUP inputs. Where a q4 kernel runs (bf16 rows on
    AVX512-VNNI, fp32 rows on AVX2) in llama.cpp's Q4_1 form (`q8_route` "q4", `cpu_bf16.pack_q4`:
    `w_gemv` the nibbles, `scale` the groups' fp16 d and m), few rows on the kernel (bf16 rows up
    to `q4_rows`) and more on a dense copy; elsewhere torch's `_weight_int4pack_mm_for_cpu`."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, fmt: str = "int4",
                 transposed_max_rows: int = TRANSPOSED_MAX_ROWS):
        super().__init__(w, bias, fmt, transposed_max_rows)
        if cpu_bf16.fits_u8(w) and (q4_kernel(torch.bfloat16) or q4_kernel(torch.float32)):
            self.q8_route = "q4"
            self.w_gemv, self.scale = cpu_bf16.pack_q4(w)
        else:
            self.packed, self.scales_zeros = _int4_pack(w)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [out, in] of the q4 layout."""
        return cpu_bf16.unpack_q4(self.w_gemv, self.scale)

    def multiply(self, x: torch.Tensor, out_dtype: torch.dtype | None = None,
                 residual: list[torch.Tensor] | None = None) -> torch.Tensor:
        if self.q8_route != "q4":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, INT4_GROUP,
                                                             self.scales_zeros.to(x.dtype))
            return out if self.bias is None else out + self.bias
        if x.dtype == torch.bfloat16:
            if x.shape[0] <= self.q4_rows and (lib := cpu_bf16.loaded()):
                return cpu_bf16.gemv_q4(lib, self.w_gemv, self.scale, x, self.bias, out_dtype)
            return self._many_rows(x, residual)
        if x.dtype == torch.float32 and x.shape[0] <= cpu_fp32.Q4_MAX_ROWS and (lib := cpu_fp32.loaded()):
            return cpu_fp32.gemv_q4(lib, self.w_gemv, self.scale, x, self.bias)
        return self._fp32_rows(x)


def make_proj(w: torch.Tensor, bias: torch.Tensor | None = None, fmt: str | None = None,
              transposed_max_rows: int = TRANSPOSED_MAX_ROWS) -> Proj:
    """The projection of weight w [out, in] (+ bias) in format `fmt` (default: w's own dtype),
    of the class this machine multiplies that format with: what `Block.pack` and
    `Transformer.pack` hold. int8 and int4 are refused off the CPU."""
    fmt = fmt or {torch.bfloat16: "bf16"}.get(w.dtype, "fp32")
    if fmt == "int8":
        return Int8Proj(w, bias, fmt, transposed_max_rows)
    if fmt == "int4":
        return Int4Proj(w, bias, fmt, transposed_max_rows)
    if w.device.type == "cpu" and w.dtype == torch.bfloat16 and onednn_bf16():
        return Bf16Proj(w, bias, fmt, transposed_max_rows)
    return DenseProj(w, bias, fmt, transposed_max_rows)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
            residual: list[torch.Tensor] | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for a weight oneDNN packed (`_reorder_linear_weight`), plus the tensor
    in `residual` where one is pending (`Proj.plus`; taken out of the list)."""
    if residual:
        return _onednn_plus(residual.pop(), x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _onednn_plus(h: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """h + x @ w.T (+ bias) for a oneDNN-packed weight, the add a post-op of the product."""
    return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), h.contiguous(), packed, bias, "add")


def _widened(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ bias) for bf16 x and w, multiplied in fp32 (MKL's sgemm) and rounded to bf16:
    the same fp32 sums as a native bf16 GEMM, in another order. Widening the weight at each call
    costs ~3% of a 512-row product (0.09 ms for 576 x 1536), so no fp32 copy is kept."""
    out = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    return out.to(torch.bfloat16)


_REGISTRY: dict[int, weakref.ref[Proj]] = {}


# a plain library op rather than torch.library.custom_op: 5 us per call over the product itself
# instead of 11 (one-row bf16 product, 1 thread), and decode makes four per layer
_LIB = torch.library.Library("agentmem", "DEF")
_LIB.define("proj(Tensor x, Tensor key, int out_features) -> Tensor")


def _proj(x: torch.Tensor, key: torch.Tensor, out_features: int) -> torch.Tensor:
    return _REGISTRY[int(key)]().multiply(x)


_LIB.impl("proj", _proj, "CPU")
_LIB.impl("proj", _proj, "CUDA")


@torch.library.register_fake("agentmem::proj")
def _(x: torch.Tensor, key: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _int4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of INT4_GROUP inputs: w ~ (q - 8) * scale + zero, q in 0..15."""
    out_f, in_f = w.shape
    if in_f % INT4_GROUP:
        raise ValueError(f"int4 needs the input width ({in_f}) to be a multiple of {INT4_GROUP}")
    g = w.float().view(out_f, in_f // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = lo + 8 * scale
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(out_f, in_f)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [in/g, out, 2]
    return packed, scales_zeros


def dense(p: Proj) -> torch.Tensor:
    """The weight [out, in] this projection multiplies by, as a dense tensor of x's dtype for
    fp32/bf16 and dequantized (fp32) otherwise: what the quality checks compare."""
    eye = torch.eye(p.in_features, dtype=torch.float32 if p.fmt in ("fp32", "int8") else torch.bfloat16)
    bias, p.bias = p.bias, None
    try:
        return p(eye).float().t().contiguous()
    finally:
        p.bias = bias


# --- the choice -----------------------------------------------------------------------------
def resolve_weights(name: str, dtype: torch.dtype, dtype_explicit: bool, device: torch.device,
                    shape: tuple[int, int], cache_dir: Path, rows_math: str = "bf16",
                    four_bit: Callable[[], bool] = lambda: False) -> str:
    """The weight format for `AGENTMEM_WEIGHTS=name` with engine dtype `dtype`; `four_bit()`: the
    model's projections are 4-bit weights already (`is_four_bit`), so int4 loses nothing (asked
    only where int4 could be taken: the check reads the model's weights)."""
    own = "bf16" if dtype == torch.bfloat16 else "fp32"
    if name != "auto":
        if name not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be auto or one of {', '.join(WEIGHT_FORMATS)}, got {name!r}")
        if name in _DENSE and _DENSE[name] != dtype and dtype_explicit:
            raise ValueError(f"weights {name!r} contradict dtype {str(dtype).removeprefix('torch.')}: "
                             "leave one of them auto")
        return name
    if device.type != "cpu" or (dtype_explicit and dtype == torch.float32) or dtype == torch.float16:
        return own
    return fastest(own, shape, cache_dir, rows_math, four_bit)


def q4_kernel(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether int4 weights multiply few rows of `dtype` on a q4 kernel here: bf16 rows on
    AVX512-VNNI (cpu_bf16), fp32 rows on AVX2 (cpu_fp32)."""
    if dtype == torch.bfloat16:
        return cpu_bf16.loaded() is not None and cpu_bf16.vnni()
    return dtype == torch.float32 and cpu_fp32.loaded() is not None


def is_four_bit(weights: list[torch.Tensor]) -> bool:
    """Whether these weights (the model's, in its dtype) are 4-bit groups already, as a Q4_1
    GGUF's are: the q4 layout (`cpu_bf16.pack_q4`) gives every one back exactly once rounded to
    its dtype, where any other weight moves by up to half a group step. (A bf16 copy of a Q4_1
    file's weights passes: llama.cpp took each group's minimum and maximum from the original bf16
    weights, so in bf16 they are those weights again, and d and m come back from them.)"""
    for w in weights:
        if not cpu_bf16.fits_u8(w):
            return False
        if not torch.equal(cpu_bf16.unpack_q4(*cpu_bf16.pack_q4(w)).to(w.dtype), w):
            return False
    return True


def pick_weights(record: dict, own: str, four_bit: Callable[[], bool]) -> str:
    """The format `fastest` takes from its measurement `record`: its choice between `own` and
    int8, or int4 where int8 was taken (a compact format pays here), int4's one-row product ran
    faster still (its many rows multiply the same bf16 copy) and the model is `four_bit()`."""
    choice = record["weights"]
    times = record.get("one_row_us", {})
    if choice == "int8" and "int4" in times and times["int4"] < times["int8"] and four_bit():
        return "int4"
    return choice


def kernels_tag() -> str:
    """Which CPU kernels this process runs (the AVX-512 library, the AVX2 one or none), by their
    source's hash: part of every key a measurement of them is remembered under."""
    return (cpu_bf16.tag() if cpu_bf16.loaded() is not None
            else cpu_fp32.tag() if cpu_fp32.loaded() is not None else "no kernels")


def fastest(own: str, shape: tuple[int, int], cache_dir: Path, rows_math: str = "bf16",
            four_bit: Callable[[], bool] = lambda: False) -> str:
    """`own` or int8: int8 only where it runs a one-row product of `shape` [out, in] (decode,
    cold weights) faster here and a PREFILL_ROWS-row one (prefill) at most PREFILL_SLACK
    slower; measured once
    per (CPU flags, torch, shape, threads, kernels) and remembered in `cache_dir`. Decode alone
    does not decide: on the EPYC VM the int8 kernel decoded 85 tok/s against bf16's 69-75,
    but torch's int8 product had taken a 2,048-token prefill from 834 to 465 tok/s (many rows
    now dequantize to bf16 for the call instead)."""
    key = f"{torch.__version__}|{shape}|{own}|{torch.get_num_threads()} threads|{simd_flags()}|{kernels_tag()}"
    if rows_math != "bf16":  # prefill multiplies the way the engine will (resolve_rows_math)
        key += f"|rows {rows_math}"
    # int8's many rows multiply a dense copy of the dequantized weight wherever the kernels take
    # its few rows: fp32 on the AVX2 route (`Int8Proj._fp32_rows`), bf16 through oneDNN (or widened, as
    # rows_math says) with the AVX512-BF16 kernels (`Int8Proj._many_rows`). That is the same product as
    # the dense format's, so timing both would only compare noise: on a noisy 2-core VM, 32
    # against 40 ms once chose fp32 at 2.1x slower decode (Zen 3 VM, 2026-11-26), and 7.7 against
    # 6.5 ms chose bf16 at 0.56x int8's decode on a Zen 4 VM (2026-11-27)
    same_rows = cpu_bf16.fits_shape(shape) and ((own == "fp32" and cpu_fp32.loaded() is not None)
                                                or (own == "bf16" and cpu_bf16.loaded() is not None))
    if same_rows:
        key += f"|int8 rows on {'an' if own == 'fp32' else 'a'} {own} copy"

    q4 = q4_kernel(_DENSE[own]) and cpu_bf16.fits_shape(shape) and shape[1] % cpu_bf16.U8_BLOCK == 0
    if q4:  # int4 is timed too (taken only for a model whose weights are 4-bit: `pick_weights`)
        key += "|int4 on q4"

    def measure() -> dict:
        times = {fmt: one_row_seconds(fmt, shape) for fmt in (own, "int8", *(("int4",) if q4 else ()))}
        rows = {fmt: rows_seconds(_with_rows_math(fmt, shape, rows_math), shape, PREFILL_ROWS)
                for fmt in ((own,) if same_rows else (own, "int8"))}
        if same_rows:
            rows["int8"] = rows[own]
        choice = "int8" if times["int8"] < times[own] and rows["int8"] <= PREFILL_SLACK * rows[own] else own
        # to the nanosecond: rounded to 0.1 us, two one-row times that the rule told apart could
        # be written equal, and the file no longer showed why the choice was made (a CI run's test
        # read int8 chosen beside equal times)
        return {"weights": choice, "rule": RULE, "one_row_us": {k: round(v * 1e6, 3) for k, v in times.items()},
                f"rows_{PREFILL_ROWS}_us": {k: round(v * 1e6, 3) for k, v in rows.items()}}

    # a choice made by an earlier rule is made again
    record = remembered(cache_dir, "weights-choice.json", key, measure, lambda e: e.get("rule") == RULE)
    return pick_weights(record, own, four_bit)


PREFILL_ROWS = 512  # rows of the prefill product `fastest` times
PREFILL_SLACK = 1.15  # int8 may prefill this much slower than the engine dtype, if it decodes faster
RULE = f"cold decode, {PREFILL_ROWS} rows within {PREFILL_SLACK}x"  # the choice's rule, kept with it


ROWS_MATH = ("bf16", "fp32")
ROWS_MATH_GAIN = 1.10  # fp32 must run the 512-row product this much faster to be taken


def resolve_rows_math(name: str, dtype: torch.dtype, device: torch.device, shape: tuple[int, int],
                      cache_dir: Path) -> str:
    """How bf16 products of many rows (prefill, a blend's recomputed rows) multiply here, for
    `AGENTMEM_ROWS_MATH=name`: bf16 (oneDNN) or fp32 (widened for MKL's sgemm). `auto` times a
    512-row product of `shape` both ways, once per machine (remembered beside the weight
    choice), and takes fp32 where it is >= ROWS_MATH_GAIN faster. AVX512-BF16 alone does not
    make oneDNN's bf16 GEMM fast: on a 2-core Xeon VM with avx512_bf16 but no AMX it ran at
    166 GFLOP/s against sgemm's 314 (a prefill 470 against 776 tok/s), while on the AMD EPYC
    VMs (Zen 4/5) bf16 ran 1.3-2.5x faster than fp32. Only the product changes: norms,
    attention and the KV cache stay bf16, and the sums are fp32 either way."""
    if name not in ("auto", *ROWS_MATH):
        raise ValueError(f"rows_math must be auto or one of {', '.join(ROWS_MATH)}, got {name!r}")
    if device.type != "cpu" or dtype != torch.bfloat16:
        return "bf16" if name == "auto" else name
    if name != "auto":
        return name
    key = f"rows-math|{torch.__version__}|{shape}|{torch.get_num_threads()} threads|{simd_flags()}"

    def measure() -> dict:
        times = {}
        for math in ROWS_MATH:
            times[math] = min(rows_seconds(_with_rows_math("bf16", shape, math), shape, PREFILL_ROWS) for _ in range(2))
        choice = "fp32" if times["fp32"] * ROWS_MATH_GAIN < times["bf16"] else "bf16"
        return {"rows_math": choice, f"rows_{PREFILL_ROWS}_us": {k: round(v * 1e6, 1) for k, v in times.items()}}

    return remembered(cache_dir, "weights-choice.json", key, measure)["rows_math"]


Q4_ROWS = ("dense", "kernel")
Q4_ROWS_ALL = 1 << 30  # "kernel": any number of rows


def resolve_q4_rows(name: str) -> int:
    """Up to how many bf16 rows int4 weights multiply on the engine's own 4-bit kernel
    (`Proj.q4_rows`), for `AGENTMEM_Q4_ROWS=name`: dense (the default: the decode rows only,
    `cpu_bf16.MAX_ROWS`; more, as a prefill's, multiply a bf16 copy of the weights on oneDNN) or
    kernel (any number: the rows quantized to int8 per 64 inputs, as decode's are).

    The kernel is the faster way on the Zen 4 VM at every size (2026-11-29, one layer's four
    products: 24 rows 0.44 against 0.62 ms, 512 rows 8.0 against 8.7; a 2,048-token prefill
    ~10% faster, a 350-token prompt ~20%), and perplexity did not move (8.4147 -> 8.4042 on 512
    tokens). But `bench memory` answered fewer questions with it on each of five workload
    seeds (122 against 133 of 240): a prompt's rows quantized to int8 cost answers that a
    token's perplexity does not show. So it is not the default, and not chosen by timing."""
    if name not in Q4_ROWS:
        raise ValueError(f"q4_rows must be one of {', '.join(Q4_ROWS)}, got {name!r}")
    return Q4_ROWS_ALL if name == "kernel" else cpu_bf16.MAX_ROWS


def _with_rows_math(fmt: str, shape: tuple[int, int], rows_math: str) -> Proj:
    p = make_proj(torch.randn(shape).to(_timing_dtype(fmt)), fmt=fmt)
    p.rows_math = rows_math
    return p


def _timing_dtype(fmt: str) -> torch.dtype:
    """The activations' dtype a format is timed with: its own for dense, the engine's otherwise."""
    return torch.bfloat16 if fmt == "bf16" or (fmt != "fp32" and onednn_bf16()) else torch.float32


def rows_seconds(fmt: str | Proj, shape: tuple[int, int], rows: int, repeats: int = 3) -> float:
    """Best-of-`repeats` seconds (process CPU time) of one `rows`-row product in format `fmt`
    (or of the projection given)."""
    p = fmt if isinstance(fmt, Proj) else make_proj(torch.randn(shape).to(_timing_dtype(fmt)), fmt=fmt)
    x = torch.randn(rows, shape[1]).to(_timing_dtype(p.fmt))
    p(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        p(x)
        best = min(best, time.process_time() - t0)
    return best


COLD_BYTES = 128 << 20  # weights cycled through when timing a format: more than a CPU's last-level cache


def one_row_seconds(fmt: str, shape: tuple[int, int], repeats: int = 200) -> float:
    """Best-of-5 mean seconds (process CPU time, robust to a busy machine) of one-row products
    with random `shape` weights in format `fmt`, cycling through copies that together exceed
    the cache (COLD_BYTES as bf16), as a decode step streams every weight from memory: on one
    weight that stays in cache, int8's widening instructions outweighed its halved bytes
    (78-86 us against 62-75 for bf16 on the EPYC VM) while over a whole token it is 24% faster."""
    dtype = _timing_dtype(fmt)
    copies = max(2, min(256, -(-COLD_BYTES // (shape[0] * shape[1] * 2))))
    ps = [make_proj(torch.randn(shape).to(dtype), fmt=fmt) for _ in range(copies)]
    x = torch.randn(1, shape[1]).to(dtype)
    for p in ps:
        p(x)
    rounds = max(1, repeats // copies)
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(rounds):
            for p in ps:
                p(x)
        best = min(best, (time.process_time() - t0) / (rounds * copies))
    return best
