"""The ranking's scoring functions on candidates built by hand: no index, no embedder."""

from dataclasses import FrozenInstanceError, replace
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from agentmem.tiers.query import ParsedQuery
from agentmem.tiers.recall.candidate import _MEMORY, _MESSAGE, _Cand
from agentmem.tiers.recall.rank import (
    DEFAULT_WEIGHTS,
    RankWeights,
    _diverse,
    _fused_score,
    _pre_scores,
    _text_prior,
    _window_factor,
    admitted,
    event_time,
    lent_score,
    neighbour_lent,
    recency,
    reply_weight,
    score,
    text_boosted,
)
from agentmem.tiers.records import Hit, Memory, Message, MessageMeta
from agentmem.tiers.timeparse import TimeWindow

NOW = datetime(2023, 6, 1, tzinfo=UTC)
W = DEFAULT_WEIGHTS
NEVER_LOOPED = frozenset


def _ui(**kw):
    """The index tables the ranking reads, as plain containers."""
    base = {"info": {}, "asks": set(), "times": {}, "who": {}, "codes": {}}
    return SimpleNamespace(**(base | kw))


def _meta(i: int, when: datetime = NOW, role: str = "user", name: str | None = "Priya", session: str = "s1"):
    return MessageMeta(id=i, session_id=session, role=role, name=name, time=when)


def _memory(i: int, importance: float, text: str = "Priya plays the cello", when: datetime = NOW) -> Memory:
    return Memory(id=i, user_id="u", kind="fact", text=text, compressed_text=None, importance=importance,
                  status="active", superseded_by=None, source_ids=[], event_time=when, created_at=when, updated_at=when)


def _pq(**kw) -> ParsedQuery:
    return ParsedQuery(text="q", terms=[], **kw)


def test_the_weights_are_frozen_and_a_changed_copy_changes_the_score():
    with pytest.raises(FrozenInstanceError):
        W.rrf_k = 20
    assert RankWeights() == W and RankWeights(rrf_k=20) != W
    c = _Cand(_MESSAGE, 1, ranks={"dense": 0})
    assert _fused_score(c) == pytest.approx(1 / 10)
    assert _fused_score(c, replace(W, rrf_k=20)) == pytest.approx(1 / 20)


def test_recency_halves_over_the_half_life_and_never_exceeds_one():
    assert recency(NOW, NOW) == 1.0
    assert recency(NOW - timedelta(days=30), NOW) == pytest.approx(0.5)
    assert recency(NOW - timedelta(days=60), NOW) == pytest.approx(0.25)
    assert recency(NOW + timedelta(days=5), NOW) == 1.0  # a time after 'now' is not fresher than now
    assert recency(NOW - timedelta(days=10), NOW, replace(W, half_life_days=10.0)) == pytest.approx(0.5)
    # in the score, recency moves it by at most recency_weight
    c = _Cand(_MESSAGE, 1, ranks={"dense": 0})
    new, old = (score(c, _meta(1, when), _ui(), _pq(), [], {}, NOW, NEVER_LOOPED)
                for when in (NOW, NOW - timedelta(days=3000)))
    assert old < new and old / new == pytest.approx(1 - W.recency_weight / 2, rel=1e-3)


def test_importance_lifts_a_memory_within_its_weight():
    c = _Cand(_MEMORY, 7, ranks={"facts": 0})
    low, high = (score(c, _memory(7, imp), _ui(), _pq(), [], {}, NOW, NEVER_LOOPED) for imp in (0.1, 0.9))
    assert high > low
    assert high / low == pytest.approx((1 - W.importance_weight + W.importance_weight * 0.9)
                                       / (1 - W.importance_weight + W.importance_weight * 0.1))
    flat = replace(W, importance_weight=0.0)
    assert score(c, _memory(7, 0.1), _ui(), _pq(), [], {}, NOW, NEVER_LOOPED, flat) == \
        score(c, _memory(7, 0.9), _ui(), _pq(), [], {}, NOW, NEVER_LOOPED, flat)


