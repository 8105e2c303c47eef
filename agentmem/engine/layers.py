"""The layers every model family shares: RMSNorm, RoPE (with the scalings HF defines for these
families), and the attention-visibility rule.

RoPE lives here once: the model's forward rotates q and k with it, and the kvreuse fuser
re-rotates cached pre-RoPE keys to their new positions with the same tables, so a chunk is
placed with exactly the rotation (scaling included) that the model itself would apply.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import cpu_bf16, cpu_fp32

# RoPE types the engine computes; HF's others (yarn, longrope, ...) fail at load.
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused call: decode runs this 61 times per token
        if (x.dim() == 2 and x.shape[0] <= cpu_fp32.MAX_ROWS and weight.dtype == torch.float32
                and x.device.type == "cpu" and not torch.compiler.is_compiling() and (lib := cpu_fp32.loaded())):
            return cpu_fp32.rms_norm(lib, x, weight, eps)  # decode rows: one C call (F.rms_norm takes ~70 us)
        return F.rms_norm(x, weight.shape, weight, eps)
    if (x.dim() == 2 and x.dtype == weight.dtype == torch.bfloat16
            and x.device.type == "cpu" and not torch.compiler.is_compiling() and (lib := cpu_bf16.loaded())):
        # one C call, any number of rows (it once took decode rows only: a 2,048-row
        # prefill's 61 norms cost 171 ms through torch, ~31 so). It rounds as the torch path
        # below, but sums the squares in another order: with activations in the thousands a few
        # elements of a 512-token forward land one bf16 step apart (perplexity 9.001 -> 9.025
        # on one chat text; `bench engine`'s bf16 8.475 -> 8.490), prefill now as decode rows were.
        return cpu_bf16.rms_norm(lib, x, weight, eps)
    # normalised in fp32 and cast back before the weight, as HF does
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim/2] (float64) under HF's `rope_type` scalings.

    `linear` divides every frequency by `factor`; `llama3` (Llama 3.1/3.2) divides the low
    frequencies by `factor`, keeps the high ones and blends the band between, with the
    wavelength bounds taken from `original_max_position_embeddings`. `dynamic` (NTK) only
    rescales once a sequence is longer than `max_position_embeddings`, which is where the
    engine's context window ends, so within it the frequencies are the default ones (HF
    computes the same frequencies for any sequence up to that length).
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind in ("default", "dynamic"):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported; supported: {list(ROPE_TYPES)}")


class Rotary:
    """RoPE in the HF (rotate-half) convention, evaluated at arbitrary integer positions.

    cos/sin are tabulated once (in float64, stored fp32) for every position of the context,
    so a forward only indexes the table, and rotation of q and k is one call.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int = 8192, scaling: dict | None = None):
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float64, device="cpu")[:, None] * self.inv_freq[None, :]
        self._cos = freqs.cos().repeat(1, 2).float()
        # rotate-half as a flip of the two halves times a signed sin: x*cos + flip(x)*sin_signed
        self._sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).float()

    def to(self, device: torch.device | str) -> Rotary:
        self._cos, self._sin = self._cos.to(device), self._sin.to(device)
        return self

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (cos, signed sin) tables, [positions, head_dim] fp32 each (for kernels that
        index them by position themselves)."""
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables at `positions` [N] -> (cos, signed sin), each [N, head_dim] fp32."""
        return self._cos[positions], self._sin[positions]

    def apply(
        self, x: torch.Tensor, positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """x: [..., N, heads, head_dim] (e.g. [N, H, hd], or cached K of every layer
        [L, N, KV, hd]); positions: [N]. Pass `cos_sin` to reuse a lookup."""
        return rotate(x, *(cos_sin if cos_sin is not None else self.cos_sin(positions)))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., N, heads, hd] rotated by the tables of its N positions (`Rotary.cos_sin`)."""
    if cpu_bf16.rope_usable(x, cos) and not torch.compiler.is_compiling() and (lib := cpu_bf16.loaded()):
        # bf16: one C call, bit-identical, any number of rows (its threads split them past 16). Session
        # 29 (Zen 4 VM, 2 threads), q and k of 2,048 prefill rows: 0.08 ms against torch's 11.2; 320 rows
        # (a blend's) 0.014 against 0.18. It used to take decode rows only.
        return cpu_bf16.rope(lib, x, cos, sin)
    if cpu_fp32.rope_usable(x, cos) and not torch.compiler.is_compiling() and (lib := cpu_fp32.loaded()):
        return cpu_fp32.rope(lib, x, cos, sin)  # fp32 rows (AVX2): the same, one thread (2,048 rows 0.25 ms, torch 1.4)
    xf = x if x.dtype == torch.float32 else x.float()
    out = torch.addcmul(xf * cos[:, None, :], half_swapped(xf), sin[:, None, :])
    return out if out.dtype == x.dtype else out.to(x.dtype)


def half_swapped(x: torch.Tensor) -> torch.Tensor:
    """Rotate-half's partner of each lane: the two halves of the last dimension swapped (the
    signed sin table of `Rotary.cos_sin` carries the minus), so RoPE at p is
    x * cos(p) + half_swapped(x) * sin(p). Also how the kvreuse drift rotates a constant."""
    hd = x.shape[-1]
    return x.view(*x.shape[:-1], 2, hd // 2).flip(-2).view(x.shape)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Which keys each query sees, [Nq, Nk] bool: causal by position (key j <= query i) and,
    with a sliding `window` (Mistral), only the last `window` positions (i - j < window)."""
    seen = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    return seen


# attn(layer_idx, q_rot [N,H,hd], k_raw [N,KV,hd], k_rot [N,KV,hd], v [N,KV,hd]) -> [N,H,hd]
AttnBackend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
