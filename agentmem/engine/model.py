"""A Llama-family decoder in plain torch, with explicit positions everywhere.

Tokens are laid out token-major and flat (`[N, dim]`), the way paged engines do it, so a
batch of decode steps from many sequences and a prefill of one sequence are the same call.
Attention is delegated to a backend callable, so the same layers serve a contiguous cache,
the paged pool, and the CacheBlend fuser, which runs only selected tokens through a layer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    head_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_hf_config(cls, path: Path) -> ModelArgs:
        c = json.loads((Path(path) / "config.json").read_text())
        if c.get("rope_scaling") not in (None, {}) and c["rope_scaling"].get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope_scaling {c['rope_scaling']} is not supported")
        n_heads = c["num_attention_heads"]
        rope_theta = c.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it under rope_parameters
            rope_theta = (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=c["vocab_size"],
            dim=c["hidden_size"],
            n_layers=c["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=c.get("num_key_value_heads", n_heads),
            hidden_dim=c["intermediate_size"],
            head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
            rope_theta=float(rope_theta),
            norm_eps=c.get("rms_norm_eps", 1e-5),
            max_seq_len=c.get("max_position_embeddings", 8192),
            tie_embeddings=c.get("tie_word_embeddings", True),
            bos_token_id=c.get("bos_token_id"),
            eos_token_id=c.get("eos_token_id"),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary:
    """RoPE in the HF (rotate-half) convention, evaluated at arbitrary integer positions."""

    def __init__(self, head_dim: int, theta: float):
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float64)[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [N, heads, head_dim]; positions: [N]."""
        cos, sin = self.cos_sin(positions, torch.float32)
        xf = x.float()
        half = xf.shape[-1] // 2
        rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)


# attn(layer_idx, q_rot [N,H,hd], k_raw [N,KV,hd], k_rot [N,KV,hd], v [N,KV,hd]) -> [N,H,hd]
AttnBackend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Block(nn.Module):
    def __init__(self, args: ModelArgs, idx: int):
        super().__init__()
        self.idx = idx
        self.args = args
        hd = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.gate_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.down_proj = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.input_norm = RMSNorm(args.dim, args.norm_eps)
        self.post_norm = RMSNorm(args.dim, args.norm_eps)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Un-rotated q, k and v of hidden states h [N, dim]."""
        a = self.args
        x = self.input_norm(h)
        n = x.shape[0]
        q = self.q_proj(x).view(n, a.n_heads, a.head_dim)
        k = self.k_proj(x).view(n, a.n_kv_heads, a.head_dim)
        v = self.v_proj(x).view(n, a.n_kv_heads, a.head_dim)
        return q, k, v

    def finish(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, and the SwiGLU MLP."""
        h = h + self.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        x = self.post_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: Rotary, attn: AttnBackend) -> torch.Tensor:
        q, k, v = self.qkv(h)
        q_rot = rotary.apply(q, positions)
        k_rot = rotary.apply(k, positions)
        return self.finish(h, attn(self.idx, q_rot, k, k_rot, v))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rotary = Rotary(args.head_dim, args.rope_theta)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnBackend,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run tokens `ids` [N] at `positions` [N]; return logits (fp32) of rows `logits_at`
        (default: every row)."""
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h, positions, self.rotary, attn)
        if logits_at is not None:
            h = h[logits_at]
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h)).float()


_HF_NAMES = {
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj",
    "mlp.gate_proj": "gate_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "down_proj",
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_norm",
}


def _rename(hf_name: str) -> str | None:
    name = hf_name.removeprefix("model.")
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        for hf, ours in _HF_NAMES.items():
            if rest.startswith(hf + "."):
                return f"layers.{i}.{ours}.{rest[len(hf) + 1:]}"
        return None
    if name.startswith(("embed_tokens.", "norm.", "lm_head.")):
        return name
    return None


def load_transformer(path: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> Transformer:
    """Build the model from an HF checkpoint directory (safetensors, HF tensor names)."""
    from safetensors.torch import load_file

    args = ModelArgs.from_hf_config(path)
    with torch.device("meta"):
        model = Transformer(args)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for k, t in load_file(str(f), device=str(device)).items():
            ours = _rename(k)
            if ours is not None:
                state[ours] = t.to(dtype)
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensors: {sorted(missing)[:5]} ...")
    model.load_state_dict(state, assign=True)
    if args.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)
