"""Attention and RoPE for the engine's hot paths: Triton kernels on CUDA, torch elsewhere.

Each dispatcher validates its input once (so a bad call fails with a clear ValueError, not
deep inside a kernel), then runs the Triton kernel when every tensor is on CUDA and triton
imports, else the torch reference. Callers never choose: the same call serves the CPU tests
and the GPU engine. The references are exported too, as the oracle for tests.
"""

from __future__ import annotations

import functools

import torch

from .reference import paged_decode_attention_ref, rope_ref, selected_attention_ref

__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "rope",
    "rope_ref",
    "selected_attention",
    "selected_attention_ref",
    "triton_available",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def triton_available() -> bool:
    """Whether the Triton kernels can be imported (triton installed and working)."""
    try:
        from . import triton_ops  # noqa: F401
    except Exception:  # any import failure means: use the torch path
        return False
    return True


def _on_triton(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors) and triton_available()


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    _require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    _require(t.dtype in _FLOATS, f"{name} must be float32/bfloat16/float16, got {t.dtype}")


def _check_index(name: str, t: torch.Tensor, length: int) -> None:
    _require(not t.is_floating_point() and not t.is_complex(), f"{name} must be an integer tensor, got {t.dtype}")
    _require(t.dim() == 1 and t.shape[0] == length, f"{name} must have shape ({length},), got {tuple(t.shape)}")


def _check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    _require(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_gqa(heads: int, kv_heads: int) -> None:
    _require(kv_heads > 0 and heads % kv_heads == 0, f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, hd] to `positions` [N] in the HF rotate-half convention.

    Positions are arbitrary, so this also moves cached pre-RoPE keys to new positions.
    `inv_freq` [hd/2] may be fp32 or float64 (pass `Rotary.inv_freq`, float64, to match the
    engine's tables to rounding); the angle is always formed in float64.
    """
    _check_float("x", x, 3)
    _require(x.shape[-1] % 2 == 0, f"head_dim must be even, got {x.shape[-1]}")
    _check_index("positions", positions, x.shape[0])
    _require(
        inv_freq.dim() == 1 and inv_freq.shape[0] == x.shape[-1] // 2,
        f"inv_freq must have shape ({x.shape[-1] // 2},), got {tuple(inv_freq.shape)}",
    )
    _check_device(x, positions)
    if _on_triton(x, positions):
        from . import triton_ops

        # keep inv_freq on the device to spare this copy
        return triton_ops.rope(x, positions, inv_freq.to(x.device))
    return rope_ref(x, positions, inv_freq)


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention of one query per sequence over the paged KV pool.

    q [B,H,hd] is the token at position seq_len-1 (its K/V already in the pool);
    k_pool/v_pool [num_blocks, block_size, KV, hd]; block_tables int [B, max_blocks];
    seq_lens int [B]. Keys 0..seq_len-1 of sequence b live in block
    block_tables[b, j // block_size], slot j % block_size. Returns [B,H,hd] in q's dtype.
    """
    _check_float("q", q, 3)
    _check_float("k_pool", k_pool, 4)
    _require(v_pool.shape == k_pool.shape, f"v_pool shape {tuple(v_pool.shape)} != k_pool {tuple(k_pool.shape)}")
    _require(k_pool.dtype == q.dtype == v_pool.dtype, "q, k_pool and v_pool must share a dtype")
    _require(k_pool.shape[-1] == q.shape[-1], f"head_dim of q ({q.shape[-1]}) != pool ({k_pool.shape[-1]})")
    _check_gqa(q.shape[1], k_pool.shape[2])
    _require(
        block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0] and not block_tables.is_floating_point(),
        f"block_tables must be an integer [B={q.shape[0]}, max_blocks] tensor, got {tuple(block_tables.shape)}",
    )
    _check_index("seq_lens", seq_lens, q.shape[0])
    _check_device(q, k_pool, v_pool, block_tables, seq_lens)
    if _on_triton(q, k_pool, v_pool, block_tables, seq_lens):
        from . import triton_ops

        return triton_ops.paged_decode_attention(q, k_pool, v_pool, block_tables, seq_lens, scale)
    return paged_decode_attention_ref(q, k_pool, v_pool, block_tables, seq_lens, scale)


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of any subset of query positions against a full K/V, exact causal by position.

    q [Nq,H,hd] at q_pos [Nq]; k/v [Nk,KV,hd] at k_pos [Nk]; query i sees key j iff
    k_pos[j] <= q_pos[i]. CacheBlend recomputes only selected tokens with it; a plain
    prefill is the case where every token is selected. Returns [Nq,H,hd] in q's dtype.
    """
    _check_float("q", q, 3)
    _check_float("k", k, 3)
    _require(v.shape == k.shape, f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    _require(k.dtype == q.dtype == v.dtype, "q, k and v must share a dtype")
    _require(k.shape[-1] == q.shape[-1], f"head_dim of q ({q.shape[-1]}) != k ({k.shape[-1]})")
    _check_gqa(q.shape[1], k.shape[1])
    _check_index("q_pos", q_pos, q.shape[0])
    _check_index("k_pos", k_pos, k.shape[0])
    _check_device(q, k, v, q_pos, k_pos)
    if _on_triton(q, k, v, q_pos, k_pos):
        from . import triton_ops

        return triton_ops.selected_attention(q, k, v, q_pos, k_pos, scale)
    return selected_attention_ref(q, k, v, q_pos, k_pos, scale)
