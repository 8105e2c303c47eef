"""AgentSession end to end on the shared fp32 engine: the turn, streaming, prompt assembly,
eviction into the summary, bad input, forgetting, a new process, concurrent sessions."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from datetime import UTC, datetime

import pytest

from agentmem import AgentSession
from agentmem.config import Config
from agentmem.engine import InvalidSampling
from agentmem.engine.sampler import SamplingParams
from agentmem.tiers import InvalidInput, MemoryStore, NotFound, WorkingContext
from agentmem.tiers.records import Message

FACT = "My dog is called Biscuit."


@pytest.fixture
def make(tmp_path, engine, embedder):
    stores = []

    def make(user="alice", budget=2048, **kw):
        cfg = Config(data_dir=tmp_path, dtype="float32", device="cpu", context_budget=budget)
        store = MemoryStore(cfg, embedder=embedder)
        stores.append(store)
        return AgentSession(user, config=cfg, engine=engine, store=store, **kw)

    yield make
    for s in stores:
        s.close()


def test_turn_is_traced_and_a_new_process_remembers(make):
    s1 = make()
    reply = s1.chat(FACT, max_tokens=6)
    assert isinstance(reply, str)
    t = s1.last_turn
    assert t.stats.prompt_tokens == sum(seg["tokens"] for seg in t.segments)
    assert t.segments[0]["tier"] == "system" and t.segments[-1]["tier"] == "generation"
    assert len(t.message_ids) == (2 if reply.strip() else 1)
    assert t.to_dict()["stats"]["prompt_tokens"] == t.stats.prompt_tokens
    s2 = make()  # a fresh store and session on the same data dir: a new process
    assert s2.session_id != s1.session_id
    ctx = s2.context("What is my dog's name?")
    recalled = [seg for seg in ctx.segments if seg.tier == "recall" and seg.ref != "recall:header"]
    assert any(FACT in seg.text for seg in recalled)
    assert any(h.text == FACT and h.kind == "message" for h in ctx.memories)
    assert s2.store.turns("default", "alice", s1.session_id)[0].trace["segments"][0]["tier"] == "system"


def test_stream_commits_the_user_message_before_generating(make):
    s = make()
    it = s.chat("Tell me a word.", stream=True, max_tokens=5)
    stored = s.store.session_messages("default", "alice", s.session_id)
    assert [m.text for m in stored] == ["Tell me a word."]  # durable before the first token
    text = "".join(it)
    msgs = s.store.session_messages("default", "alice", s.session_id)
    assert s.last_turn.reply == text.strip()
    if text.strip():
        assert msgs[-1].role == "assistant" and msgs[-1].text == text.strip()


def test_chat_stream_and_chat_store_the_same_kind_of_turn(make):
    s = make()
    it = s.chat_stream("Say one word.", max_tokens=5, seed=3)
    assert not isinstance(it, str)  # one return type: an iterator, even before the first piece
    assert [m.text for m in s.store.session_messages("default", "alice", s.session_id)] == ["Say one word."]
    streamed = "".join(it)
    assert s.last_turn.reply == streamed.strip()
    # chat() returns the reply's text itself, stored as chat_stream's is
    replied = s.chat("Say another word.", max_tokens=5, seed=3)
    assert isinstance(replied, str) and s.last_turn.reply == replied.strip()
    stored = s.store.session_messages("default", "alice", s.session_id)
    assert stored[-1].text == replied.strip() or not replied.strip()
    with pytest.raises(TypeError):
        s.chat_stream("hi", stream=True)  # the flag belongs to chat alone


def test_memory_segments_are_stable_and_ordered(make):
    s = make()
    s.add_messages([{"role": "user", "content": FACT}, {"role": "user", "content": "I live in Lisbon."}])
    s2 = make()
    a = s2.context("What is my dog called?")
    b = s2.context("Remind me about my dog.")
    seg_a = {x.ref: x.text for x in a.segments if x.tier == "recall"}
    seg_b = {x.ref: x.text for x in b.segments if x.tier == "recall"}
    shared = set(seg_a) & set(seg_b) - {"recall:header"}
    assert shared and all(seg_a[r] == seg_b[r] for r in shared)
    prompt = a.prompt
    assert all(p.namespace == "default" for p in prompt)
    assert not prompt[-1].cacheable and all(p.cacheable for p in prompt[:-1])
    tiers = [x.tier for x in a.segments]
    assert tiers.index("recall") < tiers.index("user") < tiers.index("generation")


def test_recent_turns_without_their_replies_are_recalled_not_replayed(make):
    s = make()
    s.add_messages([{"role": "user", "content": "My name is Bob."}, {"role": "assistant", "content": "Hi Bob!"},
                    {"role": "user", "content": "Tell me about tide pools."}])
    ctx = s.context("What is my name?")
    assert not [x for x in ctx.segments if x.tier == "turn"]  # no run of unanswered user turns
    notes = [x.text for x in ctx.segments if x.tier == "recall"]
    assert any('I said: "My name is Bob."' in t for t in notes) and "Hi Bob!" not in "".join(notes)
    s.config = s.config.model_copy(update={"prompt_replies": True})  # replies in: the turns are chat turns
    ctx = s.context("What is my name?")
    assert [x.text for x in ctx.segments if x.tier == "turn"][:2] == [
        s.engine.format_message("user", "My name is Bob."), s.engine.format_message("assistant", "Hi Bob!")]
    assert not [x for x in ctx.segments if x.tier == "recall" and "Bob" in x.text]  # not twice


def test_replies_that_never_become_notes_do_not_take_the_notes_places(make):
    """The assistant's own replies are found by search but never shown as notes: when they
    fill the top hits, the prompt still gets the user's turns (the turn's search leaves the
    replies out, `own_replies=False`), up to `recall_k` notes."""
    s = make()
    msgs = [{"role": "user", "content": "I live in Lisbon."}, {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "I baked bread on Sunday."}]
    msgs += [{"role": "assistant", "content": f"What a good way to spend these days, at home in town {i}!"}
             for i in range(12)]
    s.add_messages(msgs)
    s2 = make()
    question = "Which town is home for me these days?"
    top = s2.search(question, k=s2.config.recall_k)
    assert sum(h.role == "assistant" for h in top) >= 8  # the replies crowd the top hits
    mine = s2.store.search(s2.tenant_id, s2.user_id, question, k=10, own_replies=False)
    assert not any(h.role == "assistant" for h in mine) and "I live in Lisbon." in [h.text for h in mine]
    notes = [x.text for x in s2.context(question).segments if x.tier == "recall" and x.ref.startswith("message:")]
    assert any("I live in Lisbon." in t for t in notes)
    assert not any("good way to spend" in t for t in notes) and len(notes) <= s2.config.recall_k
    s2.config = s2.config.model_copy(update={"recall_k": 2})  # the user's only two turns
    notes = [x.text for x in s2.context(question).segments if x.tier == "recall" and x.ref.startswith("message:")]
    assert len(notes) == 2 and any("I live in Lisbon." in t for t in notes)


def test_eviction_folds_old_turns_into_the_summary(make):
    s = make(budget=600)
    msgs = [{"role": "user", "content": f"Note {i}: the meeting about topic {i} moved to room {100 + i}."}
            for i in range(40)]
    stored = s.add_messages(msgs)
    first_kept = s.working.queue[0].id
    assert s.working.evictions >= 1 and first_kept > stored[0].id
    last_evicted = next(m for m in reversed(stored) if m.id < first_kept)
    assert s.working.summary.splitlines()[-1].endswith(last_evicted.text)
    assert s.search("meeting about topic 0", k=1)[0].id == stored[0].id  # evicted, still recalled
    ctx = s.context("Where is the meeting about topic 39?")
    assert ctx.total_tokens <= 600
    assert [x.tier for x in ctx.segments].count("summary") == 1
    summary = s.store.archive.latest_summary("default", "alice", s.session_id)
    assert summary.text == s.working.summary
    resumed = make(session_id=s.session_id)  # a resumed session loads summary and queue
    assert resumed.working.summary == s.working.summary
    assert [m.id for m in resumed.working.queue] == [m.id for m in s.working.queue]


def test_huge_message_is_stored_and_the_turn_fits(make, engine):
    s = make(budget=512)
    huge = "Lots of words about nothing in particular, repeated for a long while. " * 600
    huge += "What is the last word of this message?"
    assert engine.count_tokens(huge) > engine.context_window
    s.chat(huge, max_tokens=3)
    assert s.store.session_messages("default", "alice", s.session_id)[0].text == huge
    assert s.last_turn.stats.prompt_tokens <= s.config.context_budget


def test_bad_input_is_refused_before_anything_is_stored(make):
    s = make()
    for bad in (b"\xc3\x28", "", "  \n ", "a\x00b"):
        with pytest.raises(InvalidInput):
            s.chat(bad)
    assert s.store.session_messages("default", "alice", s.session_id) == []
    with pytest.raises(InvalidInput):
        s.search("")
    for bad in ({"top_p": 0.0}, {"temperature": -1.0}, {"stop": [""]}, {"max_tokens": -2}):
        with pytest.raises(InvalidSampling):
            s.chat("Hello there.", **bad)
    assert s.store.session_messages("default", "alice", s.session_id) == []


def test_chat_takes_sampling_params_and_warns_on_the_old_positional_call(make):
    s = make()
    s.chat("Say one word.", SamplingParams(max_tokens=3, seed=1))
    assert s.last_turn.stats.completion_tokens <= 3
    with pytest.warns(DeprecationWarning, match="positionally"):
        s.chat("Say one word.", 2)
    assert s.last_turn.stats.completion_tokens <= 2
    with pytest.raises(TypeError, match="unknown argument"):
        s.chat("Say one word.", max_token=3)


def test_sampling_reaches_the_engine(make):
    s = make()
    greedy = {"temperature": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    free = s.chat("Count from one to ten in words, separated by commas.", max_tokens=24, **greedy)
    assert "," in free
    cut = s.chat("Count from one to ten in words, separated by commas.", max_tokens=24, stop=",", **greedy)
    assert "," not in cut and len(cut) < len(free)
    a = make(user="carol").chat("Say something about the sea.", max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    b = make(user="bob").chat("Say something about the sea.", max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    assert a == b  # the same prompt and seed give the same sample


def test_forget_deletes_every_tier(make):
    s = make()
    s.add_messages([{"role": "user", "content": FACT}])
    s.store.add_memory("default", "alice", "Dog: Biscuit")
    index_path = s.store.recall._paths("default", "alice")[0]
    assert s.search("dog")
    s.store.recall.flush("default", "alice")
    assert index_path.exists()
    old_session = s.session_id
    s.forget()
    assert s.search("dog") == [] and s.memories() == []
    assert s.store.list_sessions("default", "alice") == [s.store.list_sessions("default", "alice")[0]]
    assert s.store.list_sessions("default", "alice")[0].id != old_session
    assert s.working.queue == [] and s.working.summary == ""


def test_concurrent_sessions_of_one_user(make):
    a, b = make(), make()
    out, errors = {}, []

    def talk(sess, text):
        try:
            out[sess.session_id] = sess.chat(text, max_tokens=4)
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=talk, args=(a, "I like tea.")),
               threading.Thread(target=talk, args=(b, "I like coffee."))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(out) == 2
    texts = {m.text for sess in (a, b) for m in sess.store.session_messages("default", "alice", sess.session_id)}
    assert {"I like tea.", "I like coffee."} <= texts
    assert a.search("coffee", k=1)[0].text == "I like coffee."


class _FailingEngine:
    """The shared engine, except that generation fails."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def stream(self, *args, **kw):
        raise RuntimeError("the accelerator fell over")


