"""The ranking: plain scoring functions over candidates and a frozen record of what each
factor weighs (`RankWeights`).

Fusion is reciprocal rank fusion, sum of w / (rrf_k + rank): bm25 and cosine scores are not
on one scale, ranks are. Fused scores are then weighed by what the question says: time
("last week", "in May 2023": turns inside the window, relative to the conversation's own
newest message), people (turns by a speaker the question names), "when" questions (turns
that date something), turns that only ask (down), and mildly by recency and importance. A
per-session decay spreads the top hits over sessions, so a question whose evidence lies in
two sessions gets both.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType

from ..query import ParsedQuery
from ..records import Hit, Memory, Message, MessageMeta, own_reply
from .candidate import _Cand

_DATES = re.compile(r"\b(?:yesterday|today|tonight|last|ago|weekend|monday|tuesday|wednesday|thursday|friday|"
                    r"saturday|sunday|january|february|march|april|june|july|august|september|october|november|"
                    r"december|\d{4}|\d{1,2}(?:st|nd|rd|th))\b", re.I)


@dataclass(frozen=True)
class RankWeights:
    """What each factor of the ranking weighs. Frozen, so a ranking is a function of its
    candidates and this record; each field is the package's upper-case name of it
    (`recall.SESSION_DECAY`). Why each value was kept over the others tried: docs/recall.md."""

    half_life_days: float = 30.0  # recency halves over this many days
    recency_weight: float = 0.2  # recency moves a score by at most this share
    importance_weight: float = 0.2  # a memory's importance moves its score by at most this share
    assistant_weight: float = 0.85  # an unnamed assistant turn is the model's own reply: maybe wrong
    looped_weight: float = 0.5  # a reply the loop detector cut (archive.looped_replies) is weaker evidence still
    # each retriever's vote; a fact is distilled and checked by reflection, so its vote weighs more
    # than a turn's; a turn found only through its neighbour's rank has no vote of its own
    weights: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({
        "dense": 1.0, "context": 1.0, "lexical": 1.0, "facts": 1.5, "time": 1.0, "person": 1.0, "neighbour": 0.0}))
    rrf_k: int = 10  # small: the first few ranks of each retriever decide
    # a turn that only asks ("Read anything good lately?") answers nothing itself; its answer is
    # found by the answer's own context view
    question_weight: float = 0.3
    window_boost: float = 1.6  # a turn inside the question's time window
    near_window_boost: float = 1.2  # within a week of it
    near_window_s: float = 7 * 86400.0
    speaker_boost: float = 1.6  # a turn by a person the question names (real questions name whom they ask about)
    mention_boost: float = 1.1  # a turn that names them
    when_boost: float = 1.15  # a "when" question, and a turn that dates something
    # a turn at the head of the ranking (the first neighbour_head x k) lends this share of its
    # score to the turns just before and after it in its session (`neighbour_lent`)
    neighbour_support: float = 0.15
    neighbour_head: int = 2
    session_decay: float = 0.85  # each further hit from one session counts this much less
    # a hit whose letter words overlap (Jaccard) a taken hit's by this much counts duplicate_decay
    # less, so one piece of small talk said again and again cannot fill the top k
    duplicate_overlap: float = 0.5
    duplicate_decay: float = 0.3
    # a question dated by another event dates it by the latest of that event's best
    # anchor_candidates hits scoring at least anchor_share of the best (`event_time`)
    anchor_candidates: int = 3
    anchor_share: float = 0.7
    meta_candidates: int = 100  # message candidates, best fused first, whose metadata the ranking reads


DEFAULT_WEIGHTS = RankWeights()


def recency(when: datetime, now: datetime, w: RankWeights = DEFAULT_WEIGHTS) -> float:
    age_days = max(0.0, (now - when).total_seconds() / 86400.0)
    return math.pow(0.5, age_days / w.half_life_days)


def _fused_score(c: _Cand, w: RankWeights = DEFAULT_WEIGHTS) -> float:
    """Reciprocal-rank fusion of a candidate's votes (the weighted sum of 1 / (rrf_k + rank)),
    a full-text vote weighed down when it matched few of the question's words."""
    score = sum(w.weights[r] / (w.rrf_k + rank) for r, rank in c.ranks.items())
    if "lexical" in c.ranks:  # a full-text match on one common word of five is a weak vote
        score -= w.weights["lexical"] / (w.rrf_k + c.ranks["lexical"]) * (1 - math.sqrt(c.lexical_share))
    return score


