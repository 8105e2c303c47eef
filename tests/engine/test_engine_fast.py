"""The engine's fast paths: projection weight formats (linear.py) and the compiled decode step
(compiled.py), on a tiny Llama checkpoint (test_models' builder) so each load takes a second."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch
from test_models import build_tokenizer, hf_config, randomize

from agentmem.config import Config
from agentmem.engine import Engine, EngineLoop
from agentmem.engine.kernels import cpu_bf16
from agentmem.engine.linear import (
    PREFILL_SLACK,
    ROWS_MATH_GAIN,
    dense,
    fastest,
    is_four_bit,
    make_proj,
    pick_weights,
    q4_kernel,
    resolve_rows_math,
    resolve_weights,
)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from transformers import LlamaForCausalLM

    tok = build_tokenizer("llama3")
    path = tmp_path_factory.mktemp("tiny-llama")
    hf = LlamaForCausalLM(hf_config("LlamaConfig", len(tok), tok, num_attention_heads=4, num_key_value_heads=2,
                                    tie_word_embeddings=False))
    randomize(hf, seed=3)
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def load(path, **kw) -> Engine:
    return Engine.load(Config(model_path=path, device="cpu", kv_mode="full", **kw))


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("fmt,dtype,rel", [("fp32", torch.float32, 1e-6), ("bf16", torch.bfloat16, 1e-2),
                                           ("int8", torch.float32, 1.5e-2), ("int8", torch.bfloat16, 2e-2),
                                           ("int4", torch.bfloat16, 0.12)])
def test_a_projection_in_each_format_multiplies_within_its_error(fmt, dtype, rel):
    g = torch.Generator().manual_seed(0)
    w, b = 0.05 * torch.randn(192, 128, generator=g), torch.randn(192, generator=g)
    for rows in (1, 7, 600):  # decode, a few rows, past the transposed-copy limit
        x = torch.randn(rows, 128, generator=g)
        p = make_proj(w.to(dtype), b.to(dtype), fmt)
        out = p(x.to(dtype))
        assert out.dtype == dtype and out.shape == (rows, 192)
        ref = x @ w.t() + b
        assert (out.float() - ref).norm() / ref.norm() < rel
    assert (dense(make_proj(w.to(dtype), None, fmt)) - w).abs().max() < 10 * rel * w.abs().max()


def test_int8_and_int4_weights_load_generate_and_stay_near_fp32(tiny_path):
    """On random weights a 3-layer model amplifies any rounding (bf16 alone moves the max
    logit by ~25% of their spread), so each format is held to a bound next to bf16's."""
    x = ids(200)
    ref = load(tiny_path, dtype="float32").logits(x)
    errs = {}
    for fmt, dtype in (("bf16", "auto"), ("int8", "float32"), ("int4", "bfloat16")):
        e = load(tiny_path, dtype=dtype, weights=fmt)
        # int4 keeps the LM head in int8 (model.py: a 4-bit head would round every logit)
        assert e.weights == fmt and e.model.layers[0].qkv_p.fmt == fmt
        assert e.model.head_p.fmt == ("int8" if fmt == "int4" else fmt)
        lg = e.logits(x)
        errs[fmt] = (float((lg - ref).abs().max()), float((lg.argmax(-1) == ref.argmax(-1)).float().mean()),
                     float(torch.corrcoef(torch.stack([lg.flatten(), ref.flatten()]))[0, 1]))
        assert len(e.generate(x[:20], max_tokens=12, ignore_eos=True).token_ids) == 12
    assert errs["int8"][0] < 2 * errs["bf16"][0] and errs["int8"][1] >= 0.9 and errs["int8"][2] > 0.999, errs
    assert errs["int4"][2] > 0.9, errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_layer_kernels_are_chosen_when_the_weights_are_packed(dtype, monkeypatch):
    """Which library's layer kernels a block and a model take (fused_decode.choose) is settled by
    `pack`: the fused decode calls where the rows' library loaded and the weights are on its
    routes (u8/q4 for bf16 rows, avx2/q4 for fp32 ones), its separate calls for other weights or
    with the fused calls off, nothing without the library or off the CPU. (No product runs here:
    stand-in libraries.)"""
    from agentmem.engine import fused_decode as FD
    from agentmem.engine import model as M
    from agentmem.engine.kernels import cpu_fp32

    bf16 = dtype == torch.bfloat16
    lib, other = (cpu_bf16, cpu_fp32) if bf16 else (cpu_fp32, cpu_bf16)
    fused, rows = (FD.Bf16Fused, FD.Bf16Rows) if bf16 else (FD.Fp32Fused, FD.Fp32Rows)
    monkeypatch.setattr(cpu_bf16, "q8_route", "u8")  # the route int8 weights take when built
    monkeypatch.setattr(other, "_lib", None)
    args = M.ModelArgs(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=192, head_dim=32)
    model = M.Transformer(args).to(dtype)
    for blk in model.layers:
        blk.fuse()
    monkeypatch.setattr(lib, "_lib", None)
    model.pack("int8")
    assert model.kernels is FD.REFERENCE and all(b.kernels is FD.REFERENCE for b in model.layers)
    stand_in = object()
    monkeypatch.setattr(lib, "_lib", stand_in)
    assert model.kernels is FD.REFERENCE  # not asked again until the weights are packed
    model.pack("int8")
    assert type(model.kernels) is fused and model.kernels.lib is stand_in
    assert all(type(b.kernels) is fused for b in model.layers)
    model.set_kernels(fused=False)
    assert type(model.kernels) is rows and all(type(b.kernels) is rows for b in model.layers)
    monkeypatch.setenv("AGENTMEM_FUSED_DECODE", "off")
    model.pack("int4")
    assert type(model.kernels) is rows
    monkeypatch.delenv("AGENTMEM_FUSED_DECODE")
    model.pack("bf16" if bf16 else "fp32")  # dense weights: nothing to fuse
    assert type(model.kernels) is rows and all(type(b.kernels) is rows for b in model.layers)
    with torch.device("meta"):
        block = M.Block(args, 0).to(dtype)
    block.fuse()
    block.pack("bf16" if bf16 else "fp32")
    assert block.kernels is FD.REFERENCE


