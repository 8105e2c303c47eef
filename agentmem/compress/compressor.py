"""Compress a memory's text once, when it is written or reflected.

The compressed text is what the assembler puts in the prompt and what chunk KV is keyed
on, so it must be a pure function of the memory (never of the question): then its KV can be
computed once and reused on every turn. Question-aware LongLLMLingua is offered separately
for callers who accept losing KV reuse for that request.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..engine import Engine
from .lingua import EngineCompressor
from .policy import BudgetPolicy


@dataclass(frozen=True)
class CompressionStats:
    original_tokens: int
    compressed_tokens: int
    seconds: float
    method: str  # llmlingua | longllmlingua | none (too short, or rate 1)

    @property
    def rate(self) -> float:
        """compressed / original tokens (LLMLingua's definition)."""
        return self.compressed_tokens / self.original_tokens if self.original_tokens else 1.0


def _check_rate(rate: float) -> None:
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"rate must be in (0, 1], got {rate}")


class Compressor:
    """LLMLingua on the engine's model. One per engine; calls are serialized because
    LLMLingua keeps per-call state on the compressor object."""

    def __init__(self, engine: Engine, min_tokens: int = 12):
        self.engine = engine
        self.min_tokens = min_tokens
        self._lingua = EngineCompressor(engine)
        self._lock = threading.Lock()

    def compress(self, text: str, rate: float = 0.5) -> tuple[str, CompressionStats]:
        """Drop the tokens the model finds most predictable until about `rate` of them remain.
        Texts under `min_tokens` are returned unchanged: there is little to gain and every
        word of a short fact tends to matter."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        _check_rate(rate)
        t0 = time.perf_counter()
        n = self.engine.count_tokens(text)
        if rate == 1.0 or n < self.min_tokens:
            return text, CompressionStats(n, n, time.perf_counter() - t0, "none")
        with self._lock:
            r = self._lingua.compress_prompt(
                [text],
                rate=rate,
                use_context_level_filter=False,
                use_sentence_level_filter=False,
                iterative_size=min(200, n),
            )
        out = r["compressed_prompt"].strip()
        m = self.engine.count_tokens(out)
        if not out or m >= n:
            return text, CompressionStats(n, n, time.perf_counter() - t0, "none")
        return out, CompressionStats(n, m, time.perf_counter() - t0, "llmlingua")

    def compress_for_question(
        self, contexts: list[str], question: str, target_tokens: int
    ) -> tuple[str, CompressionStats]:
        """LongLLMLingua: rank `contexts` by how much they help the model answer `question`,
        keep the best within `target_tokens`, and compress each conditioned on the question.
        The output changes with every question, so none of its KV can be reused: use it only
        when the prompt budget matters more than time to first token."""
        if not question.strip():
            raise ValueError("question-aware compression needs a non-empty question")
        if target_tokens <= 0:
            raise ValueError(f"target_tokens must be positive, got {target_tokens}")
        contexts = [c for c in contexts if c.strip()]
        if not contexts:
            raise ValueError("no contexts to compress")
        t0 = time.perf_counter()
        n = sum(self.engine.count_tokens(c) for c in contexts)
        with self._lock:
            r = self._lingua.compress_prompt(
                contexts,
                question=question,
                target_token=target_tokens,
                rank_method="longllmlingua",
                condition_in_question="after_condition",
                condition_compare=True,
                reorder_context="sort",
                dynamic_context_compression_ratio=0.3,
                context_budget="+100",
                concate_question=False,
                use_sentence_level_filter=False,
                iterative_size=min(200, max(8, n)),
            )
        out = r["compressed_prompt"].strip()
        return out, CompressionStats(
            n, self.engine.count_tokens(out), time.perf_counter() - t0, "longllmlingua"
        )


def compress_memory(
    compressor: Compressor, text: str, tier: str = "recall", policy: BudgetPolicy | None = None
) -> str:
    """The `compressed_text` to store with a new memory of `tier`: what the memory store and
    reflection call when they write a row. Equals `text` when the policy keeps the tier
    verbatim or compression would save nothing."""
    rate = (policy or BudgetPolicy()).rate_for(tier)
    return compressor.compress(text, rate)[0]