def test_message_is_committed_even_when_generation_fails(tmp_path, engine, embedder):
    cfg = Config(data_dir=tmp_path, dtype="float32", device="cpu")
    store = MemoryStore(cfg, embedder=embedder)
    s = AgentSession("alice", config=cfg, engine=_FailingEngine(engine), store=store)
    with pytest.raises(RuntimeError):
        s.chat(FACT)
    assert [m.text for m in store.session_messages("default", "alice", s.session_id)] == [FACT]
    assert store.search("default", "alice", "dog name", k=1)[0].text == FACT
    store.close()


def test_unknown_and_bad_user_ids(make):
    s = make(user="nobody-yet")
    assert s.search("dog") == [] and s.memories() == []
    assert not [x for x in s.context("What is my dog called?").segments if x.tier == "recall"]
    with pytest.raises(NotFound):
        s.store.export_user("default", "never-seen")
    for bad in ("", "  ", "x" * 201, 42, "a\x00b"):
        with pytest.raises(InvalidInput):
            make(user=bad)


def test_fit_evicts_past_the_trigger_into_the_summary():
    words = len  # one token per character keeps the arithmetic visible

    def msg(i, role, text):
        return Message(i, "s", role, text, datetime(2026, 1, 1, tzinfo=UTC))

    wc = WorkingContext(None, "t", "u", "s", words, budget=100, persist=False)
    wc.push([msg(1, "user", "a" * 20 + ". more"), msg(2, "assistant", "b" * 20), msg(3, "user", "c" * 20),
             msg(4, "assistant", "d" * 10)])
    assert wc.fit(other_tokens=90 - wc.queue_tokens()) == [] and wc.summary == ""  # at 0.9: stays
    evicted = wc.fit(other_tokens=91 - wc.queue_tokens())
    assert [m.id for m in evicted] == [1, 2]  # down to 0.6, never splitting a turn from its reply
    assert [m.id for m in wc.queue] == [3, 4] and wc.summary_upto == 2 and wc.evictions == 1
    assert wc.summary == "- 2026-01-01 user: " + "a" * 20 + "."


