"""Sampling parameters and the sampler: greedy, temperature, top-p."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import InvalidSampling


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False  # generate max_tokens even past end-of-sequence (benchmarks)

    def validate(self) -> SamplingParams:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSampling(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 5.0):
            raise InvalidSampling(f"temperature must be in [0, 5], got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise InvalidSampling(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSampling("stop strings must be non-empty strings")
        return self


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B]."""
    if params.temperature == 0.0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < params.top_p  # always keeps the most likely token
        sp = sp * keep
        choice = torch.multinomial(sp / sp.sum(-1, keepdim=True), 1, generator=generator)
        return si.gather(-1, choice).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
