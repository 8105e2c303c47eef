"""Noticing a reply caught in a loop: the last tokens are one n-gram repeated.

A small model at low temperature can fall into a cycle ("Nossa mesação, açúnha!" and the
same line again until max_tokens). The detector keeps, for every period p up to
`max_period`, how many consecutive tokens have equalled the token p places before; the
tail is then periodic with period p over `run[p] + p` tokens. A loop is a tail that repeats
its cycle at least `min_repeats` times and covers at least `min_tokens` tokens: long and
exact enough that prose, a numbered list or a table (whose items differ) never qualifies,
while a looping line is caught after three rounds. O(max_period) work per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoopDetector:
    max_period: int = 64
    min_repeats: int = 3
    min_tokens: int = 24
    tokens: list[int] = field(default_factory=list)
    run: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.run = [0] * (self.max_period + 1)

    def push(self, token: int) -> int | None:
        """Add a token; when the tail is now a loop, the number of leading tokens to keep
        (everything before the loop plus its first cycle), else None."""
        self.tokens.append(token)
        n = len(self.tokens)
        found = None
        for p in range(1, min(self.max_period, n - 1) + 1):
            self.run[p] = self.run[p] + 1 if self.tokens[n - 1 - p] == token else 0
            span = self.run[p] + p
            if found is None and span >= self.min_repeats * p and span >= self.min_tokens:
                found = n - self.run[p]
        return found

    def settled(self) -> int:
        """How many leading tokens no later cut can remove. A cut for period p keeps the text
        up to where p's current run began, so a token inside any run still in progress may yet
        be cut; a stream sends only the settled part, so it never shows what is then dropped
        (a look-behind of at most max(2 x max_period, min_tokens) tokens, usually a few)."""
        n = len(self.tokens)
        return n - max(self.run[1 : min(self.max_period, n - 1) + 1], default=0)


def find_loop(tokens: list[int], **kw) -> int | None:
    """The cut `LoopDetector` would make on this token list, at the first token it fires."""
    d = LoopDetector(**kw)
    for t in tokens:
        cut = d.push(t)
        if cut is not None:
            return cut
    return None
