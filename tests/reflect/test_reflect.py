"""Reflection: facts from what the user said, merged and superseded with links to their
sources, checkpointed and idempotent, insights and the human block, constrained decoding."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from agentmem.config import Config
from agentmem.reflect import (
    HUMAN_BLOCK,
    Prefix,
    ReflectionScheduler,
    choose,
    copy_span,
    pattern_facts,
    reflect,
    slot_of,
)
from agentmem.reflect import job as job_module
from agentmem.reflect.facts import TEMPLATES, TOPICS, ModelExtractor, sentences
from agentmem.tiers import MemoryStore

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def store(tmp_path, embedder):
    s = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    yield s
    s.close()


def _say(store, texts, day=0, user="u1", tenant="t1"):
    sid = store.open_session(tenant, user).id
    msgs = [
        {"role": "user", "content": t, "event_time": T0 + timedelta(days=day, minutes=i)}
        for i, t in enumerate(texts)
    ]
    return store.add_messages(tenant, user, sid, msgs)


def _facts(store, status=None, user="u1"):
    return {m.text: m for m in store.list_memories("t1", user, status=status, kind="fact")}


@pytest.mark.parametrize(
    "sentence, expected",
    [
        (
            "My name is Maria Lopez and I live in Lisbon, Portugal.",
            {"name": "Maria Lopez", "residence": "Lisbon"},
        ),
        ("I just moved to Berlin last week because of work.", {"residence": "Berlin"}),
        ("I got a new job as a software engineer at Siemens.", {"job": "a software engineer at Siemens"}),
        ("My dog's name is Rex.", {"dog's name": "Rex"}),
        ("I'm 34 years old and I love hiking.", {"age": "34", "likes": "hiking"}),
        ("I don't like coffee.", {}),
        ("My day was long.", {}),
    ],
)
def test_templates(sentence, expected):
    got = {f.slot: f.value for f in pattern_facts(sentence, 7)}
    assert got == expected
    for f in pattern_facts(sentence, 7):
        assert slot_of(f.text) == (f.slot, f.value, f.single) and f.source_id == 7


def test_every_template_reads_back():
    for t in TEMPLATES:
        text = t.text.format(attr="cat's name", value="Miso")
        assert slot_of(text)[1] == "Miso"
    assert slot_of("The user's travel: trip to Japan.") == ("topic:travel", "trip to Japan", False)
    assert slot_of("Something else entirely") is None
    assert sentences("Hi! I live in Rome.\nI work as a chef.") == [
        "Hi!",
        "I live in Rome.",
        "I work as a chef.",
    ]


def test_reflect_supersedes_merges_and_is_idempotent(store):
    first = _say(
        store, ["Hi, my name is Maria and I live in Lisbon.", "My dog's name is Rex. I love hiking."]
    )
    store.add_messages(
        "t1",
        "u1",
        store.list_sessions("t1", "u1")[0].id,
        [{"role": "assistant", "content": "I live in the cloud, Maria."}],
    )
    r1 = reflect(store, None, "t1", "u1", use_model=False)
    facts = _facts(store)
    assert set(facts) == {
        "The user's name is Maria.",
        "The user lives in Lisbon.",
        "The user's dog's name is Rex.",
        "The user likes hiking.",
    }
    assert facts["The user lives in Lisbon."].source_ids == [first[0].id]
    assert facts["The user lives in Lisbon."].event_time == first[0].time  # when it was said, not when reflected
    assert len(r1.facts_added) == 4

    assert reflect(store, None, "t1", "u1", use_model=False).facts_added == []  # rerun adds nothing

    later = _say(
        store, ["Big news: I moved to Berlin last week!", "My dog's name is Rex, he says hi."], day=30
    )
    r3 = reflect(store, None, "t1", "u1", use_model=False)
    assert r3.messages_read == 2 and r3.merged == 1
    old, new = _facts(store)["The user lives in Lisbon."], _facts(store)["The user lives in Berlin."]
    assert old.status == "superseded" and old.superseded_by == new.id and new.status == "active"
    assert new.source_ids == [later[0].id] and old.source_ids == [first[0].id]
    assert (old.id, new.id) in r3.superseded
    assert _facts(store)["The user's dog's name is Rex."].importance > 0.7  # mentioned twice
    assert len(store.list_memories("t1", "u1", kind="fact")) == 5


def test_fact_told_out_of_order_does_not_win(store):
    _say(store, ["I live in Paris."], day=10)
    reflect(store, None, "t1", "u1", use_model=False)
    _say(store, ["I live in Madrid."], day=1)  # an imported older message
    reflect(store, None, "t1", "u1", use_model=False)
    facts = _facts(store)
    assert facts["The user lives in Paris."].status == "active"
    assert facts["The user lives in Madrid."].superseded_by == facts["The user lives in Paris."].id


def test_crash_resumes_without_duplicates(store, monkeypatch):
    _say(store, ["I live in Oslo.", "I work as a baker.", "My cat's name is Tom."])
    real = job_module._integrate
    calls = {"n": 0}

    def crash_on_third(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("power cut")
        return real(*a, **k)

    monkeypatch.setattr(job_module, "_integrate", crash_on_third)
    with pytest.raises(RuntimeError):
        reflect(store, None, "t1", "u1", use_model=False)
    assert len(_facts(store)) == 2
    monkeypatch.setattr(job_module, "_integrate", real)
    r = reflect(store, None, "t1", "u1", use_model=False)
    assert r.messages_read == 1
    assert sorted(_facts(store)) == [
        "The user lives in Oslo.",
        "The user works as a baker.",
        "The user's cat's name is Tom.",
    ]


def test_insights_and_human_block(store):
    store.set_core_block("t1", "u1", HUMAN_BLOCK, "Prefers short answers.", limit=120)
    _say(
        store,
        [
            "I love hiking in the Alps.",
            "I love hiking in the Dolomites.",
            "I live in Munich.",
            "My name is Jonas.",
            "I work as a mountain guide.",
        ],
    )
    r = reflect(store, None, "t1", "u1", use_model=False)
    insights = store.list_memories("t1", "u1", kind="insight")
    assert r.insights and all(len(i.source_ids) >= 2 for i in insights)
    assert any("hiking in the Alps" in i.text and "Dolomites" in i.text for i in insights)
    block = {b.label: b for b in store.core_blocks("t1", "u1")}[HUMAN_BLOCK]
    assert block.value.startswith("Prefers short answers.") and len(block.value) <= 120
    assert "- The user's name is Jonas." in block.value  # most important first
    store.add_memory("t1", "u1", "The user's travel: trip to Japan.", 0.95, kind="fact")  # a model guess
    reflect(store, None, "t1", "u1", use_model=False)
    block = {b.label: b for b in store.core_blocks("t1", "u1")}[HUMAN_BLOCK]
    assert "Japan" not in block.value and "- The user's name is Jonas." in block.value


class FakeReuse:
    """Stands in for `agentmem.kvreuse.get_reuse(engine)`: records what it was asked to store."""

    def __init__(self):
        self.segments = []

    def precompute(self, segments):
        self.segments += segments
        return len(segments)


def test_reflect_compresses_memories_and_messages_once(store, engine):
    from agentmem.compress import Compressor

    long = "I work as a nurse at the children's hospital in the north of the city on weekends."
    said = _say(store, [long, "Hi there."])
    compressor = Compressor(engine)
    r = reflect(store, None, "t1", "u1", use_model=False, compressor=compressor, kv_reuse=FakeReuse())
    mems = store.list_memories("t1", "u1", status="active")
    assert mems and all(m.compressed_text for m in mems)
    job = next(m for m in mems if m.text.startswith("The user works as"))
    assert engine.count_tokens(job.compressed_text) < engine.count_tokens(job.text)
    msgs = {m.id: m for m in store.archive.messages("t1", "u1")}
    assert r.messages_compressed == 2
    assert engine.count_tokens(msgs[said[0].id].compressed_text) < engine.count_tokens(long)
    assert msgs[said[1].id].compressed_text == "Hi there."  # too short to gain anything
    hit = next(h for h in store.search("t1", "u1", "nurse hospital", k=10) if h.kind == "message")
    assert hit.compressed_text == msgs[said[0].id].compressed_text  # what the prompt will show
    again = reflect(store, None, "t1", "u1", use_model=False, compressor=compressor, kv_reuse=FakeReuse())
    assert again.messages_compressed == 0 and again.compressed == 0


@pytest.mark.parametrize("always", [False, True])
def test_precomputed_segments_are_the_assemblers(store, engine, always):
    """Chunk KV is keyed on segment text and namespace: reflection must precompute exactly the
    segments a later prompt recalls: original text by default, compressed text when the
    policy always compresses."""
    from agentmem.compress import BudgetPolicy
    from agentmem.session import AgentSession

    _say(store, ["I work as a nurse at the children's hospital in the north of the city on weekends."])
    reflect(store, None, "t1", "u1", use_model=False)
    fact = next(m for m in store.list_memories("t1", "u1", kind="fact"))
    store.update_memory("t1", "u1", fact.id, compressed_text="The user nurse children's hospital weekends.")
    cfg = store.config.model_copy(update={"compress_always": always})
    s = AgentSession("u1", tenant_id="t1", config=cfg, engine=engine, store=store)
    ctx = s.context("What is my job?")
    recalled = {seg.ref: seg for seg in ctx.prompt if seg.tier == "recall" and seg.ref != "recall:header"}
    assert f"memory:{fact.id}" in recalled
    reuse = FakeReuse()
    r = reflect(store, engine, "t1", "u1", use_model=False, kv_reuse=reuse, hot_memories=3,
                policy=BudgetPolicy(always_compress=always))
    assert r.precomputed == len(reuse.segments) >= 1
    by_ref = {seg.ref: seg for seg in reuse.segments}
    assert by_ref[f"memory:{fact.id}"] == recalled[f"memory:{fact.id}"]
    assert ("nurse children's hospital" in by_ref[f"memory:{fact.id}"].text) == always
    assert all(seg.namespace == "t1" and seg.cacheable for seg in reuse.segments)


def test_assembler_uses_compressed_text_only_when_the_originals_do_not_fit(engine):
    from agentmem.assemble import QUESTION_HEADER, RECALL_HEADER, RECALL_SHARE, Assembler, memory_line
    from agentmem.compress import BudgetPolicy
    from agentmem.tiers.records import Hit

    hits = [Hit(i, "message", f"On day {i} I told you that my neighbour's old grey cat sleeps on the porch "
                f"every afternoon while the radio plays number {i}.", 1.0 - i / 10, 0.5, T0 + timedelta(days=i),
                [i], role="user", compressed_text=f"neighbour cat porch radio {i}") for i in range(4)]
    big = Assembler(engine, 2048)
    n_orig = sum(big.count(memory_line(h)) for h in hits)
    n_comp = sum(big.count(memory_line(h, compressed=True)) for h in hits)
    header = big.count(big.user_open + RECALL_HEADER + QUESTION_HEADER)
    assert n_comp + 40 < n_orig
    roomy = big.select_memories(hits)
    assert len(roomy) == 4 and all("grey cat" in seg.text for _, seg in roomy)
    budget = int((header + (n_comp + n_orig) // 2) / RECALL_SHARE) + 1  # fits compressed, not original
    tight = Assembler(engine, budget).select_memories(hits)
    assert len(tight) == 4 and all("grey cat" not in seg.text and "porch radio" in seg.text for _, seg in tight)
    assert sum(seg.tokens for _, seg in tight) == n_comp
    always = Assembler(engine, 2048, BudgetPolicy(always_compress=True)).select_memories(hits)
    assert [seg.text for _, seg in always] == [seg.text for _, seg in tight]


def test_precomputed_kv_is_used_by_the_next_turn(store, engine, tmp_path):
    """With chunk reuse on the engine, reflection stores the hot memories' KV and the next
    turn that recalls them takes it from the cache instead of prefilling them."""
    from agentmem.engine import Engine
    from agentmem.kvreuse import enable_chunk_reuse
    from agentmem.session import AgentSession

    cfg = Config(dtype="float32", device="cpu", kv_mode="blend", kv_disk_dir=tmp_path / "chunks")
    e = Engine(engine.model, engine.tokenizer, engine.model_id, engine.device, cfg)  # the fixture stays as is
    reuse = enable_chunk_reuse(e)
    _say(store, ["I work as a nurse in Oslo."])
    r = reflect(store, e, "t1", "u1", use_model=False, hot_memories=2)
    assert r.precomputed > 0 and reuse.stats()["hits"] == 0
    s = AgentSession("u1", tenant_id="t1", config=store.config, engine=e, store=store)
    s.chat("What is my job?", max_tokens=1)
    recalled = [seg for seg in s.last_turn.segments if seg["tier"] == "recall" and seg["ref"].startswith("memory:")]
    assert recalled and all(seg["kv"] in ("reused", "blended") for seg in recalled)


def test_hot_segments_prefer_the_most_recalled(store):
    from agentmem.reflect import hot_segments

    said = _say(store, ["I live in Oslo.", "My name is Ida.", "I work as a baker."])
    reflect(store, None, "t1", "u1", use_model=False)
    facts = _facts(store)
    oslo, ida = facts["The user lives in Oslo."], facts["The user's name is Ida."]
    sid = store.list_sessions("t1", "u1")[0].id
    for _ in range(3):
        store.record_turn("t1", "u1", sid, {"memories_used": [{"ref": f"memory:{oslo.id}"}]})
    store.record_turn("t1", "u1", sid, {"memories_used": [{"ref": f"message:{said[0].id}"}]})
    segs = hot_segments(store, "t1", "u1", 2)
    assert [s.ref for s in segs] == [f"memory:{oslo.id}", f"message:{said[0].id}"]
    assert segs[1].text.endswith('said: "I live in Oslo."\n')  # the assembler's line for a message
    assert [s.ref for s in hot_segments(store, "t1", "u1", 3)][2] == f"memory:{ida.id}"  # then importance
    assert hot_segments(store, "t1", "u1", 0) == []


def test_memories_are_inspectable_and_correctable(store, engine):
    from agentmem.session import AgentSession

    said = _say(store, ["I live in Oslo.", "I work as a baker."])
    reflect(store, None, "t1", "u1", use_model=False)
    s = AgentSession("u1", tenant_id="t1", config=store.config, engine=engine, store=store)
    mems = {m.text: m for m in s.memories()}
    oslo = mems["The user lives in Oslo."]
    assert oslo.source_ids == [said[0].id] and oslo.status == "active"
    new = s.correct_memory(oslo.id, "The user lives in Bergen.")
    assert new.source_ids == oslo.source_ids and new.status == "active"
    old = next(m for m in s.memories("superseded") if m.id == oslo.id)
    assert old.superseded_by == new.id
    s.delete_memory(mems["The user works as a baker."].id)
    assert {m.text for m in s.memories("active")} == {"The user lives in Bergen."}
    assert "Oslo" not in " ".join(h.text for h in s.search("where do I live", k=10) if h.kind != "message")


def test_constrained_choose_and_copy(engine):
    prefix = Prefix(engine, "Answer with the color.\nQ: What color is the sky on a clear day?\nA: blue\n")
    options = [" red", " blue", " green"]
    pick = choose(prefix, "Q: What color is grass?\nA:", options)
    assert pick in range(3)
    source = "we adopted a puppy named Biscuit in May"
    span = copy_span(prefix, "Q: What is the puppy's name?\nA:", source, max_tokens=4)
    assert span and span in source
    with pytest.raises(ValueError):
        choose(prefix, "x", [" a", " a"])


def test_model_extractor_output_is_well_formed(engine):
    x = ModelExtractor(engine)
    sentence = "We are planning a trip to Japan next spring."
    fact = x.extract(sentence, 3, T0)
    if fact is not None:  # the model may say "none"; if not, the output must follow the grammar
        topic = fact.slot.removeprefix("topic:")
        assert topic in TOPICS and topic != "none"
        said = set(sentence.lower().rstrip(".").split())
        assert set(fact.value.lower().split()) - {"the", "user", "user's", "is", "has"} <= said
        assert slot_of(fact.text) == (fact.slot, fact.value, False) and fact.source_id == 3


def test_scheduler_runs_after_n_turns_or_idle(store):
    _say(store, ["I live in Porto.", "I work as a cook.", "I like tea."], user="a")
    _say(store, ["I live in Faro."], user="b")
    done = []
    sched = ReflectionScheduler(store, None, every_turns=3, idle_s=60, on_report=done.append, use_model=False)
    soon = datetime.now(UTC)  # b's only turn was stored a moment ago: not idle yet
    assert sched.due(now=soon) == [("t1", "a")]
    assert [r.user_id for r in sched.run_due(now=soon)] == ["a"]
    assert sched.due(now=soon) == []
    _say(store, ["I play chess."], user="a")  # one new turn: not due until idle
    later = datetime.now(UTC) + timedelta(hours=1)
    assert sorted(sched.due(now=later)) == [("t1", "a"), ("t1", "b")]
    assert sorted(r.user_id for r in sched.run_due(now=later)) == ["a", "b"] and len(done) == 3
    assert _facts(store, user="b") and "The user plays chess." in _facts(store, user="a")
    with pytest.raises(ValueError):
        ReflectionScheduler(store, None, every_turns=0)
    store.delete_user("t1", "a")
    assert sched.checkpoints.get("t1", "a") == 0 and sched.checkpoints.get("t1", "b") > 0


def test_scheduler_thread_reflects_in_the_background(store):
    done = threading.Event()
    sched = ReflectionScheduler(store, None, every_turns=1, poll_s=0.05, use_model=False,
                                on_report=lambda r: done.set())
    sched.start()
    try:
        _say(store, ["I live in Lima."])
        sched.notify()
        assert done.wait(30)
    finally:
        sched.stop(5)
    assert "The user lives in Lima." in _facts(store)


def test_cli_reflects_every_user(tmp_path, monkeypatch, capsys, embedder):
    monkeypatch.setenv("AGENTMEM_DATA_DIR", str(tmp_path))
    s = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    _say(s, ["I live in Kyoto."], user="ken")
    s.close()
    monkeypatch.setattr("agentmem.tiers.embed.load_embedder", lambda *a, **k: embedder)
    from agentmem.reflect.cli import main

    assert main(["--no-model", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["users"] == 1 and out["reports"][0]["facts_added"]
    assert main(["--user", "nobody", "--tenant", "t1", "--no-model"]) == 1


def test_scheduler_loads_a_lazy_engine_only_when_someone_is_due(store):
    loads, built = [], []

    def load():
        loads.append(1)
        return None  # templates only: no model is needed for this check

    def make_compressor(engine):
        built.append(engine)
        return None

    sched = ReflectionScheduler(store, load, every_turns=1, use_model=False, compressor=make_compressor)
    assert sched.run_due() == [] and loads == [] and built == []
    _say(store, ["I live in Oslo."])
    assert [r.user_id for r in sched.run_due()] == ["u1"]
    assert loads == [1] and built == [None]
    _say(store, ["I live in Bergen."])
    sched.run_due()  # the compressor is built once, the engine asked for on every due pass
    assert loads == [1, 1] and built == [None]
    assert "The user lives in Bergen." in _facts(store, status="active")


def test_service_starts_background_reflection_when_asked(tmp_path, embedder):
    from agentmem.api import create_app

    cfg = Config(data_dir=tmp_path)
    s = MemoryStore(cfg, embedder=embedder)
    try:
        app = create_app(cfg, store=s, ui=False, reflect_every_turns=5, reflect_idle_s=30)
        sched = app.state.services.reflection
        assert sched.every_turns == 5 and sched.idle_s == 30 and sched._thread.is_alive()
        sched.stop(5)
        assert create_app(cfg, store=s, ui=False).state.services.reflection is None
    finally:
        s.close()


def test_reflect_engine_none_reflects_by_templates_and_loads_no_model(tmp_path, embedder):
    """AGENTMEM_REFLECT_ENGINE=none beside a remote engine: reflection runs on the templates
    alone, the compressor is not built, and neither the remote engine nor a local model is
    loaded (the URL here answers nothing)."""
    from agentmem.api import create_app
    from agentmem.api.local import free_port

    cfg = Config(data_dir=tmp_path, engine_url=f"http://127.0.0.1:{free_port()}", reflect_engine="none")
    s = MemoryStore(cfg, embedder=embedder)
    try:
        services = create_app(cfg, store=s, ui=False, reflect_every_turns=1).state.services
        _say(s, ["I live in Oslo."])
        services.reflection.notify()
        deadline = time.monotonic() + 60
        while "The user lives in Oslo." not in _facts(s, status="active"):
            assert time.monotonic() < deadline, "the background pass wrote no fact"
            time.sleep(0.2)
        services.reflection.stop(5)
        assert services._engine is None and services._local is None
        with pytest.raises(ValueError, match="local, remote or none"):
            create_app(Config(data_dir=tmp_path, reflect_engine="bogus"), store=s, ui=False, reflect_every_turns=1)
    finally:
        s.close()


def test_the_compression_bench_counts_a_memory_line_text_without_its_neighbour_turn():
    """`compression_ratio` is over the memory texts; the neighbour turn a recalled message line
    quotes (never compressed) belongs to the prompt-line ratio only."""
    from agentmem.bench.memory_reflect import _content

    assert _content('- 2026-01-02 Priya said: "The cello!" (in reply to Tom: "What did you buy?")\n') == "The cello!"
    assert _content('- 2026-01-02 I said: "What did you buy?" (Priya answered: "a cello")\n') == "What did you buy?"
    assert _content('- 2026-01-02 I said: "a pilot (long-haul) now"\n') == "a pilot (long-haul) now"
    assert _content("- 2026-01-02 fact: user works as a pilot\n") == "user works as a pilot"
