"""Torch references of the kernels: the CPU path of every dispatcher and the oracle the
Triton kernels are tested against. They favour exactness over speed (angles in float64,
softmax in fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, hd] to `positions` [N] (HF rotate-half convention).

    The angle position * inv_freq is formed in float64, like the engine's cos/sin table, so
    that large positions keep full fp32 accuracy; pass the float64 `inv_freq` of
    `Rotary` to reproduce `Rotary.apply` to rounding.
    """
    half = x.shape[-1] // 2
    angle = positions.to(torch.float64)[:, None] * inv_freq.to(device=x.device, dtype=torch.float64)[None, :]
    cos, sin = angle.cos().float()[:, None, :], angle.sin().float()[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode query per sequence against its paged keys 0..seq_len-1.

    Gathers each sequence's blocks (table entries past seq_len are never meaningful, so any
    value there, even -1, is clamped to a valid block and masked) and runs SDPA, whose CPU
    kernels accumulate the softmax in fp32 for every input dtype. A sequence of length 0
    gets zeros.
    """
    batch, heads, hd = q.shape
    _, block_size, kv_heads, _ = k_pool.shape
    tables = block_tables.long().clamp(min=0)
    length = tables.shape[1] * block_size
    k = k_pool[tables].view(batch, length, kv_heads, hd).transpose(1, 2)
    v = v_pool[tables].view(batch, length, kv_heads, hd).transpose(1, 2)
    mask = torch.arange(length, device=q.device)[None, :] < seq_lens.to(q.device)[:, None]
    # slots past seq_len may hold anything, NaN included, and a zero softmax weight times NaN is NaN
    k = torch.where(mask[:, None, :, None], k, 0)
    v = torch.where(mask[:, None, :, None], v, 0)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )[:, :, 0, :]
    return torch.where(mask.any(dim=1)[:, None, None], out, 0.0).to(q.dtype)


def selected_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Queries q [Nq,H,hd] at q_pos against k/v [Nk,KV,hd] at k_pos, query i seeing key j iff
    k_pos[j] <= q_pos[i] (the engine's `attend`, with an optional scale). A query that sees
    no key has no defined output here (NaN); the kernel writes zeros there."""
    return sdpa(q, k, v, k_pos[None, :] <= q_pos[:, None], scale)


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None
) -> torch.Tensor:
    """SDPA in the engine's token-major layout: q [Nq,H,hd], k/v [Nk,KV,hd], a boolean mask
    [Nq,Nk] (None: causal, queries and keys both at 0..N-1) -> [Nq,H,hd]. Torch gets 4-D
    batches of one: given 3-D inputs, its CPU dispatch falls back to the unfused math
    kernel, several times slower than the flash kernel it picks for 4-D."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=None if mask is None else mask[None, None],
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
