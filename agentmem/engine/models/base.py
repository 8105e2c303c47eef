"""What every supported family shares when its HF config becomes `ModelArgs`: the
Llama-style decoder fields, the RoPE parameters (transformers 5 writes them under
`rope_parameters`, older configs under `rope_scaling` + `rope_theta`: both are read), and the
load-time refusal of anything the engine would otherwise compute wrongly."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedModel
from ..layers import ROPE_TYPES
from ..model import ModelArgs


def refuse(model_type: str, option: str, value: Any, supported: str) -> UnsupportedModel:
    return UnsupportedModel(f"{model_type}: {option}={value!r} is not supported (supported: {supported})")


def rope_parameters(c) -> tuple[float, dict | None]:
    """(rope_theta, scaling or None) from either place HF keeps them; refuses unknown types."""
    params = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(c, "rope_theta", None) or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise refuse(c.model_type, "rope_type", kind, ", ".join(ROPE_TYPES))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse(c.model_type, "partial_rotary_factor", params["partial_rotary_factor"], "1.0")
    if kind == "default":
        return float(theta), None
    if kind == "llama3":
        params.setdefault("original_max_position_embeddings", c.max_position_embeddings)
        missing = {"factor", "low_freq_factor", "high_freq_factor"} - set(params)
        if missing:
            raise UnsupportedModel(f"{c.model_type}: rope_type 'llama3' lacks {sorted(missing)}")
    elif "factor" not in params:
        raise UnsupportedModel(f"{c.model_type}: rope_type {kind!r} lacks 'factor'")
    return float(theta), params | {"rope_type": kind}


def base_args(c, **family: Any) -> ModelArgs:
    """ModelArgs of a Llama-style config `c` (a transformers PretrainedConfig); `family` sets
    the fields a family adds (biases, q/k norms, sliding window)."""
    if getattr(c, "hidden_act", "silu") != "silu":
        raise refuse(c.model_type, "hidden_act", c.hidden_act, "silu")
    if getattr(c, "mlp_bias", False):
        raise refuse(c.model_type, "mlp_bias", True, "False")
    theta, scaling = rope_parameters(c)
    n_heads = c.num_attention_heads
    return ModelArgs(
        vocab_size=c.vocab_size,
        dim=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(c, "num_key_value_heads", None) or n_heads,
        hidden_dim=c.intermediate_size,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // n_heads,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=c.rms_norm_eps,
        max_seq_len=c.max_position_embeddings,
        tie_embeddings=bool(c.tie_word_embeddings),
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        model_type=c.model_type,
        **family,
    )


def full_attention_only(c) -> None:
    """Qwen2/Qwen3 can run some layers with a sliding window (`use_sliding_window`); the
    engine runs one attention rule for every layer, so those configs are refused."""
    if getattr(c, "use_sliding_window", False):
        raise refuse(c.model_type, "use_sliding_window", True, "False")
    kinds = set(getattr(c, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise refuse(c.model_type, "layer_types", sorted(kinds), "full_attention only")
