"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections."""

from __future__ import annotations

from ..model import ModelArgs
from .base import base_args, full_attention_only

MODEL_TYPES = ("qwen2",)


def args(c) -> ModelArgs:
    full_attention_only(c)
    return base_args(c, qkv_bias=True)
