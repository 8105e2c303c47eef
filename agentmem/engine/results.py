"""What a finished request returns: its text, its tokens and its statistics. A leaf module, so
that the engine loop, which builds them, and the remote engine need not import the engine."""

from __future__ import annotations

from dataclasses import dataclass, field


class ReuseShare:
    """`cache_hit_ratio` for a record of token counts: the share of the prompt's tokens whose
    K/V came from the chunk cache (GenerationStats, and the API's TurnResult)."""

    reused_tokens: int
    prompt_tokens: int

    @property
    def cache_hit_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class GenerationStats(ReuseShare):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    prefilled_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""
    segments: list[dict] = field(default_factory=list)


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None  # per token: id, logprob, top alternatives
