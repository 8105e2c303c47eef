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
    mask = k_pos[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)