def test_the_time_window_boosts_inside_less_near_it_and_not_far_from_it():
    window = TimeWindow(NOW - timedelta(days=7), NOW, "last week")
    at = {"inside": NOW - timedelta(days=3), "start": NOW - timedelta(days=7), "end": NOW,
          "near": NOW + timedelta(days=6), "far": NOW - timedelta(days=20)}
    got = {k: _window_factor(window, t.timestamp()) for k, t in at.items()}
    assert got == {"inside": W.window_boost, "start": W.window_boost, "end": W.near_window_boost,
                   "near": W.near_window_boost, "far": 1.0}
    c = _Cand(_MESSAGE, 1, ranks={"dense": 0})
    inside, far = (score(c, _meta(1, at[k]), _ui(), _pq(window=window), [], {}, NOW, NEVER_LOOPED)
                   for k in ("inside", "far"))
    plain = score(c, _meta(1, at["inside"]), _ui(), _pq(), [], {}, NOW, NEVER_LOOPED)
    assert inside == pytest.approx(plain * W.window_boost) and far < inside


def test_the_fused_score_sums_weighted_reciprocal_ranks_and_weighs_a_thin_lexical_match_down():
    both = _Cand(_MESSAGE, 1, ranks={"dense": 0, "lexical": 2})
    assert _fused_score(both) == pytest.approx(1 / 10 + 1 / 12)
    thin = _Cand(_MESSAGE, 1, ranks={"dense": 0, "lexical": 2}, lexical_share=0.25)  # sqrt: half its vote
    assert _fused_score(thin) == pytest.approx(1 / 10 + 0.5 / 12)
    assert _fused_score(_Cand(_MEMORY, 1, ranks={"facts": 0})) == pytest.approx(1.5 / 10)
    assert _fused_score(_Cand(_MESSAGE, 1, ranks={"neighbour": 0})) == 0.0
    assert _fused_score(_Cand(_MESSAGE, 1, ranks={"dense": 0})) > _fused_score(_Cand(_MESSAGE, 1, ranks={"dense": 5}))


def test_a_turn_that_only_asks_and_the_models_own_reply_weigh_less():
    ui = _ui(asks={2}, info={3: 0.5})
    assert [_text_prior(ui, i, {1: 0.8}) for i in (1, 2, 3)] == [0.8, W.question_weight, 0.5]
    asked = []

    def looped():
        asked.append(1)
        return {9}

    assert reply_weight(_meta(1), looped) == 1.0 and not asked  # a person's turn: the loop table is not read
    assert reply_weight(_meta(1, role="assistant", name=None), looped) == W.assistant_weight
    assert reply_weight(_meta(9, role="assistant", name=None), looped) == W.assistant_weight * W.looped_weight
    assert reply_weight(_meta(9, role="assistant", name="Tom"), looped) == 1.0  # an imported, named speaker


def test_admitted_keeps_the_hard_filters_and_leaves_out_own_replies_when_asked():
    row, reply = _meta(1, NOW - timedelta(days=2)), _meta(2, NOW, role="assistant", name=None)
    assert admitted(row, None, None, True)
    assert not admitted(row, NOW - timedelta(days=1), None, True)
    assert not admitted(row, None, NOW - timedelta(days=3), True)
    assert admitted(reply, None, None, True) and not admitted(reply, None, None, False)
    assert admitted(_memory(3, 0.5), None, None, False)  # a memory is nobody's reply


def test_the_people_named_lift_their_turns_their_facts_and_turns_that_name_them():
    c = _Cand(_MESSAGE, 1, ranks={"dense": 0})
    theirs = score(c, _meta(1, name="Priya"), _ui(), _pq(people=["Priya"]), ["priya"], {}, NOW, NEVER_LOOPED)
    other = score(c, _meta(1, name="Tom"), _ui(), _pq(people=["Priya"]), ["priya"], {}, NOW, NEVER_LOOPED)
    assert theirs == pytest.approx(other * W.speaker_boost)
    m = _Cand(_MEMORY, 5, ranks={"facts": 0})
    about, not_about = (score(m, _memory(5, 0.5, text), _ui(), _pq(), ["priya"], {}, NOW, NEVER_LOOPED)
                        for text in ("Priya plays the cello", "Tom plays the drums"))
    assert about == pytest.approx(not_about * W.speaker_boost)
    said = Message(id=1, session_id="s", role="user", text="Priya came by on Monday", created_at=NOW, name="Tom")
    assert text_boosted(1.0, said, ["priya"], _pq()) == pytest.approx(W.mention_boost)
    assert text_boosted(1.0, said, ["priya"], _pq(asks_when=True)) == pytest.approx(W.mention_boost * W.when_boost)
    own = replace(said, name="Priya")  # her own turn has its speaker boost already
    assert text_boosted(1.0, own, ["priya"], _pq()) == 1.0


