"""A looping reply through a session: cut, stored with one cycle, flagged in its trace, ranked
lower by recall; the copy metric; the MemGPT tools' grammar."""

from __future__ import annotations

import pytest

from agentmem.config import Config
from agentmem.reply_metrics import copies_earlier, copy_previous_rate, distinct_2
from agentmem.session import AgentSession
from agentmem.tiers import MemoryStore


@pytest.fixture
def session(tmp_path, engine, embedder):
    cfg = Config(data_dir=tmp_path, dtype="float32", device="cpu")
    store = MemoryStore(cfg, embedder=embedder)
    yield AgentSession("lou", config=cfg, engine=engine, store=store)
    store.close()


def test_a_looping_reply_is_stored_once_flagged_and_ranked_lower(session, engine):
    word = engine.encode(" banana")
    assert len(word) == 1
    reply = session.chat("Say anything.", max_tokens=48, temperature=0.0, logit_bias={word[0]: 100.0})
    trace = session.last_turn
    assert trace.stats.finish_reason == "repetition" and reply.strip() == "banana"
    stored = session.store.session_messages("default", "lou", session.session_id)[-1]
    assert stored.role == "assistant" and stored.text == "banana"
    assert session.store.turns("default", "lou")[-1].trace["stats"]["finish_reason"] == "repetition"
    archive = session.store.archive
    assert archive.looped_replies("default", "lou") == {stored.id}
    from agentmem.tiers import recall

    def score() -> float:
        return next(h.score for h in session.search("banana", k=10) if h.id == stored.id)

    flagged = score()
    old, recall.LOOPED_WEIGHT = recall.LOOPED_WEIGHT, 1.0
    try:
        plain = score()
    finally:
        recall.LOOPED_WEIGHT = old
    assert flagged == pytest.approx(0.5 * plain)


def test_memory_answers_are_judged_by_the_value_as_a_word():
    from agentmem.bench.memory import Question

    q = Question("u", "allergy", "Which substance gives me a bad reaction?", "peanuts", None, 0)
    assert q.answered_by("You are allergic to peanuts.") and q.answered_by("A peanut allergy, I believe.")
    assert not q.answered_by("You mentioned peanutbutter cookies.") and not q.answered_by("Shellfish.")
    job = Question("u", "job", "What do I do for a living?", "pilot", "nurse", 0)
    assert job.answered_by("You're a Pilot now.") and not job.answered_by("You set the autopilot.")
    assert not job.answered_by("You work as a nurse.")


def test_copy_metric():
    assert copies_earlier("Your dog is called Biscuit.", ["Your dog is called Biscuit!"])
    assert copies_earlier("I live in Oslo and I like the sea a lot.", ["Hi. I live in Oslo and I like the sea a lot."])
    assert not copies_earlier("Your dog is called Biscuit.", ["Your city is Oslo."])
    assert not copies_earlier("Biscuit", ["Oslo"])
    assert copy_previous_rate([["a b c", "a b c", "d e f"], ["x y z"]]) == pytest.approx(0.5)
    assert distinct_2(["a b a b", "c d"]) == pytest.approx(3 / 4)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_looped_replies_are_read_from_turn_traces(backend, tmp_path, request):
    from agentmem.tiers.archive import Archive

    url = request.getfixturevalue("pg_url") if backend == "postgresql" else f"sqlite:///{tmp_path / 'a.db'}"
    a = Archive(url)
    for user in ("u", "v"):  # a turn is recorded in an existing session (never an orphan of a deleted user)
        a.open_session("t", user, "s")
    a.record_turn("t", "u", "s", {"stats": {"finish_reason": "repetition"}, "message_ids": [1, 2]})
    a.record_turn("t", "u", "s", {"stats": {"finish_reason": "stop"}, "message_ids": [3, 4]})
    a.record_turn("t", "v", "s", {"stats": {"finish_reason": "repetition"}, "message_ids": [5, 6]})
    a.record_turn("t", "u", "s", {"stats": {"finish_reason": "repetition"}, "message_ids": [7]})  # no reply stored
    assert a.looped_replies("t", "u") == {2} and a.looped_replies("t", "v") == {6}
