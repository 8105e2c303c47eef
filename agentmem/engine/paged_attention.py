"""Decode attention over the paged pool, in plain torch: the CPU path and the reference the
Triton kernel is tested against. One query token per sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> torch.Tensor:
    """q [B,H,hd]; k_pool/v_pool [num_blocks, block_size, KV, hd]; block_tables int32
    [B, max_blocks] (padding entries may be any valid block); seq_lens int32 [B] -> [B,H,hd]."""
    b, _, hd = q.shape
    _, bs, kvh, _ = k_pool.shape
    tables = block_tables.long()
    length = tables.shape[1] * bs
    k = k_pool[tables].view(b, length, kvh, hd).transpose(1, 2)
    v = v_pool[tables].view(b, length, kvh, hd).transpose(1, 2)
    mask = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], enable_gqa=True
    )
    return out[:, :, 0, :].to(q.dtype)
