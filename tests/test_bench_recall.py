"""The recall benchmark's generator keeps its promises, and a tiny run keeps the JSON contract."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest

from agentmem.recall_bench import CATEGORIES, generate, scale_history
from agentmem.recall_bench.bench import ranked_messages, run, scores
from agentmem.recall_bench.words import content_stems, shared_stems


@pytest.fixture(scope="module")
def data():
    return generate(seed=3, conversations=3)


def test_same_seed_same_data_other_seed_other_data():
    a, b, c = generate(5, 2, 6), generate(5, 2, 6), generate(6, 2, 6)
    assert [dataclasses.asdict(x) for x in a.conversations] == [dataclasses.asdict(x) for x in b.conversations]
    assert a.questions == b.questions
    assert [t.text for t in a.conversations[0].turns] != [t.text for t in c.conversations[0].turns]


def test_stems_are_porter_and_skip_stop_words():
    assert content_stems("Which cities has Tom moved to?") == {"citi", "tom", "move"}
    assert shared_stems("When did Priya move house?", "we moved into the new house") == {"move", "hous"}


def test_paraphrase_questions_share_no_content_word_with_their_evidence(data):
    convs = {c.id: c for c in data.conversations}
    para = [q for q in data.questions if q.category == "paraphrase"]
    assert len(para) >= 6
    for q in para:
        assert len(q.evidence) == 1
        assert not shared_stems(q.text, convs[q.conversation].turns[q.evidence[0]].text), q


def test_every_category_present_and_evidence_belongs_to_its_conversation(data):
    assert {q.category for q in data.questions} == set(CATEGORIES)
    convs = {c.id: c for c in data.conversations}
    for q in data.questions:
        turns = convs[q.conversation].turns
        assert q.evidence and all(0 <= i < len(turns) for i in q.evidence), q
        assert len(set(q.evidence)) == len(q.evidence)
        # evidence is said by a speaker of this conversation, on or before its session date
        assert all(turns[i].speaker in convs[q.conversation].speakers for i in q.evidence)


def test_multi_hop_evidence_spans_two_sessions(data):
    convs = {c.id: c for c in data.conversations}
    hops = [q for q in data.questions if q.category == "multi_hop"]
    assert hops
    for q in hops:
        assert len({convs[q.conversation].turns[i].session for i in q.evidence}) == 2, q


def test_distractors_share_more_words_with_the_question_than_the_evidence(data):
    convs = {c.id: c for c in data.conversations}
    for q in (q for q in data.questions if q.category == "distractor"):
        turns = convs[q.conversation].turns
        ev = len(shared_stems(q.text, turns[q.evidence[0]].text))
        near = [t for t in turns if t.index not in q.evidence and len(shared_stems(q.text, t.text)) >= max(2, ev + 1)]
        assert near, q


def test_temporal_answers_follow_from_the_session_date(data):
    convs = {c.id: c for c in data.conversations}
    for q in (q for q in data.questions if q.category == "temporal" and q.text.startswith("When")):
        turn = convs[q.conversation].turns[q.evidence[0]]
        assert q.answer[-10:] <= f"{turn.created_at:%Y-%m-%d}", (q, turn)


def test_conversations_look_like_chat(data):
    conv = data.conversations[0]
    assert 10 <= len(conv.session_dates) <= 25
    assert conv.session_dates == sorted(conv.session_dates)
    assert all(t1.created_at <= t2.created_at for t1, t2 in zip(conv.turns, conv.turns[1:], strict=False))
    sessions = conv.sessions()
    assert all(20 <= len(s) for s in sessions)
    assert {m["role"] for s in sessions for m in s} == {"user", "assistant"}
    assert {m["name"] for s in sessions for m in s} == set(conv.speakers)
    texts = [t.text for t in conv.turns]
    assert any("[image:" in t for t in texts)
    assert len(set(texts)) > len(texts) / 3  # small talk, not one line repeated


def test_scale_history_is_a_timeline():
    msgs, questions = scale_history(1, 700, (10, 20))
    assert len(msgs) == 700 and questions
    assert all(a["created_at"] <= b["created_at"] for a, b in zip(msgs, msgs[1:], strict=False))


def test_scoring_counts_memories_for_their_sources():
    hit = dataclasses.make_dataclass("Hit", ["id", "kind", "source_ids"])
    hits = [hit(7, "fact", [3, 4]), hit(3, "message", [3]), hit(9, "message", [9])]
    assert ranked_messages(hits) == [3, 4, 9]
    r5, r10, ndcg = scores([3, 4, 9], [9, 11])
    assert (r5, r10) == (0.5, 0.5)
    assert math.isclose(ndcg, (1 / math.log2(4)) / (1 + 1 / math.log2(3)))


def test_tiny_run_keeps_the_json_contract(engine, embedder, tmp_path):
    args = argparse.Namespace(seed=0, conversations=1, sessions=3, turns="12,16", scale="60,120", scale_queries=3,
                              no_scale=False, db_url=None, dtype="float32")
    out = run(args, engine, embedder, tmp_path)
    for key in ("evidence_recall_at_5", "evidence_recall_at_10", "ndcg_at_10", "dense_recall_at_10"):
        assert 0.0 <= out[key] <= 1.0
    assert out["lexical_recall_at_10"] is None or 0.0 <= out["lexical_recall_at_10"] <= 1.0
    assert out["evidence_recall_at_5"] <= out["evidence_recall_at_10"]
    assert set(out["by_category"]) == set(CATEGORIES)
    for cat in out["by_category"].values():
        assert set(cat) == {"evidence_recall_at_5", "evidence_recall_at_10", "ndcg_at_10", "dense_recall_at_10",
                            "lexical_recall_at_10", "questions"}
        assert cat["questions"] >= 1 and 0.0 <= cat["evidence_recall_at_10"] <= 1.0
    assert [r["messages"] for r in out["scale"]] == [60, 120]
    for r in out["scale"]:
        assert 0 < r["search_p50_s"] <= r["search_p95_s"] and 0 < r["context_p95_s"]
    assert out["ingest_msgs_per_s"] > 0 and out["dtype"] == "float32"
    assert out["questions"] == sum(c["questions"] for c in out["by_category"].values())