def test_the_weights_setting_is_checked_and_follows_an_explicit_dtype(tmp_path):
    cpu = torch.device("cpu")
    shape = (256, 64)
    assert resolve_weights("auto", torch.float32, True, cpu, shape, tmp_path) == "fp32"  # exactness asked
    assert resolve_weights("int8", torch.float32, True, cpu, shape, tmp_path) == "int8"
    with pytest.raises(ValueError, match="contradict"):
        resolve_weights("bf16", torch.float32, True, cpu, shape, tmp_path)
    with pytest.raises(ValueError, match="weights must be"):
        resolve_weights("int3", torch.float32, False, cpu, shape, tmp_path)
    with pytest.raises(ValueError, match="CPU only"):
        make_proj(torch.zeros(4, 32, device="meta"), fmt="int8")


@pytest.mark.parametrize("record,four_bit,choice", [
    ({"weights": "int8", "one_row_us": {"bf16": 186.0, "int8": 101.5, "int4": 49.9}}, True, "int4"),
    ({"weights": "int8", "one_row_us": {"bf16": 186.0, "int8": 101.5, "int4": 49.9}}, False, "int8"),
    ({"weights": "int8", "one_row_us": {"bf16": 186.0, "int8": 50.0, "int4": 60.0}}, True, "int8"),
    ({"weights": "bf16", "one_row_us": {"bf16": 40.0, "int8": 50.0, "int4": 30.0}}, True, "bf16"),
    ({"weights": "int8", "one_row_us": {"bf16": 186.0, "int8": 101.5}}, True, "int8"),  # no q4 kernel here
])
def test_auto_takes_int4_only_for_4bit_weights_where_it_decodes_faster(record, four_bit, choice):
    assert pick_weights(record, "bf16", lambda: four_bit) == choice


def test_4bit_weights_are_told_from_others():
    """`is_four_bit`: weights llama.cpp's Q4_1 quantizer made from a bf16 model (each group's d and
    m in fp16 from its bf16 minimum and maximum), and their bf16 copy, are; dense ones are not."""
    g = torch.Generator().manual_seed(1)
    orig = (0.05 * torch.randn(64, 4, 32, generator=g)).bfloat16().float()
    lo, hi = orig.amin(-1, keepdim=True), orig.amax(-1, keepdim=True)
    d, m = ((hi - lo) / 15).half().float(), lo.half().float()
    w = (((orig - m) / d).round().clamp(0, 15) * d + m).view(64, 128)
    assert is_four_bit([w]) and is_four_bit([w.bfloat16()])
    assert not torch.equal(w.bfloat16().float(), w)  # the bf16 copy is not the 4-bit weight itself
    assert not is_four_bit([w, orig.view(64, 128)]) and not is_four_bit([torch.randn(64, 128).bfloat16()])
    assert not is_four_bit([torch.randn(64, 100)])  # not in whole groups


def test_the_auto_choice_is_measured_once_and_remembered(tmp_path):
    choice = fastest("fp32", (256, 64), tmp_path)
    assert choice in ("fp32", "int8")
    memo = json.loads((tmp_path / "weights-choice.json").read_text())
    (entry,) = memo.values()
    timed = {"fp32", "int8"} | ({"int4"} if q4_kernel(torch.float32) else set())  # int4 where a q4 kernel is here
    assert entry["weights"] == choice and set(entry["one_row_us"]) == timed
    decode, prefill = entry["one_row_us"], entry["rows_512_us"]  # int8 must win both
    assert (choice == "int8") == (decode["int8"] < decode["fp32"] and prefill["int8"] <= PREFILL_SLACK * prefill["fp32"])
    entry["weights"] = "int8" if choice == "fp32" else "fp32"  # a remembered choice is not re-measured
    (tmp_path / "weights-choice.json").write_text(json.dumps(memo))
    assert fastest("fp32", (256, 64), tmp_path) == entry["weights"]


