"""Which of the CPU libraries' layer kernels a model's forward takes, chosen once when its
weights are packed (`Transformer.pack`, `Block.pack`) rather than tested in every forward.

model.py's `Block` and `Transformer` run the reference path (torch ops and the projections,
linear.py) and ask their `kernels` object first; it answers None where it does not take the
call, and the reference runs. What is chosen (`choose`) depends on what does not change after
packing: the rows' dtype (the model's), its device, which library loaded, the weights' GEMV
routes, and `AGENTMEM_FUSED_DECODE`. What still varies per call is checked per call: the rows
(decode or prefill, how many), whether the runner handed over the paged pool (`decode_pool`,
the kernel decode attention's), and the kernels' own input checks (`*_takes`).

- `Reference`: no library (CUDA, fp16, a CPU without the kernels): nothing is taken.
- `Bf16Rows`: bf16 rows with the AVX512-BF16 library (kernels/cpu_bf16.py): SiLU x up of
  more than one row in one C call, the residual joining down's product (`Proj.plus`).
- `Bf16Fused`: that, and decode rows of weights on the u8 or q4 route (int8 / int4 on
  AVX512-VNNI) fused: every layer of a step in one call (`layers_q8u8`) over the paged pool,
  else a layer in one (`layer_q8u8`), else its halves (`qkv_q8u8`: norm, qkv, RoPE; and
  `finish_q8u8`: o, residual, norm, gate/up, SiLU, down, residual). Same bits as the
  separate calls.
- `Fp32Rows`: fp32 rows with the AVX2 library (kernels/cpu_fp32.py): its SiLU x up (the bits
  its fused layer computes).
- `Fp32Fused`: that, and decode rows of weights on its int8 (`avx2`) or 4-bit (`q4`) route
  fused: every layer of a step in one call (`layers_q8`), else a layer in one (`layer_q8`).

AGENTMEM_FUSED_DECODE=off keeps the separate calls (a kernel A/B switch, read when a model is
packed, as AGENTMEM_ATTN_KERNEL and AGENTMEM_GEMV are in cpu_bf16): `Bf16Rows` / `Fp32Rows`.
"""

from __future__ import annotations

import ctypes

import torch

from ..config import engine_switch
from .kernels import cpu_bf16, cpu_fp32


def fused_setting() -> bool:
    """Whether AGENTMEM_FUSED_DECODE lets decode rows take the fused layer calls."""
    return engine_switch("FUSED_DECODE") != "off"


