"""Torch references of the kernels: the CPU path of every dispatcher and the oracle the
Triton kernels are tested against. They favour exactness over speed (angles in float64,
softmax in fp32)."""

from __future__ import annotations

import math

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
    """One decode query per sequence against its paged keys 0..seq_len-1; fp32 softmax."""
    batch, heads, hd = q.shape
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    out = torch.zeros(batch, heads, hd, dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        j = torch.arange(n, device=q.device)
        blocks = block_tables[b, j // block_size].long()
        k = k_pool[blocks, j % block_size].float().repeat_interleave(heads // kv_heads, dim=1)  # [n, H, hd]
        v = v_pool[blocks, j % block_size].float().repeat_interleave(heads // kv_heads, dim=1)
        p = torch.einsum("hd,nhd->hn", q[b].float(), k).mul(scale).softmax(dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out.to(q.dtype)


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
