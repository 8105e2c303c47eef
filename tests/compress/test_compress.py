"""Compression: LLMLingua runs offline on the engine, keeps what carries a fact, and the
budget policy picks compressed text only where it must."""

from __future__ import annotations

import pytest
import torch

from agentmem.compress import BudgetPolicy, Compressor, EngineLM, compress_memory

FACT = "My dog's name is Rex and I live in Lisbon, Portugal, since 2019."
LONG = (
    "I started a new job as a nurse at the city hospital last Monday, and honestly the night "
    "shifts are exhausting but I love my colleagues and the patients are kind to me."
)


@pytest.fixture(scope="module")
def compressor(engine):
    return Compressor(engine)


def test_engine_lm_with_past_matches_one_pass(engine):
    lm = EngineLM(engine)
    ids = torch.tensor([engine.encode(LONG)])
    full = lm(ids).logits
    first = lm(ids[:, :9])
    rest = lm(ids[:, 9:], past_key_values=first.past_key_values)
    assert rest.past_key_values[0][0].shape[2] == ids.shape[1]
    assert torch.allclose(torch.cat([first.logits, rest.logits], 1), full, atol=1e-3)
    ref = engine.logits(ids[0].tolist())
    assert torch.allclose(full[0], ref, atol=1e-3)


def test_constructs_without_network(engine, monkeypatch):
    import tiktoken

    def no_download(*a, **k):
        raise AssertionError("tiktoken must not be used")

    monkeypatch.setattr(tiktoken, "encoding_for_model", no_download)
    monkeypatch.setattr(tiktoken, "get_encoding", no_download)
    text, stats = Compressor(engine).compress(LONG, 0.5)
    assert stats.method == "llmlingua"


def test_compress_halves_and_keeps_the_fact(compressor, engine):
    text, stats = compressor.compress(FACT, 0.5)
    assert stats.original_tokens == engine.count_tokens(FACT)
    assert stats.compressed_tokens == engine.count_tokens(text)
    assert stats.rate <= 0.75
    for word in ("Rex", "Lisbon", "2019"):
        assert word in text
    long_text, long_stats = compressor.compress(LONG, 0.5)
    assert long_stats.rate <= 0.6
    assert "nurse" in long_text


def test_words_are_kept_or_dropped_whole(compressor, engine):
    """Half a word is a new word: "Sub" of "Subaru" would misstate the fact."""
    text = "I sold my old hatchback last spring and now I drive a Subaru Outback with a roof box."
    assert any(len(engine.encode(" " + w)) > 1 for w in ("Subaru", "hatchback", "Outback"))
    for rate in (0.5, 0.3):
        out, stats = compressor.compress(text, rate)
        assert stats.method == "llmlingua"
        words = set(text.replace(".", "").split())
        assert set(out.replace(".", "").split()) <= words, out


def test_rate_one_and_short_text_are_verbatim(compressor):
    assert compressor.compress(LONG, 1.0)[0] == LONG
    text, stats = compressor.compress("I like tea.", 0.3)
    assert text == "I like tea." and stats.method == "none"


def test_bad_input_is_rejected(compressor):
    with pytest.raises(ValueError):
        compressor.compress(FACT, 0.0)
    with pytest.raises(ValueError):
        compressor.compress(FACT, 1.5)
    with pytest.raises(TypeError):
        compressor.compress(None, 0.5)
    with pytest.raises(ValueError):
        compressor.compress_for_question([FACT], "  ", 10)


def test_question_aware_ranks_and_cuts(compressor, engine):
    contexts = [LONG, FACT, "I think I will switch from Python to Rust for the backend of my side project."]
    text, stats = compressor.compress_for_question(contexts, "Where do I live?", 20)
    assert stats.method == "longllmlingua"
    assert stats.compressed_tokens < stats.original_tokens
    assert "Lisbon" in text


def test_compress_memory_follows_policy(compressor):
    policy = BudgetPolicy(rates={"recall": 0.5})
    assert compress_memory(compressor, LONG, "core", policy) == LONG
    assert len(compress_memory(compressor, LONG, "recall", policy)) < len(LONG)


def test_budget_plan_compresses_in_order_only_when_needed():
    p = BudgetPolicy(rates={"recall": 0.5, "summary": 0.6}, order=("recall", "summary"))
    original = {"system": 100, "recall": 600, "summary": 300, "turn": 200}
    compressed = {"recall": 280, "summary": 170}
    fits = p.plan(original, compressed, 1500)
    assert not any(fits.use_compressed.values()) and fits.tokens == 1200 and fits.fits
    one = p.plan(original, compressed, 1000)
    assert one.use_compressed == {"system": False, "recall": True, "summary": False, "turn": False}
    assert one.tokens == 880 and one.fits
    both = p.plan(original, compressed, 700)
    assert both.use_compressed["summary"] and both.tokens == 750 and not both.fits
    with pytest.raises(ValueError):
        BudgetPolicy(rates={"recall": 0.0})
    with pytest.raises(ValueError):
        p.plan(original, compressed, 0)


def test_question_aware_turn_replaces_recall_with_one_uncached_segment(engine, embedder, tmp_path):
    from agentmem.compress.question import REF
    from agentmem.config import Config
    from agentmem.session import AgentSession
    from agentmem.tiers import MemoryStore

    store = MemoryStore(Config(data_dir=tmp_path, context_budget=512), embedder=embedder)
    try:
        old = AgentSession("u", tenant_id="t", config=store.config, engine=engine, store=store)
        old.add_messages([{"role": "user", "content": t} for t in (FACT, LONG, "I collect old maps of Portugal.")])
        s = AgentSession("u", tenant_id="t", config=store.config, engine=engine, store=store)
        plain = s.context("Where do I live?")
        recalled = [seg for seg in plain.segments if seg.tier == "recall" and seg.ref != "recall:header"]
        assert len(recalled) >= 2
        s.chat("Where do I live?", max_tokens=1, question_aware_tokens=16)
        segs = [seg for seg in s.last_turn.segments if seg["tier"] == "recall"]
        assert [seg["ref"] for seg in segs] == ["recall:header", REF]
        assert segs[1]["tokens"] < sum(seg.tokens for seg in recalled)
        assert segs[1]["kv"] == "prefilled"
    finally:
        store.close()
