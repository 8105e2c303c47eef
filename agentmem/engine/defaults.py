"""The sampling a reply uses when its caller does not choose: the model's own recommendation.

In order, later wins: the model card's recommendation (for models whose
generation_config.json carries none: SmolLM2's card says temperature 0.2, top-p 0.9; the
config dequantized from its GGUF has only token ids), the checkpoint's
generation_config.json, then the `AGENTMEM_SAMPLE_*` settings. Where card and config say
nothing about repetition, mild penalties (REPETITION_FALLBACK) are added. Greedy decoding is what
made the default model loop on its first reply in the REPL, so nothing here defaults to it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import Config

# model id prefix -> what its model card recommends
MODEL_CARD: dict[str, dict] = {
    "SmolLM2": {"temperature": 0.2, "top_p": 0.9},
}
# where neither the card nor the config says anything about repetition: OpenAI's penalties,
# which count the reply's own tokens. Not the repetition penalty: CTRL's counts the prompt's
# tokens too, so it pushes down the very words an answer from memory has to quote (the name,
# the city in a recalled line); docs/replies.md has what it measured.
REPETITION_FALLBACK = {"frequency_penalty": 0.3, "presence_penalty": 0.3}
_FROM_CONFIG = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_SETTINGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def sampling_defaults(model_dir: Path | None, model_id: str, config: Config) -> dict:
    """SamplingParams keyword arguments (without max_tokens) for this model."""
    out: dict = {}
    for prefix, rec in MODEL_CARD.items():
        if model_id.startswith(prefix):
            out.update(rec)
    out.update(_generation_config(model_dir))
    if not {"repetition_penalty", "frequency_penalty", "presence_penalty"} & set(out):
        out.update(REPETITION_FALLBACK)
    for name in _SETTINGS:
        value = getattr(config, f"sample_{name}")
        if value is not None:
            out[name] = value
    return out


def _generation_config(model_dir: Path | None) -> dict:
    path = model_dir / "generation_config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return {}
    cfg = json.loads(path.read_text())
    out = {k: cfg[k] for k in _FROM_CONFIG if cfg.get(k) is not None}
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0  # the checkpoint asks for greedy decoding
    return out