class Reference:
    """Nothing taken: every call runs model.py's reference path."""

    name = "reference"

    def step(self, model, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], attn) -> torch.Tensor | None:
        """Every layer of a step (`Transformer.forward`'s loop) in one call, or None."""
        return None

    def layer(self, block, h: torch.Tensor, positions: torch.Tensor, rotary, attn,
              cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
        """`Block.forward` in fewer calls, or None."""
        return None

    def finish(self, block, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor | None:
        """`Block.finish` in one call, or None."""
        return None

    def mlp(self, block, h: torch.Tensor, gu: torch.Tensor) -> torch.Tensor | None:
        """h + down(silu(gate) * up) from the fused gate/up rows gu, or None."""
        return None

    def __repr__(self) -> str:
        return self.name


class _Library(Reference):
    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib


def _rows(gu: torch.Tensor) -> bool:
    """Rows the libraries' SiLU x up takes: [N, 2I] on the CPU, each row contiguous."""
    return gu.device.type == "cpu" and gu.dim() == 2 and gu.stride(1) == 1 and not torch.compiler.is_compiling()


class Bf16Rows(_Library):
    """bf16 rows on the AVX512-BF16 library, the layers' calls separate."""

    name = "bf16 rows"

    def mlp(self, block, h: torch.Tensor, gu: torch.Tensor) -> torch.Tensor | None:
        if gu.dtype != torch.bfloat16 or gu.shape[0] <= 1 or not _rows(gu):
            return None
        # one C call, bit-identical (Zen 4 VM, 2 threads: 2,048 rows 0.95 against 2.14 ms, 320 rows
        # 0.14 against 0.25, 8 rows 0.010 against 0.013; one row is faster through torch)
        return block.down_p.plus(h, cpu_bf16.silu_mul(self.lib, gu))


class Bf16Fused(Bf16Rows):
    """bf16 rows on the AVX512-BF16 library, decode rows of u8/q4 weights fused."""

    name = "bf16 fused"

    def step(self, model, h, cos_sin, attn):
        paged = None if torch.compiler.is_compiling() else getattr(attn, "decode_pool", None)
        if paged is None or h.shape[0] > cpu_bf16.MAX_FINISH_ROWS:
            return None
        return cpu_bf16.layers_q8u8(self.lib, model, h, *cos_sin, *paged)

    def layer(self, block, h, positions, rotary, attn, cos_sin):
        if h.shape[0] > cpu_bf16.MAX_FINISH_ROWS or block.q_norm is not None or torch.compiler.is_compiling():
            return None
        a = block.args
        cos, sin = cos_sin if cos_sin is not None else rotary.cos_sin(positions)
        if (paged := getattr(attn, "decode_pool", None)) is not None:
            # decode rows over the paged pool: the whole layer in one C call (same bits)
            pool, slots, idx, keep = paged
            out = cpu_bf16.layer_q8u8(self.lib, block, h, cos, sin, pool.k[block.idx], pool.v[block.idx],
                                      slots, idx, keep)
            if out is not None:
                return out
        if not cpu_bf16.qkv_takes(h, block.qkv_p, block.input_norm.weight, cos, a.head_dim):
            return None
        # decode rows: norm, qkv and the rotation of q and k in one C call (same bits)
        qk_end = a.n_heads + a.n_kv_heads
        qkv, qk = cpu_bf16.qkv_q8u8(self.lib, h, block.input_norm.weight, block.input_norm.eps, block.qkv_p,
                                    cos, sin, qk_end, a.head_dim)
        k, v = qkv[:, a.n_heads : qk_end], qkv[:, qk_end:]
        return block.finish(h, attn(block.idx, qk[:, : a.n_heads], k, qk[:, a.n_heads :], v))

    def finish(self, block, h, attn):
        projs = (block.o_p, block.gate_up_p, block.down_p)
        if (h.shape[0] > cpu_bf16.MAX_FINISH_ROWS or torch.compiler.is_compiling()
                or not cpu_bf16.finish_takes(h, attn, projs, block.post_norm.weight)):
            return None
        # decode rows: one C call and one team of threads for the seven steps (same bits)
        return cpu_bf16.finish_q8u8(self.lib, h, attn, *projs, block.post_norm.weight, block.post_norm.eps)


class Fp32Rows(_Library):
    """fp32 rows on the AVX2 library, the layers' calls separate."""

    name = "fp32 rows"

    def mlp(self, block, h: torch.Tensor, gu: torch.Tensor) -> torch.Tensor | None:
        if gu.dtype != torch.float32 or not _rows(gu):
            return None
        # the bits `cpu_fp32.layer_q8` computes (decode rows there)
        return h + block.down_p(cpu_fp32.silu_mul(self.lib, gu))


class Fp32Fused(Fp32Rows):
    """fp32 rows on the AVX2 library, decode rows of its int8 (avx2) or q4 weights fused."""

    name = "fp32 fused"

    def step(self, model, h, cos_sin, attn):
        paged = None if torch.compiler.is_compiling() else getattr(attn, "decode_pool", None)
        if paged is None or h.shape[0] > cpu_fp32.MAX_ROWS:
            return None
        # every layer in one C call (the per-layer call, without Python between the layers)
        return cpu_fp32.layers_q8(self.lib, model, h, *cos_sin, *paged)

    def layer(self, block, h, positions, rotary, attn, cos_sin):
        if (h.shape[0] > cpu_fp32.MAX_ROWS or (paged := getattr(attn, "decode_pool", None)) is None
                or torch.compiler.is_compiling()):
            return None
        # fp32 decode rows: the whole layer in one C call
        cos, sin = cos_sin if cos_sin is not None else rotary.cos_sin(positions)
        pool, slots, idx, keep = paged
        return cpu_fp32.layer_q8(self.lib, block, h, cos, sin, pool.k[block.idx], pool.v[block.idx], slots, idx, keep)


REFERENCE = Reference()

_U8_ROUTES, _AVX2_ROUTES = {"u8", "q4"}, {"avx2", "q4"}


def _on(projs, routes: set[str]) -> bool:
    """Whether some projection's GEMV layout is on one of `routes` (linear.Proj.q8_route)."""
    return any(p is not None and p.fmt in ("int8", "int4") and p.w_gemv is not None and p.q8_route in routes
               for p in projs)


def choose(weight: torch.Tensor, projs, fused: bool | None = None) -> Reference:
    """The kernels for rows in `weight`'s dtype and device (a norm's: the model's) and these
    packed projections; `fused` (default: AGENTMEM_FUSED_DECODE) lets decode rows take the
    fused layer calls where the weights are on their routes."""
    fused = fused_setting() if fused is None else fused
    if weight.device.type != "cpu":
        return REFERENCE
    if weight.dtype == torch.bfloat16 and (lib := cpu_bf16.loaded()) is not None:
        return Bf16Fused(lib) if fused and _on(projs, _U8_ROUTES) else Bf16Rows(lib)
    if weight.dtype == torch.float32 and (lib := cpu_fp32.loaded()) is not None:
        return Fp32Fused(lib) if fused and _on(projs, _AVX2_ROUTES) else Fp32Rows(lib)
    return REFERENCE