def test_the_auto_choice_does_not_time_the_same_prefill_product_twice(tmp_path):
    """With the AVX512-BF16 kernels int8's many rows multiply a bf16 copy of the dequantized
    weight, bf16's own product: only decode decides (a noisy 512-row timing once chose bf16)."""
    if cpu_bf16.loaded() is None:
        pytest.skip("the AVX512-BF16 kernels are not loaded here")
    choice = fastest("bf16", (256, 64), tmp_path)
    ((key, entry),) = json.loads((tmp_path / "weights-choice.json").read_text()).items()
    assert "|int8 rows on a bf16 copy" in key
    assert entry["rows_512_us"]["int8"] == entry["rows_512_us"]["bf16"]
    decode = entry["one_row_us"]
    assert choice == ("int8" if decode["int8"] < decode["bf16"] else "bf16")  # not a 4-bit model: no int4
    assert ("int4" in decode) == key.endswith("|int4 on q4") == q4_kernel()


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_many_bf16_rows_multiply_widened_to_fp32_alike(fmt):
    """rows_math fp32 (widened for sgemm) gives the bf16 product of many rows within bf16's
    rounding, in bf16; few rows (the decode kernels) are not touched by it."""
    g = torch.Generator().manual_seed(1)
    w, b = (0.05 * torch.randn(192, 128, generator=g)).bfloat16(), torch.randn(192, generator=g).bfloat16()
    p = make_proj(w, b, fmt)
    for rows in (3, 64, 600):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        p.rows_math, p._prefill_w = "bf16", None
        narrow = p(x)
        p.rows_math, p._prefill_w = "fp32", None
        wide = p(x)
        assert wide.dtype == torch.bfloat16 and wide.shape == (rows, 192)
        ref = x.float() @ dense(p).float().t() + b.float()
        assert (wide.float() - ref).norm() / ref.norm() < 5e-3
        assert (wide.float() - narrow.float()).norm() / ref.norm() < 1e-2
        if rows == 3 and p.w_gemv is not None:
            assert torch.equal(wide, narrow)  # the decode kernel either way


def test_the_rows_math_setting_is_checked_and_measured_once(tmp_path, tiny_path):
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    shape = (256, 64)
    assert resolve_rows_math("fp32", bf16, cpu, shape, tmp_path) == "fp32"
    assert resolve_rows_math("auto", torch.float32, cpu, shape, tmp_path) == "bf16"  # nothing to widen
    with pytest.raises(ValueError, match="rows_math must be"):
        resolve_rows_math("fp16", bf16, cpu, shape, tmp_path)
    assert not (tmp_path / "weights-choice.json").exists()  # explicit choices time nothing
    choice = resolve_rows_math("auto", bf16, cpu, shape, tmp_path)
    (entry,) = json.loads((tmp_path / "weights-choice.json").read_text()).values()
    times = entry["rows_512_us"]
    assert entry["rows_math"] == choice and (choice == "fp32") == (times["fp32"] * ROWS_MATH_GAIN < times["bf16"])
    e = load(tiny_path, dtype="bfloat16", weights="bf16", rows_math="fp32")
    assert e.model.rows_math == "fp32" and {p.rows_math for p in e.model.projections()} == {"fp32"}
    x = ids(120)
    wide = e.logits(x)
    e.model.set_rows_math("bf16")
    assert {p.rows_math for p in e.model.projections()} == {"bf16"}
    narrow = e.logits(x)
    assert float(torch.corrcoef(torch.stack([wide.flatten(), narrow.flatten()]))[0, 1]) > 0.999
    assert float((wide.argmax(-1) == narrow.argmax(-1)).float().mean()) > 0.95


def drive(e: Engine, loop: EngineLoop, prompts: list[list[int]], n: int) -> list[list[int]]:
    streams = [e.stream(p, max_tokens=n, ignore_eos=True, loop=loop) for p in prompts]
    for s in streams:
        for _ in s:
            pass
    return [s.result.token_ids for s in streams]


