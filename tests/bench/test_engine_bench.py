"""The engine benchmark's own arithmetic, and the kernels benchmark's CLI contract. The full
benchmark is a command (`agentmem bench engine`), not a test."""

import json

from agentmem.bench.engine import chat_prompt_ids, decode_weight_bytes, prefill_flops, prose_ids
from agentmem.cli import BENCHES


def test_prose_prompt_has_exactly_the_asked_tokens_and_is_seeded(engine):
    a = prose_ids(engine, 300)
    assert len(a) == 300
    assert a == prose_ids(engine, 300)
    assert a != prose_ids(engine, 300, seed=1)
    assert len(set(a)) > 50  # varied text, not one sentence repeated


def test_decode_weight_bytes_are_the_model_weights_one_step_reads(engine):
    m = engine.model
    per_layer = [(b.wqkv, b.o_proj.weight, b.w_gate_up, b.down_proj.weight) for b in m.layers]
    n = sum(w.numel() for ws in per_layer for w in ws) + m.lm_head.weight.numel()
    assert decode_weight_bytes(m.args, 4) == 4 * n


def test_prefill_flops_grow_with_the_quadratic_attention_term(engine):
    a = engine.model.args
    one, two = prefill_flops(a, 1024), prefill_flops(a, 2048)
    linear_per_token = 2 * (decode_weight_bytes(a, 1) - a.vocab_size * a.dim)
    assert one > 1024 * linear_per_token
    assert two - 2 * one > 0  # attention is superlinear; the single LM-head row is not


def test_kernels_bench_is_a_cli_bench_printing_json_last(capsys):
    module, _ = BENCHES["kernels"]
    from importlib import import_module

    assert import_module(module).main(["--small", "--json", "--iters", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["dtype"] == "bfloat16"
    assert any(k.endswith("_torch_ms") and v > 0 for k, v in result.items() if isinstance(v, float))


def test_the_ttft_prompt_is_a_chat_turn_of_exactly_the_asked_tokens(engine):
    ids = chat_prompt_ids(engine, 350, seed=0)
    assert len(ids) == 350 and ids != chat_prompt_ids(engine, 350, seed=1)
    prefix = engine.encode(engine.chat.generation_prefix)
    assert ids[-len(prefix):] == prefix  # the prompt ends where the reply starts


def test_timed_decode_runs_every_asked_token_of_a_looping_reply(engine):
    """The engine bench times decode over exactly its tokens, as HF's generate() makes them: a
    reply the loop detector would cut (a greedy reply that repeats) runs to its length."""
    from agentmem.bench.engine import TIMED

    segs = engine.chat_segments([{"role": "user", "content": "I moved to Lisbon last month and I work as a pharmacist."}])
    assert engine.generate(segs, max_tokens=96, temperature=0.0).stats.finish_reason == "repetition"
    timed = engine.generate(segs, max_tokens=96, temperature=0.0, **TIMED)
    assert timed.stats.finish_reason == "length" and timed.stats.completion_tokens == 96
