"""The Llama-style decoder every supported family shares, in plain torch, with explicit
positions everywhere. A family (engine/models/) only switches its options on: q/k/v biases,
q/k norms, a RoPE scaling, a sliding window.

Tokens are laid out token-major and flat (`[N, dim]`), the way paged engines do it, so a
batch of decode steps from many sequences and a prefill of one sequence are the same call.
Attention is delegated to a backend callable, so the same layers serve a contiguous cache,
the paged pool, and the CacheBlend fuser, which runs only selected tokens through a layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import fused_decode, hugepages
from .layers import AttnBackend, RMSNorm, Rotary
from .linear import Proj, make_proj

# The 49k-wide LM head in fp32: transposed is ~1.8x faster for 1-2 rows, 3-13% slower from 8.
LM_HEAD_TRANSPOSED_MAX_ROWS = 2


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
    model_type: str = "llama"
    rope_scaling: dict | None = None  # HF rope parameters of a scaled RoPE (layers.rope_inv_freq)
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None  # Mistral: a token sees only the last this many positions

    @classmethod
    def from_hf_config(cls, path: Path) -> ModelArgs:
        """Read an HF checkpoint's config.json through the family its model_type names
        (engine/models); an unsupported model_type or option raises UnsupportedModel."""
        from .models import model_args

        return model_args(path)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, idx: int):
        super().__init__()
        self.idx = idx
        self.args = args
        hd = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * hd, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim, bias=args.o_bias)
        self.q_norm = RMSNorm(hd, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(hd, args.norm_eps) if args.qk_norm else None
        self.gate_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.down_proj = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.input_norm = RMSNorm(args.dim, args.norm_eps)
        self.post_norm = RMSNorm(args.dim, args.norm_eps)
        self.bqkv: torch.Tensor | None = None  # the q/k/v biases side by side (Qwen2)
        # the projections as multiplied (linear.Proj), set by `pack` after loading
        self.qkv_p: Proj | None = None
        self.o_p: Proj | None = None
        self.gate_up_p: Proj | None = None
        self.down_p: Proj | None = None
        # the CPU library's layer kernels this block's forward asks first (fused_decode.py), chosen by `pack`
        self.kernels: fused_decode.Reference = fused_decode.REFERENCE

    def fuse(self) -> None:
        """Concatenate q/k/v and gate/up weights so each is one matmul; the per-projection
        Linear weights become views of the fused tensors (no copy is kept)."""
        a = self.args
        sizes = [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim]
        self.wqkv = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        for lin, w in zip((self.q_proj, self.k_proj, self.v_proj), self.wqkv.split(sizes), strict=True):
            lin.weight = nn.Parameter(w, requires_grad=False)
        if a.qkv_bias:
            self.bqkv = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
            for lin, b in zip((self.q_proj, self.k_proj, self.v_proj), self.bqkv.split(sizes), strict=True):
                lin.bias = nn.Parameter(b, requires_grad=False)
        self.w_gate_up = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        for lin, w in zip((self.gate_proj, self.up_proj), self.w_gate_up.chunk(2), strict=True):
            lin.weight = nn.Parameter(w, requires_grad=False)

    def pack(self, fmt: str) -> None:
        """Hold the fused projections in weight format `fmt` (linear.WEIGHT_FORMATS). o and
        down keep no transposed fp32 copy: only the wide qkv and gate/up were measured faster."""
        self.qkv_p = make_proj(self.wqkv, self.bqkv, fmt)
        self.o_p = make_proj(self.o_proj.weight, self.o_proj.bias, fmt, transposed_max_rows=0)
        self.gate_up_p = make_proj(self.w_gate_up, None, fmt)
        self.down_p = make_proj(self.down_proj.weight, None, fmt, transposed_max_rows=0)
        self.set_kernels()

    def set_kernels(self, fused: bool | None = None) -> None:
        """Choose the layer kernels for this block's rows and packed weights (`fused_decode.choose`;
        `fused` False: the fused decode calls off, default AGENTMEM_FUSED_DECODE)."""
        projs = (self.qkv_p, self.o_p, self.gate_up_p, self.down_p)
        self.kernels = fused_decode.choose(self.input_norm.weight, projs, fused)

    def qkv_fused(self, h: torch.Tensor) -> torch.Tensor:
        """Un-rotated q, k, v heads of hidden states h [N, dim], side by side: [N, H+2KV, hd]
        (q and k normalised per head first where the family has q/k norms)."""
        a = self.args
        x = self.qkv_p(self.input_norm(h))
        x = x.view(h.shape[0], a.n_heads + 2 * a.n_kv_heads, a.head_dim)
        if self.q_norm is None:
            return x
        q, k, v = x.split([a.n_heads, a.n_kv_heads, a.n_kv_heads], dim=1)
        return torch.cat([self.q_norm(q), self.k_norm(k), v], dim=1)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Un-rotated q, k and v of hidden states h [N, dim]."""
        a = self.args
        return self.qkv_fused(h).split([a.n_heads, a.n_kv_heads, a.n_kv_heads], dim=1)

    def finish(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, and the SwiGLU MLP."""
        attn = attn_out.reshape(attn_out.shape[0], -1)
        if (out := self.kernels.finish(self, h, attn)) is not None:
            return out
        h = self.o_p.plus(h, attn)
        gu = self.gate_up_p(self.post_norm(h))
        if (out := self.kernels.mlp(self, h, gu)) is not None:
            return out
        gate, up = gu.chunk(2, dim=-1)
        return h + self.down_p(F.silu(gate) * up)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        attn: AttnBackend,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if (out := self.kernels.layer(self, h, positions, rotary, attn, cos_sin)) is not None:
            return out
        a = self.args
        qk_end = a.n_heads + a.n_kv_heads
        qkv = self.qkv_fused(h)
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
        self.rotary = Rotary(args.head_dim, args.rope_theta, args.max_seq_len, args.rope_scaling)
        self.head_p: Proj | None = None
        self.weights = "fp32"
        self._avx2_layers = None  # cpu_fp32.layers_q8's table of the layers' weights (built at first use)
        self._weights_arena = None  # the projections' GEMV layouts in huge pages (set by `pack`)
        self._u8_layers = None  # cpu_bf16.layers_q8u8's table, the same for bf16 rows on the u8 route
        self.kernels: fused_decode.Reference = fused_decode.REFERENCE  # a decode step's (set by `pack`)

    def pack(self, fmt: str) -> None:
        """Put every projection and the LM head in weight format `fmt` (see linear.py). The
        dense nn.Linear weights stay: the quality checks and the planners read them."""
        for layer in self.layers:
            layer.pack(fmt)
        self._avx2_layers = None  # the AVX2 decode step's table of weight pointers (cpu_fp32.layers_q8)
        self._u8_layers = None  # the bf16 u8 route's (cpu_bf16.layers_q8u8)
        # int4 keeps the LM head in int8: one 4-bit head quantizes every logit, and the tied
        # embedding a 4-bit GGUF carries is itself 8-bit (SmolLM2's Q4_1 file: Q8_0)
        head = "int8" if fmt == "int4" else fmt
        self.head_p = make_proj(self.lm_head.weight, None, head, LM_HEAD_TRANSPOSED_MAX_ROWS)
        self.weights = fmt
        self._weights_arena = None  # the layouts are new: `gather_weights` again
        self.kernels = fused_decode.choose(self.norm.weight, self.projections()[:-1])

    def set_kernels(self, fused: bool | None = None) -> None:
        """Choose the layer kernels again, of every layer and of a whole step (`Block.set_kernels`;
        `fused` False: the fused decode calls off, default AGENTMEM_FUSED_DECODE)."""
        for layer in self.layers:
            layer.set_kernels(fused)
        self.kernels = fused_decode.choose(self.norm.weight, self.projections()[:-1], fused)

    def gather_weights(self) -> None:
        """Move what decode streams (the projections' GEMV layouts), in the order it reads it,
        into one block of huge pages (hugepages.py); Engine.load calls it after the last `pack`."""
        self._u8_layers = self._avx2_layers = None  # their tables hold the old pointers
        self._weights_arena = hugepages.gather_weights(self)

    def projections(self) -> list[Proj]:
        out = [p for layer in self.layers for p in (layer.qkv_p, layer.o_p, layer.gate_up_p, layer.down_p)]
        return out + [self.head_p]

    @property
    def rows_math(self) -> str:
        return self.head_p.rows_math if self.head_p is not None else "bf16"

    def set_rows_math(self, math: str) -> None:
        """How every projection multiplies many bf16 rows (linear.resolve_rows_math)."""
        if self.head_p is None:
            return
        for p in self.projections():
            if p.rows_math != math:
                p.rows_math, p._prefill_w = math, None  # an int8 weight's bf16 copy is packed per math

    def set_q4_rows(self, rows: int) -> None:
        """Up to how many bf16 rows the int4 projections multiply on the 4-bit kernel
        (linear.resolve_q4_rows)."""
        for p in self.projections():
            if p is not None:
                p.q4_rows = rows

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
        if (out := self.kernels.step(self, h, cos_sin, attn)) is not None:
            h = out  # a decode step's every layer in one call
        else:
            for layer in self.layers:
                h = layer(h, positions, self.rotary, attn, cos_sin)
        if logits_at is not None:
            h = h[logits_at]
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        if torch.compiler.is_compiling():
            return self.head_p(x).float()
        # fp32 logits straight from the product where the engine's kernels run it: bf16 logits
        # are ~0.06 apart at 10, enough to tie or swap the two most likely tokens
        return self.head_p.multiply(x, torch.float32).float()


_HF_NAMES = {
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj",
    "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
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


def load_transformer(path: Path, dtype: torch.dtype, device: torch.device | str = "cpu",
                     weights: str | None = None) -> Transformer:
    """Build the model from an HF checkpoint directory (safetensors, HF tensor names), its
    projections in weight format `weights` (default: dense in `dtype`)."""
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
    extra = set(state) - set(model.state_dict())
    if extra:
        raise ValueError(f"checkpoint {path} has tensors its {args.model_type} config does not describe: "
                         f"{sorted(extra)[:5]} ...")
    model.load_state_dict(state, assign=True)
    if args.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.to(device)
    for layer in model.layers:
        layer.fuse()
    model.pack(weights or ("bf16" if dtype == torch.bfloat16 else "fp32"))
    return model.eval().requires_grad_(False)