def test_compiled_decode_gives_the_eager_greedy_tokens(tiny_path):
    e = load(tiny_path, dtype="float32", compile="on")  # the default cache dir: compiled once per machine
    loop = EngineLoop(e)
    compiled = loop.runner.compiled
    compiled.background = False  # compile at first use, so every decode step below runs compiled
    one = [ids(30, seed=1)]
    three = [ids(n, seed=n) for n in (5, 40, 90)]  # 3 rows: a padded bucket of 4
    got_one, got_three = drive(e, loop, one, 64), drive(e, loop, three, 64)
    assert compiled.ready == {(1, 256), (4, 256)} and compiled.failed is None
    assert compiled.compile_s > 0
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(e.config.cache_dir / "inductor")  # not /tmp
    eager = EngineLoop(e)
    eager.runner.compiled = None
    assert got_one == drive(e, eager, one, 64)
    assert got_three == [drive(e, eager, [p], 64)[0] for p in three]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_compile_auto_compiles_nothing_where_the_fused_decode_step_runs(tiny_path, monkeypatch, weights):
    from agentmem.engine.compiled import CompiledDecode
    from agentmem.engine.fused_decode import Bf16Fused, Fp32Fused

    fused = (Bf16Fused, Fp32Fused)
    e = load(tiny_path, dtype="float32", weights=weights, compile="auto")
    if not isinstance(e.model.kernels, fused):
        pytest.skip(f"no fused C decode step for {weights} on this CPU")
    assert EngineLoop(e).runner.compiled is None
    assert isinstance(EngineLoop(load(tiny_path, dtype="float32", weights=weights, compile="on")).runner.compiled,
                      CompiledDecode)  # asked for, it is still there
    monkeypatch.setenv("AGENTMEM_FUSED_DECODE", "off")
    unfused = load(tiny_path, dtype="float32", weights=weights, compile="auto")
    assert not isinstance(unfused.model.kernels, fused)
    c = EngineLoop(unfused).runner.compiled
    assert isinstance(c, CompiledDecode) and c.measure


def test_compile_auto_times_both_paths_per_bucket_and_keeps_the_faster(tiny_path, tmp_path, monkeypatch):
    """compile=auto on the CPU: a compiled bucket's first steps alternate compiled and eager,
    TRIALS each, then the bucket keeps the one whose best step was faster; the tokens are
    eager's greedy ones whichever path ran."""
    from agentmem.engine import compiled as compiled_mod

    monkeypatch.setattr(compiled_mod, "machine_busy", lambda: None)
    monkeypatch.setenv("AGENTMEM_FUSED_DECODE", "off")  # with the fused C step auto compiles nothing (below)
    e = load(tiny_path, dtype="float32", compile="auto", cache_dir=tmp_path)
    loop = EngineLoop(e)
    c = loop.runner.compiled
    assert c.measure  # compile=on does not measure (the test above)
    c.background = False
    ran = []
    run = c.run
    monkeypatch.setattr(c, "run", lambda *a, **k: ran.append("compiled") or run(*a, **k))
    got = drive(e, loop, [ids(30, seed=1)], 24)
    assert c.chosen.keys() == {(1, 256)}
    n = compiled_mod.TRIALS
    assert ran.count("compiled") >= n  # it ran compiled for its trials, and after them if it won
    eager = EngineLoop(e)
    eager.runner.compiled = None
    assert got == drive(e, eager, [ids(30, seed=1)], 24)
    # the rule itself, on made-up timings: alternate, then the faster by its best step
    b = (2, 512)
    picks = []
    for t_c, t_e in ((5.0, 3.0), (4.0, 9.0), (6.0, 3.5)):
        picks += [c.prefer(b)]
        c.record(b, True, t_c)
        picks += [c.prefer(b)]
        c.record(b, False, t_e)
    assert picks == [True, False] * 3 and c.chosen[b] is False and not c.prefer(b)  # 4.0 compiled vs 3.0 eager
    c.record(b, True, 0.1)  # decided: later steps do not reopen it
    assert c.chosen[b] is False
    # remembered for this machine and setting: the next loop starts with both choices, never
    # compiles the bucket that measured eager, and still compiles one that measured compiled
    again = EngineLoop(e).runner.compiled
    assert again.chosen == c.chosen and again.chosen[b] is False
    again.background = False
    assert again.get(2, 300) is None and b not in again.ready and again._busy is None
    assert again.get(2, 40) is None and (2, 256) not in again.ready  # its batch size measured eager
    again.chosen[(1, 256)] = True
    assert again.get(1, 30) == (1, 256)
    # another machine (other SIMD flags) is another key: nothing remembered there; and a choice
    # timed while the machine is busy is used, not saved
    monkeypatch.setattr(compiled_mod, "simd_flags", lambda: "other flags")
    other = EngineLoop(e).runner.compiled
    assert other.chosen == {}
    monkeypatch.setattr(compiled_mod, "machine_busy", lambda: "load average 9.0 on 2 cores")
    for t in (1.0, 2.0, 1.0, 2.0, 1.0, 2.0):
        other.record((4, 256), t == 1.0, t)
    assert other.chosen[(4, 256)] is True and EngineLoop(e).runner.compiled.chosen == {}


def test_a_compile_failure_falls_back_to_eager_and_says_why(tiny_path, tmp_path, caplog, monkeypatch):
    e = load(tiny_path, dtype="float32", compile="on", cache_dir=tmp_path)
    loop = EngineLoop(e)
    compiled = loop.runner.compiled
    compiled.background = False

    def broken(*args):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(compiled, "_fn", broken)
    with caplog.at_level(logging.WARNING, logger="agentmem.engine"):
        got = drive(e, loop, [ids(30, seed=1)], 16)
    assert "no C++ compiler here" in compiled.failed and "decoding eagerly" in caplog.text
    assert compiled.get(1, 10) is None and not compiled.ready
    eager = EngineLoop(e)
    eager.runner.compiled = None
    assert got == drive(e, eager, [ids(30, seed=1)], 16)


