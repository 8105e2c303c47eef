"""The model families the engine runs, one file each: every family is the shared decoder
(`engine/model.py`, `engine/layers.py`) plus what its file says differs. The checkpoint's
`model_type` picks the file; anything else fails here, at load, naming what is supported."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UnsupportedModel
from ..model import ModelArgs
from . import llama, mistral, qwen2, qwen3

FAMILIES = {t: fam for fam in (llama, mistral, qwen2, qwen3) for t in fam.MODEL_TYPES}
SUPPORTED = tuple(FAMILIES)


def model_args(path: Path) -> ModelArgs:
    """ModelArgs of the HF checkpoint directory `path`, or UnsupportedModel naming the
    model_type or option that the engine cannot compute and what it supports."""
    raw = json.loads((Path(path) / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    from transformers import AutoConfig

    return FAMILIES[model_type].args(AutoConfig.from_pretrained(str(path)))


__all__ = ["FAMILIES", "SUPPORTED", "UnsupportedModel", "model_args"]
