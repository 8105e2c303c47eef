"""Mistral: the Llama decoder with an optional sliding attention window (`sliding_window`:
each token sees only the last that many positions, itself included)."""

from __future__ import annotations

from ..model import ModelArgs
from .base import base_args

MODEL_TYPES = ("mistral",)


def args(c) -> ModelArgs:
    window = getattr(c, "sliding_window", None)
    return base_args(c, sliding_window=int(window) if window else None)
