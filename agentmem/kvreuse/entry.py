"""`ChunkKV`: what the chunk store keeps of one chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChunkKV:
    """KV of one chunk: k (before RoPE) and v, each [layers, tokens, kv_heads, head_dim].

    `context` is the context hash (see identity.next_context) of the segments it was
    computed after, when it was computed exactly (full prefill after an exact prefix);
    None when it is an approximation (blended), which is then never taken for an exact
    prefix. `quantized`: it came back through a lossy codec (int8/int4); it keeps its
    context, and the planner takes it for a prefix only with `kv_quantized_prefix`."""

    k: torch.Tensor
    v: torch.Tensor
    context: str | None = None
    quantized: bool = False

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def tokens(self) -> int:
        return self.k.shape[1]

    def to(self, device: torch.device | str) -> ChunkKV:
        return ChunkKV(self.k.to(device), self.v.to(device), self.context, self.quantized)