def test_a_compile_past_its_time_limit_leaves_decode_eager(tiny_path, tmp_path):
    e = load(tiny_path, dtype="float32", compile="on", cache_dir=tmp_path, compile_timeout_s=5)
    compiled = EngineLoop(e).runner.compiled
    compiled._busy = ((1, 256), time.monotonic() - 6)  # a background compile started 6 s ago
    assert compiled.get(1, 10) is None
    assert "took over 5 s" in compiled.failed
    assert load(tiny_path, dtype="float32", compile="off").loop.runner.compiled is None


def test_a_closed_loop_stops_its_thread_and_fails_what_it_held(tiny_path):
    e = load(tiny_path, dtype="float32", compile="off")
    loop = EngineLoop(e)
    assert drive(e, loop, [ids(20)], 4)[0]  # the thread runs
    thread = loop._thread
    stream = e.stream(ids(20, seed=2), max_tokens=10_000, ignore_eos=True, loop=loop)
    next(iter(stream))  # in the middle of a long generation
    assert loop.close(5.0) and not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        for _ in stream:
            pass
    with pytest.raises(RuntimeError, match="closed"):
        e.generate(ids(5), max_tokens=2, loop=loop)
    assert loop.close()  # again: nothing to do


def test_background_compiles_are_waited_for_at_exit(tiny_path):
    """At exit no background compile starts and those in flight finish first (a process that
    exited under one aborted); `wait_for_compiles` is what atexit runs."""
    from agentmem.engine import compiled as compiled_mod

    e = load(tiny_path, dtype="float32", compile="on")
    c = EngineLoop(e).runner.compiled
    assert c.background
    assert c.get(1, 40) is None  # its compile starts in the background
    try:
        assert compiled_mod.wait_for_compiles(300.0)
        assert (1, 256) in c.ready or c.failed is not None
        assert c.get(2, 40) is None and (2, 256) not in c.ready and c._busy is None  # none starts now
    finally:
        compiled_mod._exiting = False


@pytest.mark.slow  # loads a model in three fresh interpreters
def test_a_script_that_exits_right_after_generating_exits_cleanly(tiny_path, tmp_path):
    """The engine loop's daemon thread may still be finishing its step when a script ends; the
    process must still exit with status 0 (it aborted with 134 about every other run)."""
    import subprocess
    import sys

    script = tmp_path / "short.py"
    script.write_text(
        "import sys\nfrom agentmem.config import Config\nfrom agentmem.engine import Engine\n"
        f"e = Engine.load(Config(model_path={str(tiny_path)!r}, device='cpu', dtype='float32', compile='off'))\n"
        "print(len(e.generate(list(range(5, 40)), max_tokens=16, ignore_eos=True).token_ids))\n")
    for _ in range(3):
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.strip() == "16", r.stderr[-2000:]
        assert "terminate called" not in r.stderr


def test_a_measured_choice_is_remembered_remade_when_invalid_and_survives_a_bad_file(tmp_path):
    from agentmem.engine.measured import best_seconds, remembered, simd_flags

    runs = []

    def measure():
        runs.append(1)
        return {"route": "a", "rule": len(runs)}

    assert remembered(tmp_path, "c.json", "k", measure) == {"route": "a", "rule": 1}
    assert remembered(tmp_path, "c.json", "k", measure)["rule"] == 1 and len(runs) == 1  # read back
    assert remembered(tmp_path, "c.json", "k", measure, lambda e: e["rule"] == 2)["rule"] == 2  # an old rule's
    assert json.loads((tmp_path / "c.json").read_text())["k"]["rule"] == 2
    (tmp_path / "c.json").write_text("{not json")
    assert remembered(tmp_path, "c.json", "k", measure)["rule"] == 3  # measured again, file rewritten
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert remembered(blocked, "c.json", "k", measure)["rule"] == 4  # cannot be saved: still answered
    assert best_seconds(lambda: sum(range(1000)), 3) > 0 and isinstance(simd_flags(), str)


