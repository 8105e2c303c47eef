"""A paged KV pool and decode rows scattered over it, for the fused decode kernels' tests."""

from __future__ import annotations

import torch


def paged_rows(lens: list[int], layers: int, n_slots: int, kv: torch.dtype, g: torch.Generator):
    """A paged pool (K and V [layers, n_slots, 2 KV heads, 32] in `kv`, random) and decode rows of
    `lens` keys each, scattered over its slots, the new key last: (k, v, idx [rows * width] flat
    slots padded with each row's first, keep [rows, width] uint8, slots [rows] of the new keys)."""
    k0, v0 = (torch.randn(layers, n_slots, 2, 32, generator=g).to(kv) for _ in range(2))
    perm = torch.randperm(n_slots, generator=g)
    rows_slots, at = [], 0
    for n in lens:
        rows_slots.append(perm[at:at + n].tolist())
        at += n
    width = max(lens)
    idx = torch.tensor([s + s[:1] * (width - len(s)) for s in rows_slots]).flatten().contiguous()
    keep = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in rows_slots], dtype=torch.uint8)
    return k0, v0, idx, keep, torch.tensor([s[-1] for s in rows_slots])
