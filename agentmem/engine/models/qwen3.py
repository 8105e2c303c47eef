"""Qwen3: the Llama decoder with an RMSNorm over each head of q and of k (`q_norm`,
`k_norm`) before RoPE, and an explicit head_dim (often not hidden_size / heads)."""

from __future__ import annotations

from ..model import ModelArgs
from .base import base_args, full_attention_only

MODEL_TYPES = ("qwen3",)


def args(c) -> ModelArgs:
    full_attention_only(c)
    bias = bool(getattr(c, "attention_bias", False))
    return base_args(c, qk_norm=True, qkv_bias=bias, o_bias=bias)