def test_a_choice_timed_on_a_busy_machine_is_used_but_not_saved(tmp_path, monkeypatch, caplog):
    from agentmem.engine import measured

    runs = []

    def measure():
        runs.append(1)
        return {"route": "a", "rule": len(runs)}

    monkeypatch.setattr(measured, "machine_busy", lambda: "load average 5.0 on 2 cores")
    with caplog.at_level(logging.WARNING, logger="agentmem.engine"):
        first = measured.remembered(tmp_path, "busy.json", "k", measure)
    assert first == {"route": "a", "rule": 1, "unsaved": "load average 5.0 on 2 cores"}
    assert not (tmp_path / "busy.json").exists() and "not saved" in caplog.text
    assert measured.remembered(tmp_path, "busy.json", "k", measure) is first and len(runs) == 1  # this process keeps it
    monkeypatch.setattr(measured, "_UNSAVED", {})  # a new process on a quiet machine: timed again and saved
    monkeypatch.setattr(measured, "machine_busy", lambda: None)
    assert measured.remembered(tmp_path, "busy.json", "k", measure) == {"route": "a", "rule": 2}
    assert json.loads((tmp_path / "busy.json").read_text())["k"] == {"route": "a", "rule": 2}
    monkeypatch.undo()  # the real guard (conftest stubs it for the other tests), on a made-up load
    monkeypatch.setattr(measured.os, "getloadavg", lambda: (9.0, 1.0, 1.0))
    monkeypatch.setattr(measured.os, "cpu_count", lambda: 2)
    assert measured.machine_busy() == "load average 9.0 on 2 cores"
    monkeypatch.setattr(measured.os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    assert measured.machine_busy() is None


def test_cuda_graph_buckets_and_their_static_inputs():
    """The CUDA graph decode step's bucket rule and the layout of the one buffer a step fills
    (the replay itself is tested on a GPU: test_cuda.py)."""
    from types import SimpleNamespace

    from agentmem.engine.cuda_graph import MIN_BLOCKS, GraphDecode

    assert GraphDecode.bucket(1, 1) == (1, MIN_BLOCKS) and GraphDecode.bucket(3, 5) == (4, MIN_BLOCKS)
    assert GraphDecode.bucket(8, 17) == (8, 32) and GraphDecode.bucket(33, 1) is None
    pool = SimpleNamespace(num_blocks=40, block_size=16, scratch_slot=40 * 16, k=torch.empty(0))
    g = GraphDecode(None, pool)
    assert g.get(2, 100) is None  # 128 blocks of table: more than the pool holds
    rows, width = 4, 16
    buf = torch.full((4 * rows + rows * width,), -1, dtype=torch.long)
    g._fill(buf, rows, width, [5, 6], [10, 20], [3, 41], [[0], [1, 2, 3]], [11, 21])
    ids, pos, slots, lens, tables = g._views(buf, rows, width)
    assert ids.tolist() == [5, 6, 0, 0] and pos.tolist() == [10, 20, 0, 0]
    assert slots.tolist() == [3, 41, 640, 640] and lens.tolist() == [11, 21, 1, 1]  # padded rows: the scratch slot
    assert tables[0, :2].tolist() == [0, 40] and tables[1, :4].tolist() == [1, 2, 3, 40]
    assert (tables[2:] == 40).all()  # padded rows read the scratch block only


def _tiny_hd32(tmp_path_factory, name: str, seed: int):
    """A tiny Llama checkpoint whose every projection the CPU kernels take (heads of 32, widths
    of whole 32-output blocks)."""
    from transformers import LlamaForCausalLM

    tok = build_tokenizer("llama3")
    path = tmp_path_factory.mktemp(name)
    hf = LlamaForCausalLM(hf_config("LlamaConfig", len(tok), tok, hidden_size=128, intermediate_size=192,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    randomize(hf, seed=seed)
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.skipif(not cpu_bf16.vnni(), reason="the fused decode layer runs on AVX512-VNNI (u8 route)")
def test_a_fused_decode_layer_gives_the_separate_calls_greedy_tokens(tmp_path_factory, monkeypatch):
    """Decode rows of a bf16 model with int8 weights on the u8 route run every layer of a step in
    one C call (norm, qkv, RoPE, the K/V write into the paged pool, attention, the MLP, layer
    after layer: `layers_q8u8`): 64 greedy tokens of
    one stream equal those of the separate calls. (Several streams are not compared here: which
    of their tokens a step prefills and which it decodes depends on when each arrives, and the
    two products round differently; test_cpu_gemv compares a layer of several rows exactly.)"""
    from agentmem.engine import model as M

    path = _tiny_hd32(tmp_path_factory, "tiny-llama-hd32", seed=4)
    monkeypatch.setattr(cpu_bf16, "q8_route", cpu_bf16.q8_route)  # restored after the test
    monkeypatch.setenv("AGENTMEM_GEMV_Q8", "u8")
    e = load(path, dtype="bfloat16", weights="int8", compile="off")
    if cpu_bf16.loaded() is None:
        pytest.skip(f"no bf16 kernels: {cpu_bf16.why_not}")
    assert e.model.layers[0].o_p.q8_route == "u8"
    assert isinstance(e.model.kernels, M.fused_decode.Bf16Fused)  # chosen when it was packed
    fused_rows = []
    real = cpu_bf16.layers_q8u8
    monkeypatch.setattr(cpu_bf16, "layers_q8u8",
                        lambda lib, model, h, *a: (out := real(lib, model, h, *a)) is not None
                        and fused_rows.append(h.shape[0]) or out)
    one = [ids(30, seed=1)]
    got_one = drive(e, EngineLoop(e), one, 64)
    assert fused_rows and set(fused_rows) == {1}
    e.model.set_kernels(fused=False)
    fused_rows.clear()
    assert got_one == drive(e, EngineLoop(e), one, 64)
    assert fused_rows == []


def test_an_fp32_engine_on_the_avx2_kernels_keeps_its_kv_in_fp16(tmp_path_factory, monkeypatch):
    """kv_dtype auto: an fp32 engine whose decode runs on the AVX2 kernels holds its paged pool in
    fp16 (half the bytes a step reads), decode steps run their layers in one C call over it, and a prompt longer than a prefill chunk (its later chunks attend to the pool's
    fp16 K/V, widened) gives logits within fp16's rounding of an fp32 pool's, step by step. An
    explicit kv_dtype that the engine cannot read is refused."""
    from agentmem.engine.kernels import cpu_fp32

    if cpu_fp32.load() is None:
        pytest.skip(f"no AVX2 kernels: {cpu_fp32.why_not}")
    monkeypatch.setattr(cpu_bf16, "_lib", None)  # as on an AVX2-only CPU: fp32 rows take cpu_fp32
    monkeypatch.setattr(cpu_bf16, "_tried", True)
    path = _tiny_hd32(tmp_path_factory, "tiny-llama-avx2", seed=5)
    e16 = load(path, dtype="float32", weights="int8", prefill_chunk=64, compile="off")
    e32 = load(path, dtype="float32", weights="int8", prefill_chunk=64, kv_dtype="float32", compile="off")
    assert e16.kv_dtype == torch.float16 and e32.kv_dtype == torch.float32
    assert e16.model.layers[0].o_p.q8_route == "avx2"
    loop16, loop32 = EngineLoop(e16), EngineLoop(e32)
    assert loop16.pool.k.dtype == torch.float16
    fused = []  # the pool dtype of each decode step that ran every layer in one C call
    real = cpu_fp32.layers_q8
    monkeypatch.setattr(cpu_fp32, "layers_q8", lambda lib, model, h, *a: (out := real(lib, model, h, *a)) is not None
                        and fused.append(a[2].k.dtype) or out)
    seen = {16: {}, 32: {}}  # the logits of each context a step ended (how steps batch depends on timing)

    def record(batch, run, bits):
        logits, done = run(batch)
        for row, seq in zip(logits, done, strict=True):
            seen[bits][tuple(seq.token_ids[:seq.num_computed])] = row.clone()
        return logits, done

    for bits, loop in ((16, loop16), (32, loop32)):
        loop.runner.run = lambda batch, run=loop.runner.run, bits=bits: record(batch, run, bits)
    prompts = [ids(150, seed=s) for s in range(3)]  # 3 chunks each: the later ones read the pool
    drive(e16, loop16, prompts, 12)
    assert fused and set(fused) == {torch.float16}  # decode steps ran whole in C, over the fp16 pool
    fused.clear()
    drive(e32, loop32, prompts, 12)
    assert fused and set(fused) == {torch.float32}
    both = seen[16].keys() & seen[32].keys()
    assert len(both) >= 6 and all(len(c) >= 150 for c in both)  # the prompts' first tokens, and decodes
    for c in both:
        assert (seen[16][c] - seen[32][c]).abs().max() < 0.02 * seen[32][c].abs().max()
    assert any(not torch.equal(seen[16][c], seen[32][c]) for c in both)  # it is fp16
    with pytest.raises(ValueError, match="kv_dtype"):
        load(path, dtype="float32", weights="int8", kv_dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_dtype"):
        load(path, dtype="float32", weights="int8", kv_dtype="half")


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_bf16_rows_give_their_fp32_sums_where_asked(fmt):
    """`Proj.multiply(x, torch.float32)` on the engine's own bf16-row kernels (the LM head's
    logits) returns the product's fp32 sums: the bf16 result is exactly those sums rounded, and
    most of them are not bf16 values."""
    from agentmem.engine.kernels import cpu_bf16

    if cpu_bf16.load() is None:
        pytest.skip(f"no bf16-row kernels here: {cpu_bf16.why_not}")
    g = torch.Generator().manual_seed(1)
    p = make_proj((0.05 * torch.randn(320, 256, generator=g)).bfloat16(), None, fmt)
    if p.w_gemv is None or (fmt == "int4" and p.q8_route != "q4"):
        pytest.skip(f"{fmt} weights do not take the bf16-row kernels on this CPU")
    for rows in (1, 5):
        x = torch.randn(rows, 256, generator=g).bfloat16()
        lo, hi = p.multiply(x), p.multiply(x, torch.float32)
        assert lo.dtype == torch.bfloat16 and hi.dtype == torch.float32
        assert torch.equal(hi.bfloat16(), lo)
        assert (hi != hi.bfloat16().float()).float().mean() > 0.9


def test_many_bf16_rows_of_int4_weights_take_the_kernel_where_set():
    """`Proj.q4_rows` (linear.resolve_q4_rows) sends bf16 rows past the decode rows to the 4-bit
    kernel (the same product as `gemv_q4` on them) or to the dense bf16 copy; the setting is
    checked, and dense is the default."""
    from agentmem.engine.kernels import cpu_bf16
    from agentmem.engine.linear import Q4_ROWS_ALL, resolve_q4_rows

    with pytest.raises(ValueError, match="q4_rows must be"):
        resolve_q4_rows("auto")
    assert resolve_q4_rows("kernel") == Q4_ROWS_ALL
    assert resolve_q4_rows(Config().q4_rows) == cpu_bf16.MAX_ROWS
    lib = cpu_bf16.load()
    g = torch.Generator().manual_seed(2)
    p = make_proj((0.05 * torch.randn(96, 128, generator=g)).bfloat16(), None, "int4")
    if lib is None or p.q8_route != "q4":
        pytest.skip("no 4-bit kernel for bf16 rows on this CPU")
    x = torch.randn(40, 128, generator=g).bfloat16()
    p.q4_rows = Q4_ROWS_ALL
    kernel = p(x)
    assert torch.equal(kernel, cpu_bf16.gemv_q4(lib, p.w_gemv, p.scale, x))
    p.q4_rows = cpu_bf16.MAX_ROWS
    dense = p(x)
    assert not torch.equal(dense, kernel)  # the rows were not quantized
    assert (dense.float() - kernel.float()).norm() < 0.02 * dense.float().norm()


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp32"])
def test_the_residual_joins_the_product_before_its_rounding(fmt, monkeypatch):
    """`Proj.plus(h, x)` is h + x W^T (+ bias): within one bf16 rounding of the exact sum where
    oneDNN multiplies many bf16 rows (the add is its post-op: never further from the exact sum
    than the product and the add rounded apart), and exactly h + p(x) on every other path
    (the decode kernels' few rows, widened rows, fp32)."""
    from agentmem.engine import linear

    cpu_bf16.load()  # the kernels' routes as an engine has them (None on a CPU without them)
    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    w, b = (0.05 * torch.randn(192, 128, generator=g)).to(dtype), torch.randn(192, generator=g).to(dtype)
    p = make_proj(w, b, fmt)
    fused = []
    real = linear._onednn_plus
    monkeypatch.setattr(linear, "_onednn_plus", lambda *a: fused.append(1) or real(*a))
    for rows in (3, 600):
        x = torch.randn(rows, 128, generator=g).to(dtype)
        h = (10 * torch.randn(rows, 192, generator=g)).to(dtype)
        for math in ("bf16", "fp32"):
            p.rows_math, p._prefill_w, fused[:] = math, None, []
            got = p.plus(h, x)
            apart = h + p(x)
            assert got.dtype == dtype and got.shape == (rows, 192)
            kernel = p.w_gemv is not None and rows <= cpu_bf16.MAX_ROWS  # the decode kernels' rows
            takes = (dtype == torch.bfloat16 and math == "bf16" and linear.onednn_bf16() and not kernel
                     and (fmt == "bf16" or p.w_gemv is not None))  # int8 with no kernel: torch's int8 op
            assert fused == ([1] if takes else [])
            if not takes:
                assert torch.equal(got, apart)
                continue
            # the weight as oneDNN multiplies it: int8's dequantized copy is in bf16 (`_many_rows`)
            exact = h.double() + x.double() @ dense(p).bfloat16().double().t() + b.double()
            # one bf16 rounding of the fp32 sums: half a bf16 step, plus the fp32 sums' own error
            scale = h.double().abs() + x.double().abs() @ dense(p).double().abs().t() + b.double().abs()
            assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-5 * scale).all()
            assert (got.double() - exact).abs().mean() <= (apart.double() - exact).abs().mean()


def test_a_steps_kv_goes_to_the_pool_by_runs_of_slots_as_by_index():
    """`slot_runs` cuts a step's slots into runs of consecutive slots (None for few rows or
    many runs), and `KVPool.write` stores K/V by those runs exactly as by the slots' index."""
    from agentmem.engine.kv_pool import MAX_SLOT_RUNS, KVPool, slot_runs
    from agentmem.engine.model import ModelArgs

    args = ModelArgs(vocab_size=10, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=16, head_dim=4)
    slots = list(range(35, 48)) + list(range(80, 112)) + list(range(16, 20))
    assert slot_runs(slots) == [(35, 0, 13), (80, 13, 32), (16, 45, 4)]
    assert slot_runs(slots[:10]) is None  # a decode batch's few rows: one index_copy_
    assert slot_runs(list(range(0, 4 * MAX_SLOT_RUNS, 2))) is None  # every slot its own run
    assert slot_runs(list(range(100, 100 + 4 * MAX_SLOT_RUNS))) == [(100, 0, 4 * MAX_SLOT_RUNS)]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(len(slots), 1, 4, generator=g), torch.randn(len(slots), 1, 4, generator=g)
    a, b = (KVPool(args, 8, 16, "cpu", torch.bfloat16) for _ in range(2))
    for pool in (a, b):
        pool.k.zero_(), pool.v.zero_()
    a.write(1, torch.tensor(slots), k, v)
    b.write(1, slot_runs(slots), k, v)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert torch.equal(b.k[1].view(-1, 1, 4)[80:112], k[13:45].bfloat16())