def _text_prior(ui, row_id: int, specific: dict[int, float], w: RankWeights = DEFAULT_WEIGHTS) -> float:
    """What a message's text says of it as evidence: its information, its specificity (`specific`,
    TermStats.weights), and question_weight if it only asks (`ui`: the user's index tables)."""
    return ui.info.get(row_id, 1.0) * specific.get(row_id, 1.0) * (w.question_weight if row_id in ui.asks else 1.0)


def _window_factor(window, t: float, w: RankWeights = DEFAULT_WEIGHTS) -> float:
    """The boost of a turn or fact at time `t` (unix seconds) for the question's time window:
    window_boost inside, near_window_boost within a week of it, else 1."""
    lo, hi = window.since.timestamp(), window.until.timestamp()
    if lo <= t < hi:
        return w.window_boost
    return w.near_window_boost if lo - w.near_window_s <= t < hi + w.near_window_s else 1.0


def _pre_scores(ui, cands: list[_Cand], pq: ParsedQuery, specific: dict[int, float],
                w: RankWeights = DEFAULT_WEIGHTS) -> list[float]:
    """Each candidate's fused score (`_fused_score`) times the factors of the ranking that the
    index's own tables can tell for a message: its text prior (`_text_prior`), its time against
    the question's window, its speaker against the people named. The metadata cut keeps the best
    meta_candidates by this: a turn inside the window, by the person asked about, ranked far down
    the whole history ("Which dish did Tom make in July 2022?" among a year of both people
    cooking) must not be cut before its boosts. The people's speaker codes are read once for all
    candidates."""
    codes = {ui.codes.get(p) for p in pq.people} if pq.people else None
    out = []
    for c in cands:
        r = c.row_id
        f = _text_prior(ui, r, specific, w)
        if pq.window is not None and (t := ui.times.get(r)) is not None:
            f *= _window_factor(pq.window, t, w)
        if codes is not None and r in ui.who:
            f *= w.speaker_boost if ui.who[r] in codes else 1.0
        out.append(_fused_score(c, w) * f)
    return out


def reply_weight(row: MessageMeta, looped: Callable[[], Collection[int]], w: RankWeights = DEFAULT_WEIGHTS) -> float:
    """The model's own reply is weaker evidence, one the loop detector cut weaker still
    (`looped`: those replies' ids, asked for only when an own reply is met)."""
    if not own_reply(row.role, row.name):
        return 1.0
    return w.assistant_weight * (w.looped_weight if row.id in looped() else 1.0)


def admitted(row: MessageMeta | Memory, since: datetime | None, until: datetime | None, own_replies: bool) -> bool:
    """Inside the search's hard time filters, and not the model's own reply where those are left out."""
    return ((since is None or row.time >= since) and (until is None or row.time <= until)
            and (own_replies or not isinstance(row, MessageMeta) or not own_reply(row.role, row.name)))


def score(c: _Cand, row: MessageMeta | Memory, ui, pq: ParsedQuery, mention: list[str], specific: dict[int, float],
          now: datetime, looped: Callable[[], Collection[int]], w: RankWeights = DEFAULT_WEIGHTS) -> float:
    """A candidate's score from its votes and what its metadata say: recency, importance (a
    memory) or text prior and reply weight (a message), the question's time window, and the
    people it names (`mention`, lower case)."""
    when = row.time
    out = _fused_score(c, w)
    out *= 1 - w.recency_weight / 2 + w.recency_weight / 2 * recency(when, now, w)
    if isinstance(row, Memory):
        out *= 1 - w.importance_weight + w.importance_weight * row.importance
    else:
        out *= _text_prior(ui, row.id, specific, w)
        out *= reply_weight(row, looped, w)
    if pq.window is not None:
        out *= _window_factor(pq.window, when.timestamp(), w)
    if mention and isinstance(row, MessageMeta) and row.name and row.name.lower() in mention:
        out *= w.speaker_boost
    elif mention and isinstance(row, Memory) and any(p in row.text.lower() for p in mention):
        out *= w.speaker_boost  # a fact about the person asked about: it speaks for them
    return out