def test_chat_repl_in_a_new_process_shows_remembered_memories(make, tmp_path):
    make().add_messages([{"role": "user", "content": FACT}])
    env = dict(os.environ, AGENTMEM_DATA_DIR=str(tmp_path), AGENTMEM_DTYPE="float32", AGENTMEM_DEVICE="cpu",
               AGENTMEM_KV_MODE="full")
    out = subprocess.run([sys.executable, "-m", "agentmem.cli", "chat", "--user", "alice", "--show-memories",
                          "--max-tokens", "3"], input="What is my dog called?\n/search dog\n/quit\n", env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    shown = [ln for ln in out.stdout.splitlines() if ln.strip().startswith("* message:")]
    assert any(FACT in ln for ln in shown), out.stdout  # the memory its prompt used, from the first process
    assert "bot> " in out.stdout and "prompt tokens" in out.stdout
    # /search found it: "<score> message:<id> <date>: <text>" (the prompt "you> " may lead the line)
    assert re.search(r"\d\.\d{3} message:\d+ \S+: " + re.escape(FACT), out.stdout), out.stdout


def test_a_session_sees_what_another_object_wrote_after_its_summary(make):
    """The sync check reads only the session's messages after the summary (count, newest id):
    another object (a replica) adding a turn, or the user deleted, reloads the working
    context; nothing changed, nothing reloads."""
    a = make(budget=600)
    a.add_messages([{"role": "user", "content": f"Note {i}: room {100 + i} is booked for topic {i}."}
                    for i in range(40)])
    assert a.working.summary_upto > 0
    queue = [m.id for m in a.working.queue]
    assert a.store.archive.session_tail("default", "alice", a.session_id, a.working.summary_upto) == \
        (len(queue), queue[-1])
    before = a.working
    a.sync()
    assert a.working is before  # in step: not reloaded
    b = make(session_id=a.session_id)
    new = b.add_messages([{"role": "user", "content": "Written by the other replica."}])
    a.sync()
    assert a.working is not before and a.working.queue[-1].id == new[0].id
    a.store.delete_user("default", "alice")
    assert a.store.archive.session_tail("default", "alice", a.session_id, 0) is None
    a.sync()
    assert a.working.queue == [] and a.working.summary == ""
