"""Llama 2 / 3.x (and SmolLM2, the default model): the base decoder as is. RoPE scaling
`llama3`, `linear` and `dynamic` come from the shared RoPE; `attention_bias` (some
fine-tunes) adds biases to q/k/v and o."""

from __future__ import annotations

from ..model import ModelArgs
from .base import base_args

MODEL_TYPES = ("llama",)


def args(c) -> ModelArgs:
    bias = bool(getattr(c, "attention_bias", False))
    return base_args(c, qkv_bias=bias, o_bias=bias)
