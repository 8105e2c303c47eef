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
        if x.dtype == torch.float32:  # one fused call: decode runs this 61 times per token
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # normalised in fp32 and cast back before the weight, as HF does
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Rotary:
    """RoPE in the HF (rotate-half) convention, evaluated at arbitrary integer positions.

    cos/sin are tabulated once (in float64, stored fp32) for every position of the context,
    so a forward only indexes the table, and rotation of q and k is one call.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int = 8192):
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float64, device="cpu")[:, None] * self.inv_freq[None, :]
        self._cos = freqs.cos().repeat(1, 2).float()
        # rotate-half as a flip of the two halves times a signed sin: x*cos + flip(x)*sin_signed
        self._sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).float()

    def to(self, device: torch.device | str) -> Rotary:
        self._cos, self._sin = self._cos.to(device), self._sin.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables at `positions` [N] -> (cos, signed sin), each [N, head_dim] fp32."""
        return self._cos[positions], self._sin[positions]

    def apply(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """x: [N, heads, head_dim]; positions: [N]. Pass `cos_sin` to reuse a lookup."""
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions)
        n, heads, hd = x.shape
        xf = x if x.dtype == torch.float32 else x.float()
        swapped = xf.view(n, heads, 2, hd // 2).flip(2).view(n, heads, hd)
        out = torch.addcmul(xf * cos[:, None, :], swapped, sin[:, None, :])
        return out if out.dtype == x.dtype else out.to(x.dtype)


# attn(layer_idx, q_rot [N,H,hd], k_raw [N,KV,hd], k_rot [N,KV,hd], v [N,KV,hd]) -> [N,H,hd]
AttnBackend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# Up to this many rows the product with the weight stored transposed ([in, out]) is faster
# with MKL on the CPU: ~1.5-2x for one row (decode), 5-20% for 24-320 rows (the blend
# probe's question rows, a blend's recomputed rows), while at 2k rows (a full prefill) the
# [out, in] layout is ~3% ahead (interleaved A/B, 2-core AMD EPYC, qkv and gate/up shapes).
# The 49k-wide LM head differs: transposed is ~1.8x faster for 1-2 rows, 3-13% slower from 8.
TRANSPOSED_MAX_ROWS = 512
LM_HEAD_TRANSPOSED_MAX_ROWS = 2


def project(x: torch.Tensor, w: torch.Tensor, w_t: torch.Tensor | None, max_rows: int = TRANSPOSED_MAX_ROWS
            ) -> torch.Tensor:
    """x @ w.T, with `w_t` (w transposed, contiguous; kept on the CPU for the wide
    projections) for up to `max_rows` rows."""
    if w_t is not None and x.shape[0] <= max_rows:
        return torch.mm(x, w_t)
    return F.linear(x, w)


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
        self.wqkv_t: torch.Tensor | None = None  # transposed copies for few-row products (see `project`)
        self.w_gate_up_t: torch.Tensor | None = None

    def fuse(self) -> None:
        """Concatenate q/k/v and gate/up weights so each is one matmul; the per-projection
        Linear weights become views of the fused tensors (no copy is kept)."""
        a = self.args
        sizes = [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim]
        self.wqkv = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        for lin, w in zip((self.q_proj, self.k_proj, self.v_proj), self.wqkv.split(sizes), strict=True):
            lin.weight = nn.Parameter(w, requires_grad=False)
        self.w_gate_up = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        for lin, w in zip((self.gate_proj, self.up_proj), self.w_gate_up.chunk(2), strict=True):
            lin.weight = nn.Parameter(w, requires_grad=False)

    def qkv_fused(self, h: torch.Tensor) -> torch.Tensor:
        """Un-rotated q, k, v heads of hidden states h [N, dim], side by side: [N, H+2KV, hd]."""
        a = self.args
        return project(self.input_norm(h), self.wqkv, self.wqkv_t).view(h.shape[0], a.n_heads + 2 * a.n_kv_heads, a.head_dim)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Un-rotated q, k and v of hidden states h [N, dim]."""
        a = self.args
        return self.qkv_fused(h).split([a.n_heads, a.n_kv_heads, a.n_kv_heads], dim=1)

    def finish(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, and the SwiGLU MLP."""
        h = h + F.linear(attn_out.reshape(attn_out.shape[0], -1), self.o_proj.weight)
        gate, up = project(self.post_norm(h), self.w_gate_up, self.w_gate_up_t).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down_proj.weight)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        attn: AttnBackend,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        a = self.args
        qkv = self.qkv_fused(h)
        qk_end = a.n_heads + a.n_kv_heads
        # q and k are adjacent in the fused projection: rotate both in one call
        qk = rotary.apply(qkv[:, :qk_end], positions, cos_sin)
        k, v = qkv[:, a.n_heads : qk_end], qkv[:, qk_end:]
        return self.finish(h, attn(self.idx, qk[:, : a.n_heads], k, qk[:, a.n_heads :], v))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rotary = Rotary(args.head_dim, args.rope_theta, args.max_seq_len)
        self.lm_head_t: torch.Tensor | None = None

    def keep_transposed(self) -> None:
        """Keep [in, out] copies of the wide weights (qkv, gate/up, LM head) for decode and
        other few-row products on the CPU (see `project`), for ~80% more weight memory."""
        for layer in self.layers:
            layer.wqkv_t = layer.wqkv.t().contiguous()
            layer.w_gate_up_t = layer.w_gate_up.t().contiguous()
        self.lm_head_t = self.lm_head.weight.t().contiguous()

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
        cos_sin = self.rotary.cos_sin(positions)
        for layer in self.layers:
            h = layer(h, positions, self.rotary, attn, cos_sin)
        if logits_at is not None:
            h = h[logits_at]
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return project(self.norm(h), self.lm_head.weight, self.lm_head_t, LM_HEAD_TRANSPOSED_MAX_ROWS).float()


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
    model.rotary.to(device)
    for layer in model.layers:
        layer.fuse()
    if torch.device(device).type == "cpu":
        model.keep_transposed()
    return model.eval().requires_grad_(False)
