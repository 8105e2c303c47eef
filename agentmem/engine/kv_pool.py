"""The paged KV pool: per layer one tensor of fixed-size blocks of rotated K (and one of V),
`[num_blocks, block_size, n_kv_heads, head_dim]`, as PagedAttention lays it out. Which block
belongs to which sequence is the block manager's business; this only stores and gathers."""

from __future__ import annotations

import torch

from .model import ModelArgs


class KVPool:
    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, device, dtype: torch.dtype):
        # one block more than the block manager hands out: the padded rows of a compiled
        # decode step write there (`scratch_slot`), never read
        shape = (args.n_layers, num_blocks + 1, block_size, args.n_kv_heads, args.head_dim)
        # torch.empty does not touch the pages, so an idle pool costs address space, not RAM
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_slot = num_blocks * block_size
        self.bytes_per_token = 2 * args.n_layers * args.n_kv_heads * args.head_dim * self.k.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [N, KV, hd] of N tokens at flat slots [N] (block * block_size + offset)."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k if k.dtype == self.k.dtype else k.to(self.k.dtype))
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v if v.dtype == self.v.dtype else v.to(self.v.dtype))

    def gather(self, layer: int, blocks: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K/V [n_tokens, KV, hd] of one sequence from its block table."""
        k = self.k[layer][blocks].flatten(0, 1)[:n_tokens]
        v = self.v[layer][blocks].flatten(0, 1)[:n_tokens]
        return k, v