def text_boosted(score: float, msg: Message, mention: list[str], pq: ParsedQuery,
                 w: RankWeights = DEFAULT_WEIGHTS) -> float:
    """`score` with the boosts only a message's text can tell: it names a person the question
    names (without being theirs), it dates something and the question asks when."""
    low = msg.text.lower()
    if mention and not (msg.name and msg.name.lower() in mention) and any(p in low for p in mention):
        score *= w.mention_boost
    if pq.asks_when and _DATES.search(msg.text):
        score *= w.when_boost
    return score


def neighbour_lent(head: list[tuple[_Cand, MessageMeta]], near: Mapping[tuple[int, int], int],
                   w: RankWeights = DEFAULT_WEIGHTS) -> dict[int, float]:
    """The support each neighbour turn is lent by the head of the ranking: neighbour_support of
    the best score among the turns just before and after it (`near`: (turn id, step) -> the
    neighbour's id)."""
    lent: dict[int, float] = {}
    for c, row in head:
        for step in (-1, 1):
            if (n := near.get((row.id, step))) is not None:
                lent[n] = max(lent.get(n, 0.0), w.neighbour_support * c.score)
    return lent


def lent_score(support: float, ui, row: MessageMeta, specific: dict[int, float],
               looped: Callable[[], Collection[int]], w: RankWeights = DEFAULT_WEIGHTS) -> float:
    """Lent support weighed as the turn's own evidence is: its text, and whether it is the
    model's own reply."""
    return support * _text_prior(ui, row.id, specific, w) * reply_weight(row, looped, w)


def event_time(hits: list[Hit], w: RankWeights = DEFAULT_WEIGHTS) -> datetime:
    """When the event a question is dated by took place, from its search's hits (best first):
    the latest of those scoring at least anchor_share of the best. An event is announced before
    it happens and told of after; the telling is the later of two strong matches."""
    strong = [h for h in hits[:w.anchor_candidates] if h.score >= w.anchor_share * hits[0].score]
    return max(strong, key=lambda h: h.time).time


_LETTERS = re.compile(r"[^\W\d_]+")


def _letter_words(text: str) -> frozenset[str]:
    """Letters only: a turn said again with other numbers ("at 7pm" / "at 5pm") repeats."""
    return frozenset(_LETTERS.findall(text.lower()))


def _repeats(words: frozenset[str], seen: list[frozenset[str]], w: RankWeights = DEFAULT_WEIGHTS) -> bool:
    """Whether `words` mostly repeat one of the word sets `seen` (duplicate_overlap)."""
    return bool(words) and any(len(words & s) >= w.duplicate_overlap * len(words | s) for s in seen)


def _diverse(ranked: list, k: int, session_of: Callable, words_of: Callable | None = None,
             w: RankWeights = DEFAULT_WEIGHTS) -> list:
    """Greedy: each further hit from a session counts session_decay less, so the top k spread
    over sessions when their scores are close, and stay together when they are not; a hit that
    repeats the words of one already taken (`words_of`) counts duplicate_decay less. The
    order changes, the scores do not (a hit's score is its relevance).
    Each item's session, words and whether it repeats a taken one are read once and updated
    per pick against that pick alone (k x n set overlaps, not k x n x k)."""
    left = list(ranked)
    sessions = [session_of(item) for item in left]
    words = [words_of(item) for item in left] if words_of is not None else None
    repeats = [False] * len(left)
    taken: dict[str, int] = {}
    out = []
    while left and len(out) < k:
        best, best_w = 0, -math.inf
        for i, item in enumerate(left):  # the first of equal weights, as max() takes it
            weight = item[0].score * w.session_decay ** taken.get(sessions[i], 0)
            if repeats[i]:
                weight *= w.duplicate_decay
            if weight > best_w:
                best, best_w = i, weight
        out.append(left.pop(best))
        s = sessions.pop(best)
        repeats.pop(best)
        if s is not None:
            taken[s] = taken.get(s, 0) + 1
        if words is not None:
            got = words.pop(best)
            repeats = [r or _repeats(ws, [got], w) for r, ws in zip(repeats, words, strict=True)]
    return out