def test_pre_scores_read_window_and_speaker_from_the_index_tables():
    t_in, t_out = (NOW - timedelta(days=2)).timestamp(), (NOW - timedelta(days=90)).timestamp()
    ui = _ui(times={1: t_in, 2: t_out, 3: t_out}, who={1: 0, 2: 0, 3: 1}, codes={"Priya": 0, "Tom": 1})
    cands = [_Cand(_MESSAGE, i, ranks={"dense": 0}) for i in (1, 2, 3)]
    window = TimeWindow(NOW - timedelta(days=7), NOW, "last week")
    got = _pre_scores(ui, cands, _pq(people=["Priya"], window=window), {})
    assert got == pytest.approx([0.1 * W.window_boost * W.speaker_boost, 0.1 * W.speaker_boost, 0.1])


def test_neighbours_are_lent_a_share_of_the_best_lender_weighed_as_their_own_evidence():
    a, b = _Cand(_MESSAGE, 10, score=1.0), _Cand(_MESSAGE, 12, score=0.4)
    near = {(10, 1): 11, (12, -1): 11, (12, 1): 13}
    lent = neighbour_lent([(a, _meta(10)), (b, _meta(12))], near)
    assert lent == pytest.approx({11: W.neighbour_support * 1.0, 13: W.neighbour_support * 0.4})
    assert neighbour_lent([(a, _meta(10))], near, replace(W, neighbour_support=0.0)) == {11: 0.0}
    ui = _ui(asks={11})
    assert lent_score(0.2, ui, _meta(11), {}, NEVER_LOOPED) == pytest.approx(0.2 * W.question_weight)


def test_the_diverse_pick_spreads_sessions_and_repeats_count_less():
    ranked = [(_Cand(_MESSAGE, i, score=s), sid) for i, (s, sid) in enumerate([(1.0, "a"), (0.95, "a"), (0.9, "b")])]
    assert [c.row_id for c, _ in _diverse(ranked, 3, lambda cr: cr[1])] == [0, 2, 1]
    no_decay = replace(W, session_decay=1.0)
    assert [c.row_id for c, _ in _diverse(ranked, 3, lambda cr: cr[1], None, no_decay)] == [0, 1, 2]
    words = {0: frozenset({"home", "today"}), 1: frozenset({"home", "today"}), 2: frozenset({"cello"})}
    other = [(c, f"s{c.row_id}") for c, _ in ranked]  # every item its own session: only repeats reorder
    assert [c.row_id for c, _ in _diverse(other, 3, lambda cr: cr[1], lambda cr: words[cr[0].row_id])] == [0, 2, 1]
    assert [c.score for c, _ in _diverse(ranked, 3, lambda cr: cr[1])] == [1.0, 0.9, 0.95]  # scores unchanged


def test_an_event_is_dated_by_the_latest_strong_match():
    def hit(score: float, days: int) -> Hit:
        return Hit(id=days, kind="message", text="", score=score, similarity=0.0, time=NOW + timedelta(days=days))

    hits = [hit(1.0, 0), hit(0.8, 20), hit(0.5, 40)]  # the third is below anchor_share of the best
    assert event_time(hits) == NOW + timedelta(days=20)
    assert event_time(hits, replace(W, anchor_share=0.4)) == NOW + timedelta(days=40)
    assert event_time(hits, replace(W, anchor_candidates=1)) == NOW
