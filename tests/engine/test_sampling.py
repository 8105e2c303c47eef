"""Sampling settings against hand-computed logits, per-sequence settings in one batch, the
loop detector, sampling defaults, and decoding under a grammar."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from agentmem.config import Config
from agentmem.engine import InvalidSampling, SamplingParams
from agentmem.engine.defaults import sampling_defaults
from agentmem.engine.grammar import Grammar, InvalidGrammar
from agentmem.engine.repetition import LoopDetector, find_loop
from agentmem.engine.sampler import penalize, top_logprobs, truncate


def _logits() -> torch.Tensor:
    return torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    p = SamplingParams(repetition_penalty=2.0).validate()
    out = penalize(_logits(), p, prompt_ids=torch.tensor([0, 1]), reply_ids=[3, 3])
    # seen: 0 (prompt, 2.0 -> 1.0), 1 (prompt, -1.0 -> -2.0), 3 (reply, 3.0 -> 1.5); others untouched
    assert out.tolist() == [1.0, -2.0, 0.5, 1.5, -2.0, 0.0]


def test_frequency_and_presence_penalties_count_reply_tokens_only():
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25).validate()
    out = penalize(_logits(), p, prompt_ids=torch.tensor([2]), reply_ids=[3, 3, 3, 5])
    # token 3: 3.0 - 3*0.5 - 0.25 = 1.25; token 5: 0.0 - 0.5 - 0.25 = -0.75; prompt token 2 untouched
    assert out.tolist() == [2.0, -1.0, 0.5, 1.25, -2.0, -0.75]


def test_logit_bias_is_added_before_the_penalties():
    p = SamplingParams(logit_bias={4: 10.0, "1": -100}, repetition_penalty=2.0).validate()
    assert p.logit_bias == {4: 10.0, 1: -100.0}
    out = penalize(_logits(), p, prompt_ids=None, reply_ids=[4])
    assert out[4] == pytest.approx((-2.0 + 10.0) / 2.0) and out[1] == -101.0


def test_top_k_top_p_and_min_p_truncate_the_tempered_distribution():
    x = _logits()
    kept = lambda p: (truncate(x, SamplingParams(temperature=1.0, **p).validate()) > -math.inf).nonzero().flatten().tolist()  # noqa: E731
    assert kept({"top_k": 2}) == [0, 3]
    probs = torch.softmax(x, -1)  # sorted: 3 (.60), 0 (.22), 2 (.08), 5 (.04)...
    assert probs[3] < 0.7 < probs[3] + probs[0]
    assert kept({"top_p": 0.7}) == [0, 3]  # the smallest set whose mass reaches 0.7
    assert kept({"min_p": 0.1}) == [i for i in range(6) if probs[i] >= 0.1 * probs[3]]
    t = truncate(x, SamplingParams(temperature=0.5).validate())
    assert torch.allclose(t, x / 0.5)


def test_logprobs_are_the_models_distribution():
    lp, alts = top_logprobs(_logits(), 0, 2)
    ref = torch.log_softmax(_logits(), -1)
    assert lp == pytest.approx(float(ref[0])) and [a for a, _ in alts] == [3, 0]


@pytest.mark.parametrize("bad", [
    {"top_k": -1}, {"min_p": 1.5}, {"repetition_penalty": 0.0}, {"frequency_penalty": 2.5},
    {"presence_penalty": -3}, {"logit_bias": {"x": 1}}, {"logit_bias": {5: 101}}, {"top_logprobs": 3},
    {"logprobs": True, "top_logprobs": 21}, {"temperature": float("nan")},
])
def test_bad_settings_raise_invalid_sampling_naming_the_field(bad):
    with pytest.raises(InvalidSampling, match=next(iter(bad)).split("_logprobs")[0]):
        SamplingParams(**bad).validate(vocab_size=10)


def test_loop_detector_cuts_a_cycle_to_one_round_and_leaves_lists_alone():
    intro, cycle = [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]
    toks = intro + cycle * 5
    cut = find_loop(toks)
    assert cut == len(intro) + len(cycle)  # what came before, and the cycle once
    assert find_loop([5] * 30) == 1
    # a numbered list: the same shape every line, different items: no loop
    items = [[100 + i, 1, 2, 200 + i, 300 + i, 3] for i in range(12)]
    assert find_loop([t for it in items for t in it]) is None
    assert find_loop(cycle * 2) is None  # two rounds are not yet a loop


def test_loop_detector_settles_only_what_no_later_cut_removes():
    intro, cycle = [7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]
    toks = intro + cycle * 5
    cut = find_loop(toks)
    d, settled = LoopDetector(), []
    for t in toks:
        if d.push(t) is not None:
            break
        settled.append(d.settled())
    assert all(s <= cut for s in settled) and settled == sorted(settled) and len(settled) < len(toks)
    assert settled[len(intro) + len(cycle) - 1] == len(intro) + len(cycle)  # nothing repeats yet: all settled
    d = LoopDetector()
    for i in range(200):  # prose that never repeats settles as it comes
        d.push(1000 + i)
        assert d.settled() == i + 1


def test_a_streamed_looping_reply_sends_what_is_stored(engine):
    segs = engine.chat_segments([{"role": "user", "content": "I moved to Lisbon last month and I work as a pharmacist."}])
    s = engine.stream(segs, max_tokens=96, temperature=0.0)
    pieces = list(s)
    assert s.result.stats.finish_reason == "repetition"
    assert "".join(pieces) == s.result.text and len(pieces) > 1


def test_loop_detector_on_real_text(engine):
    looping = "Nossa mesação, açúnha! *sounds of salsa and chile*\n" * 4
    ids = engine.encode("Hello! " + looping)
    cut = find_loop(ids)
    assert cut is not None and engine.decode(ids[:cut]).count("salsa") == 1
    listing = "".join(f"{i}. Buy {w} at the market.\n" for i, w in
                      enumerate(["apples", "bread", "milk", "eggs", "rice", "tea", "soap", "salt"], 1))
    assert find_loop(engine.encode(listing)) is None


def test_a_looping_reply_ends_with_finish_reason_repetition(engine):
    segs = engine.chat_segments([{"role": "user", "content": "I moved to Lisbon last month and I work as a pharmacist."}])
    free = engine.generate(segs, max_tokens=96, temperature=0.0, stop_loops=False)
    cut = engine.generate(segs, max_tokens=96, temperature=0.0)
    assert free.stats.finish_reason == "length" and find_loop(free.token_ids) is not None
    assert cut.stats.finish_reason == "repetition"
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)] and find_loop(cut.token_ids) is None


def test_penalties_reach_generation(engine):
    segs = engine.chat_segments([{"role": "user", "content": "List ten fruits."}])
    a = engine.generate(segs, max_tokens=24, temperature=0.0)
    banned = a.token_ids[0]
    b = engine.generate(segs, max_tokens=24, temperature=0.0, logit_bias={banned: -100})
    assert b.token_ids[0] != banned
    c = engine.generate(segs, max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=3)
    assert c.token_ids == a.token_ids and len(c.logprobs) == len(c.token_ids)
    assert all(alts[0][0] == tok for tok, _, alts in c.logprobs)  # greedy: the chosen token is the top one


def test_batched_sequences_with_their_own_settings_equal_each_alone(engine):
    prompts = [engine.chat_segments([{"role": "user", "content": q}]) for q in
               ("Tell me about the sea.", "Name three birds.", "What is a violin?", "Describe a forest.")]
    settings = [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_k": 20, "seed": 3},
        {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3, "seed": 5},
        {"temperature": 0.0, "frequency_penalty": 1.0, "presence_penalty": 0.5, "logit_bias": {13: 5.0}},
    ]
    alone = [engine.generate(p, max_tokens=16, **s).token_ids for p, s in zip(prompts, settings, strict=True)]
    together: list = [None] * 4
    go = threading.Barrier(4)

    def run(i):
        go.wait()
        together[i] = engine.generate(prompts[i], max_tokens=16, **settings[i]).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_sampling_defaults_come_from_the_card_then_the_config_then_settings(tmp_path):
    assert sampling_defaults(None, "SmolLM2-135M-Instruct-Q4_1", Config()) == {
        "temperature": 0.2, "top_p": 0.9, "frequency_penalty": 0.3, "presence_penalty": 0.3}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20,
                                                                "repetition_penalty": 1.05}))
    got = sampling_defaults(tmp_path, "SmolLM2-x", Config(sample_top_p=0.5, sample_presence_penalty=0.1))
    assert got == {"temperature": 0.6, "top_p": 0.5, "top_k": 20, "repetition_penalty": 1.05, "presence_penalty": 0.1}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert sampling_defaults(tmp_path, "other", Config())["temperature"] == 0.0


def test_engine_defaults_are_not_greedy(engine):
    assert engine.sampling_defaults["temperature"] > 0


def test_grammar_decoding_matches_the_schema(engine):
    from jsonschema import validate

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
              "required": ["city", "year"], "additionalProperties": False}
    segs = engine.chat_segments([{"role": "user", "content": "Where and when were you born? Answer in JSON."}])
    for s in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 2}):
        g = engine.generate(segs, max_tokens=64, grammar=Grammar.json_schema(schema), **s)
        validate(json.loads(g.text), schema)
        assert g.stats.finish_reason == "stop"


def test_a_bad_schema_is_refused_before_generation(engine):
    with pytest.raises(InvalidGrammar, match="unclosed group"):
        engine.generate("hi", max_tokens=4, grammar=Grammar.json_schema({"type": "string", "pattern": "(("}))


def test_copy_guard_keeps_a_reply_from_repeating_an_earlier_one(engine):
    segs = engine.chat_segments([{"role": "user", "content": "What is the capital of France?"}])
    first = engine.generate(segs, max_tokens=20, temperature=0.0).token_ids
    again = engine.generate(segs, max_tokens=20, temperature=0.0, copy_ngram=3, copy_sources=[first]).token_ids
    grams = lambda ids: {tuple(ids[i : i + 3]) for i in range(len(ids) - 2)}  # noqa: E731
    assert len(first) >= 3 and not grams(first) & grams(again)
    with pytest.raises(InvalidSampling, match="copy_ngram"):
        SamplingParams(copy_ngram=1).validate()


def _literal(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


def test_a_grammar_list_ends_at_a_whole_item_when_another_would_not_fit(engine):
    item = _literal(6)
    g = Grammar(f'start: item ("\\n" item){{0,5}}\nitem: "{item}"')
    end_down = {t: -100.0 for t in engine.eos_ids}  # the model would go on as long as it may
    n = len(engine.encode(item))
    r = engine.generate("List:", max_tokens=2 * n + 4, grammar=g, logit_bias=end_down, temperature=0.0)
    # after two items fewer tokens are left than the longest item took: ended, whole
    assert r.stats.finish_reason == "budget" and r.text == item + "\n" + item


def test_max_tokens_inside_a_further_item_rolls_back_to_the_last_whole_one(engine):
    g = Grammar(f'start: "ok" ("\\n" "{_literal(20)}")?')
    end_down = {t: -100.0 for t in engine.eos_ids}
    stream = engine.stream("Say:", max_tokens=8, grammar=g, logit_bias=end_down, temperature=0.0, logprobs=True)
    pieces = list(stream)
    r = stream.result
    assert r.stats.finish_reason == "length" and r.text == "ok"  # never half an item after whole ones
    assert "".join(pieces) == "ok"  # nothing was streamed that the roll-back removed
    assert len(r.logprobs) == len(r.token_ids) == r.stats.completion_tokens


def test_where_a_grammar_may_end_what_it_forbids_goes_to_the_end(engine):
    from agentmem.api.reply_format import CALL_CLOSE, CALL_OPEN

    call = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": {"type": "object"}},
            "required": ["name", "arguments"]}
    eos = sorted(engine.eos_ids)
    newline, word = engine.encode("\n")[0], engine.encode("Hello")[0]
    for bias, ends in ((None, True), ({t: -100.0 for t in eos}, False)):
        m = engine.grammars.matcher(Grammar.choice([call], CALL_OPEN, CALL_CLOSE, most=4))
        for t in engine.encode(f'{CALL_OPEN}{{"name":"f","arguments":{{}}}}{CALL_CLOSE}'):
            m.consume(t)
        x = torch.full((engine.model.args.vocab_size,), -20.0)
        x[newline], x[word] = 2.0, 5.0  # prose is what the model wants; the grammar forbids it
        for t in eos:
            x[t] = 0.0 + (bias or {}).get(t, 0.0)
        m.mask(x, bias)
        assert math.isinf(x[word]) and (max(float(x[t]) for t in eos) > x[newline]) == ends
    one = engine.grammars.matcher(Grammar.choice([call], CALL_OPEN, CALL_CLOSE, most=1))
    for t in engine.encode(f'{CALL_OPEN}{{"name":"f","arguments":{{}}}}{CALL_CLOSE}'):
        one.consume(t)
    assert one.done  # one call allowed: the reply ends as it closes


def test_default_penalties_stay_off_grammar_bound_replies():
    from agentmem.engine.sampler import with_defaults

    defaults = {"temperature": 0.2, "frequency_penalty": 0.3, "presence_penalty": 0.3}
    free = with_defaults(defaults, max_tokens=8)
    bound = with_defaults(defaults, max_tokens=8, grammar=Grammar.json_object())
    asked = with_defaults(defaults, max_tokens=8, grammar=Grammar.json_object(), frequency_penalty=0.5)
    assert (free.frequency_penalty, free.presence_penalty) == (0.3, 0.3)
    assert (bound.frequency_penalty, bound.presence_penalty, bound.temperature) == (0.0, 0.0, 0.2)
    assert asked.frequency_penalty == 0.5


def test_argmax_is_torchs_on_rows_and_one_row_ties_and_nan_included():
    """sampler.argmax (numpy's on fp32 CPU tensors, for speed) picks what torch's argmax picks:
    the first of equal values, a NaN as the largest, strided rows."""
    import torch

    from agentmem.engine.sampler import argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 1000, generator=g)
    x[3, 7] = x[3, 9] = 1e9  # a tie: the first
    x[5, 11] = float("nan")
    with torch.inference_mode():
        y = x.clone()
        for t in (x, y, x.t(), x[2], x.to(torch.bfloat16)):
            assert torch.as_tensor(argmax(t)).tolist() == t.argmax(-1).tolist()
