"""What makes a reply one a person would accept, as numbers: does it loop, is it varied,
does it copy an earlier reply of the same session. `agentmem bench replies` reports them."""

from __future__ import annotations

import re

COPY_OVERLAP = 0.6  # share of a reply's word trigrams found in one earlier reply that makes it a copy


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _ngrams(ws: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)]


def distinct_2(replies: list[str]) -> float:
    """Distinct word bigrams over all bigrams of all replies (Li et al., 2016): 1.0 when no
    pair of words repeats, near 0 for replies that say the same thing over and over."""
    grams = [g for r in replies for g in _ngrams(words(r), 2)]
    return len(set(grams)) / len(grams) if grams else 0.0


def copies_earlier(reply: str, earlier: list[str]) -> bool:
    """Whether `reply` repeats one of the session's earlier replies: the same words, or at
    least COPY_OVERLAP of its word trigrams present in a single earlier reply. A short
    answer that differs in its key word ("Your dog is Biscuit" after "Your city is Oslo")
    shares only its frame, which is below the threshold."""
    ws = words(reply)
    if not ws:
        return False
    mine = set(_ngrams(ws, 3))
    for e in earlier:
        ew = words(e)
        if ew == ws:
            return True
        if mine and len(mine & set(_ngrams(ew, 3))) >= COPY_OVERLAP * len(mine):
            return True
    return False


def copy_previous_rate(sessions: list[list[str]]) -> float:
    """Share of replies (after the first of each session) that copy an earlier reply of their
    session."""
    flags = [copies_earlier(r, s[:i]) for s in sessions for i, r in enumerate(s) if i]
    return sum(flags) / len(flags) if flags else 0.0
