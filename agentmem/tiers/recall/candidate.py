"""A candidate: one message or memory some retriever found, its rank in each ranking that
found it, and the score the ranking gives it."""

from __future__ import annotations

from dataclasses import dataclass, field

_MESSAGE, _MEMORY = 0, 1


@dataclass
class _Cand:
    kind: int
    row_id: int
    ranks: dict[str, int] = field(default_factory=dict)
    chunk: int = 0
    similarity: float = 0.0
    score: float = 0.0
    text_seen: bool = False  # similarity is the best text view's (not the context view's)
    lexical_share: float = 1.0  # its full-text score / the best one's
