"""`agentmem bench engine`: the engine against HF transformers, in one run, on one machine.

What is measured (each figure is the best of `--repeats` runs, ours and the peer's runs
interleaved, so both see the same load on a shared machine):

- prefill: a `--prompt-tokens` prompt (default 2048) to its first token. Ours goes through
  `Engine.generate` (scheduler, paged pool); HF runs `model(ids, use_cache=True,
  logits_to_keep=1)`, which is what its `generate()` does for a prompt.
- decode: one stream, `--new-tokens` greedy tokens (default 128) after a short chat
  prompt; the first token (prefill) is excluded on both sides. HF runs `generate()` with
  its KV cache. Ours runs eager and compiled (engine/compiled.py; `compile_s` is what its
  buckets took to compile or load from the disk cache in this run), in the weight format
  chosen here (`weights`, engine/linear.py) and in int8 (`decode_tok_s_int8`, on the path kept as
  for `decode_tok_s`; the same figure where the weights chosen are int8); `decode_tok_s` is the
  default setup.
- decode_long: the same, one stream, after the `--prompt-tokens` prose prompt, HF's likewise:
  what a memory turn's reply costs, each token's attention reading every key before it (eager
  and compiled timed, the figure on the path compile=auto keeps, as for `decode_tok_s`).
- ttft_350: time to first token of a 350-token chat prompt (what a memory turn costs).
- batch: `--streams` concurrent streams (default 8) through the scheduler, eager and compiled
  runs interleaved (`batch_decode_tok_s_by_path`; the figure is the path compile=auto keeps,
  `batch_path`, as for one stream); decode throughput of all streams together, and KV
  utilisation (used / allocated KV bytes of the paged pool over the run; `kv_utilization_reserved` is the same for a contiguous cache
  that reserves prompt + max_tokens per request, the best case of pre-paging servers).
- batch_long: the same streams, each after its own `--batch-prompt-tokens` prose prompt (default
  512, about what a memory turn's prompt holds), `BATCH_LONG_TOKENS` tokens each, on the batch's
  path, and one stream after such a prompt beside them: what a service decodes at, where every
  row's attention reads its own keys (the batch above starts from one-line chat prompts).
- max_logit_err: fp32 logits of ours vs HF's `AutoModelForCausalLM` on 512 prompt tokens;
  `perplexity` of fp32, the bench dtype and int8 weights on those tokens, and int8's max
  logit error against our fp32; `decode_perplexity`, the same tokens read one a forward as
  decode reads them (int8's few-row products run the GEMV route chosen here, `int8_route`).
- the machine: matmul rate (fp32, bf16, and the engine's own projection: the bench dtype in
  the weight format used, many rows multiplied as `rows_math` says, linear.resolve_rows_math)
  and memory copy bandwidth, to say how far each figure is from what the hardware allows; the
  bandwidth bound counts the bytes of the weight format used.

The peer runs in the same dtype, on the same threads, under `torch.inference_mode()`.
llama-cpp-python on the same GGUF is timed too when it happens to be importable (it runs
the GGUF's own quantized weights, so it is a reference point, not a same-dtype peer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import Config
from ..engine.compiled import CompiledDecode
from ..engine.engine import DenseKV, Engine, Segment
from ..engine.kernels import cpu_bf16, cpu_fp32
from ..engine.linear import INT4_GROUP, make_proj, onednn_bf16
from ..engine.loop import EngineLoop, auto_compiles
from ..engine.measured import simd_flags
from ..engine.model import ModelArgs
from ..engine.weights import resolve_model_dir

_SUBJECTS = ["The harbour master", "A young baker", "The old lighthouse keeper", "Our neighbour", "The committee",
             "A travelling musician", "The river pilot", "My grandmother", "The night nurse", "A clockmaker"]
_VERBS = ["remembered", "wrote down", "argued about", "forgot", "explained", "measured", "repaired", "sold",
          "painted", "described"]
_OBJECTS = ["the winter storms of that year", "a recipe for rye bread", "the price of copper wire",
            "the names of every ship in the bay", "a map of the northern hills", "the broken station clock",
            "the letters from the coast", "an argument about the new bridge", "the orchard behind the school",
            "a song about the salt marshes"]
_TOPICS = ["a dragon who learns to bake bread", "a lighthouse on a distant island", "a city under the sea",
           "a robot that collects stamps", "two rival chess clubs", "a winter market in the mountains",
           "a cat who runs a post office", "the last train of the night", "a garden on the moon",
           "a detective who cannot read"]


def prose_ids(engine: Engine, n_tokens: int, seed: int = 0) -> list[int]:
    """Exactly n_tokens ids of varied, seeded English prose (no repeated blocks to share)."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n_tokens:
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} on day {rng.randint(1, 999)}. "
        ids += engine.encode(sentence)
    return ids[:n_tokens]


def story_prompt(engine: Engine, i: int, tag: int = 0) -> list[Segment]:
    topic = _TOPICS[i % len(_TOPICS)]
    return engine.chat_segments([{"role": "user", "content": f"({tag}) Write a long story about {topic}."}])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


# --- the machine ------------------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def matmul_gflops(dtype: torch.dtype, device: torch.device, budget_s: float = 1.0, fmt: str | None = None,
                  rows_math: str = "bf16") -> float:
    """Best rate of the engine's projection (linear.Proj, in weight format `fmt`, default
    dense in `dtype`, many bf16 rows multiplied as `rows_math` says) on the model's largest
    projection shape (tokens x 576 -> 1536)."""
    fast = dtype == torch.float32 or device.type == "cuda" or onednn_bf16()
    m = 1024 if fast else 256  # emulated bf16 is slow
    x = torch.randn(m, 576, device=device).to(dtype)
    p = make_proj(torch.randn(1536, 576, device=device).to(dtype), fmt=fmt)
    p.rows_math = rows_math
    p(x)
    best, spent = float("inf"), 0.0
    while spent < budget_s:
        dt = _seconds(lambda: p(x), device)
        best, spent = min(best, dt), spent + dt
    return 2 * m * 576 * 1536 / best / 1e9


def copy_gb_s(device: torch.device, n_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best memory copy rate, bytes read + bytes written per second."""
    x = torch.ones(n_bytes // 4, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    best = min(_seconds(lambda: y.copy_(x), device) for _ in range(repeats))
    return 2 * n_bytes / best / 1e9


def machine_figures(dtype: torch.dtype, device: torch.device, fmt: str,
                    rows_math: str = "bf16") -> tuple[float, float, float, float]:
    """(fp32 GFLOP/s, bf16 GFLOP/s, GFLOP/s of the engine's projection in `dtype`, weight format
    `fmt` and `rows_math`, copy GB/s)."""
    fp32, bf16 = matmul_gflops(torch.float32, device), matmul_gflops(torch.bfloat16, device)
    dense = fmt == {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype) and rows_math == "bf16"
    own = {torch.float32: fp32, torch.bfloat16: bf16}[dtype] if dense else matmul_gflops(dtype, device, fmt=fmt,
                                                                                          rows_math=rows_math)
    return fp32, bf16, own, copy_gb_s(device)


def prefill_flops(a: ModelArgs, n: int) -> float:
    """FLOPs of a prefill of n tokens with logits of the last token only."""
    hd = a.head_dim
    linear = 2 * n * a.dim * ((a.n_heads + 2 * a.n_kv_heads) * hd + a.n_heads * hd + 3 * a.hidden_dim)
    attention = 4 * a.n_heads * hd * n * (n + 1) / 2  # causal QK^T and PV
    return a.n_layers * (linear + attention) + 2 * a.dim * a.vocab_size


# bytes per weight of each format, scales included (int8: one fp32 per output row of >= 576
# inputs; int4: a scale and an offset per 32 inputs)
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1, "int4": 0.5 + 2 * 2 / INT4_GROUP}


def decode_weight_bytes(a: ModelArgs, itemsize: float, head_itemsize: float | None = None) -> int:
    """Weight bytes one decode step reads: every projection and the LM head (in its own format
    where that differs: int4 keeps an int8 head)."""
    hd = a.head_dim
    per_layer = a.dim * ((a.n_heads + 2 * a.n_kv_heads) * hd + a.n_heads * hd + 3 * a.hidden_dim)
    head = itemsize if head_itemsize is None else head_itemsize
    return int(a.n_layers * per_layer * itemsize + a.vocab_size * a.dim * head)


# --- the runs ---------------------------------------------------------------------------------
def ours_prefill_s(engine: Engine, loop: EngineLoop, ids: list[int]) -> float:
    return engine.generate(ids, max_tokens=1, loop=loop).stats.ttft_s


# Decode is timed over exactly `new_tokens` tokens, as HF's generate() makes them: no stop at EOS
# and no loop cut. With the loop detector on (the default for replies), a greedy story of the
# 135M model was cut at 105-190 of 256 tokens, after decode steps whose tokens it rolled back,
# so tok/s read low and moved from run to run (8 streams: some streams ended early).
TIMED = {"ignore_eos": True, "stop_loops": False}
BATCH_LONG_TOKENS = 64  # batch_long's tokens a stream: its prompts' prefill is the longer part of that run


def ours_decode_tok_s(engine: Engine, loop: EngineLoop, prompt, new_tokens: int) -> float:
    s = engine.generate(prompt, max_tokens=new_tokens, loop=loop, **TIMED).stats
    return (s.completion_tokens - 1) / (s.total_s - s.ttft_s)


def ours_batch(engine: Engine, loop: EngineLoop, prompts, new_tokens: int) -> tuple[float, float, float]:
    """(decode tok/s of all streams together, paged KV utilisation, contiguous-reserve one)."""
    loop.reset_stats()
    t0 = time.perf_counter()
    streams = [engine.stream(p, max_tokens=new_tokens, loop=loop, **TIMED) for p in prompts]
    for s in streams:
        for _ in s:
            pass
    t_end = time.perf_counter()
    stats = [s.result.stats for s in streams]
    first = max(st.ttft_s for st in stats)
    rate = sum(st.completion_tokens - 1 for st in stats) / (t_end - t0 - first)
    lens = [st.prompt_tokens for st in stats]
    # a contiguous cache holds prompt + max_tokens slots per request from its first step
    reserved = sum(sum(p + t for p in lens) / sum(p + new_tokens for p in lens) for t in range(new_tokens))
    return rate, loop.kv_utilization(), reserved / new_tokens


def hf_prefill_s(hf, ids: list[int], device: torch.device) -> float:
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        return _seconds(lambda: hf(x, use_cache=True, logits_to_keep=1), device)


def hf_generate_s(hf, ids: list[int], new_tokens: int, device: torch.device) -> float:
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        return _seconds(
            lambda: hf.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False),
            device,
        )


def chat_prompt_ids(engine: Engine, n_tokens: int, seed: int) -> list[int]:
    """A chat prompt (one user message of prose, then the assistant prefix) of n_tokens ids."""
    def build(k: int) -> list[int]:
        text = engine.decode(prose_ids(engine, k, seed))
        return [t for s in engine.chat_segments([{"role": "user", "content": text}]) for t in engine.encode(s.text)]

    k = n_tokens
    ids = build(k)
    for _ in range(8):  # the message's wrapping and re-tokenized prose shift the count a little
        if len(ids) == n_tokens:
            break
        k += n_tokens - len(ids)
        ids = build(k)
    return ids


def ours_ttft_s(engine: Engine, loop: EngineLoop, n_tokens: int, repeats: int) -> float:
    return min(engine.generate(chat_prompt_ids(engine, n_tokens, seed=100 + r), max_tokens=1, loop=loop).stats.ttft_s
               for r in range(repeats))


def perplexity(engine: Engine, ids: list[int]) -> tuple[float, torch.Tensor]:
    """(perplexity of `ids`, the logits)."""
    logits = engine.logits(ids)
    return float(torch.exp(F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:], device=logits.device)))), logits


def decode_perplexity(engine: Engine, ids: list[int]) -> float:
    """Perplexity of `ids` read one token a forward over the KV of those before it, as decode
    reads them: the few-row products (the GEMV kernels and their int8 route, `int8_route`),
    where `perplexity` goes through prefill's many-row ones, and the K/V held in the pool's
    dtype (`kv_dtype`: fp16 under fp32 rows on the AVX2 route)."""
    t = torch.tensor(ids, device=engine.device)
    kv = DenseKV(engine.model, len(t), engine.device, engine.kv_dtype)
    with torch.inference_mode():
        logits = torch.cat([engine.model(t[i:i + 1], torch.arange(i, i + 1, device=engine.device),
                                         kv.backend(i, 1)).float() for i in range(len(t) - 1)])
    return float(torch.exp(F.cross_entropy(logits, t[1:])))


def decode_loop(engine: Engine, compiled: bool, pool_tokens: int) -> EngineLoop:
    """An EngineLoop, its decode step compiled (every bucket compiled at first use, not in the
    background, and run compiled: no measured choice) or eager. Compiled is built here where
    compile=auto builds none (a fused C decode step, loop.auto_compiles), so both paths are
    still timed against each other."""
    loop = EngineLoop(engine, pool_tokens=pool_tokens)
    cfg = engine.config
    if not compiled:
        loop.runner.compiled = None
        return loop
    if loop.runner.compiled is None and engine.device.type == "cpu" and cfg.compile != "off":
        loop.runner.compiled = CompiledDecode(engine.model, loop.pool, cfg.cache_dir, cfg.compile_timeout_s)
    if loop.runner.compiled is not None:
        loop.runner.compiled.background = False
        loop.runner.compiled.measure = False
    return loop


def max_logit_err(engine: Engine, hf, ids: list[int]) -> float:
    ours = engine.logits(ids)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids], device=engine.device)).logits[0].float()
    return float((ours - ref).abs().max())


def llamacpp_figures(gguf: Path | None, ids: list[int], short: list[int], new_tokens: int, threads: int) -> dict:
    """llama-cpp-python on the model's GGUF (None: the default one), if it is importable and
    the model came as a GGUF; never a dependency."""
    try:
        import llama_cpp  # type: ignore[import-not-found]
    except ImportError:
        return {"llamacpp_prefill_tok_s": None, "llamacpp_decode_tok_s": None}
    try:
        import numpy as np

        from ..engine.weights import default_gguf

        llm = llama_cpp.Llama(model_path=str(gguf or default_gguf()), n_ctx=len(ids) + new_tokens + 64,
                              n_threads=threads, verbose=False)
        llm.eval(short)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill = len(ids) / (time.perf_counter() - t0)
        llm.reset()
        llm.eval(short)
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        decode = (new_tokens - 1) / (time.perf_counter() - t0)
        return {"llamacpp_prefill_tok_s": round(prefill, 1), "llamacpp_decode_tok_s": round(decode, 1)}
    except Exception as exc:  # a broken optional peer must not sink the benchmark
        return {"llamacpp_prefill_tok_s": None, "llamacpp_decode_tok_s": None, "llamacpp_error": repr(exc)}


def load_hf(path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agentmem bench engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat: a smoke test")
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (ours and the peer)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", type=Path, default=None,
                    help="a checkpoint directory or .gguf file of a supported family (default: AGENTMEM_MODEL_PATH, "
                         "else the default model)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--batch-prompt-tokens", type=int, default=512,
                    help="batch_long: each stream's prompt (a memory turn's is about this long)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.new_tokens, args.repeats = min(args.prompt_tokens, 256), min(args.new_tokens, 16), 1
        args.batch_prompt_tokens = min(args.batch_prompt_tokens, 128)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    base = Config() if args.model is None else Config(model_path=args.model)
    model_path = base.model_path
    # the plain engine, no chunk reuse; compiled when the config says so (auto: on the CPU)
    engine = Engine.load(base.model_copy(update={"dtype": args.dtype, "device": args.device, "kv_mode": "full"}))
    device, dtype, margs, weights = engine.device, engine.dtype, engine.model.args, engine.weights
    path = resolve_model_dir(engine.config.model_path, engine.config.cache_dir)
    hf = load_hf(path, dtype, device)
    peer = type(hf).__name__
    ids = prose_ids(engine, args.prompt_tokens)
    chat = story_prompt(engine, 0)
    chat_ids = [t for s in chat for t in engine.encode(s.text)]
    pool_tokens = max(engine.config.kv_pool_tokens, 2 * args.prompt_tokens)
    loop = decode_loop(engine, False, pool_tokens)
    compiled = decode_loop(engine, True, pool_tokens)
    on = compiled.runner.compiled is not None
    # what compile=auto keeps: the faster path where it measures, eager where it compiles nothing
    auto = engine.config.compile == "auto"
    measured = on and auto and (device.type != "cpu" or auto_compiles(engine))
    on_kept = on and not (auto and device.type == "cpu" and not auto_compiles(engine))
    # int8 weights run on the CPU only (linear.py): on a GPU its figures are null
    int8 = (engine if weights == "int8" else Engine.load(engine.config.model_copy(update={"weights": "int8"}))
            if device.type == "cpu" else None)
    # int8's own loops when it is a second engine (when it is the engine, its figure is decode_tok_s):
    # eager and compiled, its figure on the path compile=auto keeps, as for decode_tok_s (the
    # compiled loop alone had read 66 tok/s for the 139 the same weights decode at on the kept path)
    int8_loops: dict[str, EngineLoop] = {}
    if int8 is not None and int8 is not engine:
        int8_loops["eager"] = decode_loop(int8, False, pool_tokens)
        if on:
            int8_loops["compiled"] = decode_loop(int8, True, pool_tokens)
    ours_prefill_s(engine, loop, ids[:64])  # warm up both
    hf_prefill_s(hf, ids[:64], device)
    log("compiling the decode step (or loading it from the disk cache) ...")
    for lp, e in ((compiled, engine), *((lp8, int8) for lp8 in int8_loops.values())):  # the buckets used below
        ours_decode_tok_s(e, lp, chat, 3)
    ours_batch(engine, compiled, [story_prompt(engine, i, tag=99) for i in range(args.streams)], 3)
    compile_s = compiled.runner.compiled.compile_s if on else None
    default = compiled if on_kept else loop

    log("machine ...")
    rows_math = engine.model.rows_math
    machine = machine_figures(dtype, device, weights, rows_math)  # measured before and after the runs; the best is kept

    log(f"prefill {args.prompt_tokens} tokens ...")
    ours_pf, hf_pf = [], []
    for r in range(args.repeats):
        rotated = ids[r:] + ids[:r]  # a different first block each time: no prefix-cache hits
        ours_pf.append(ours_prefill_s(engine, loop, rotated))
        hf_pf.append(hf_prefill_s(hf, rotated, device))

    log("time to first token, 350-token chat prompt ...")
    ttft = ours_ttft_s(engine, default, 350, args.repeats)

    log(f"decode {args.new_tokens} tokens, one stream ...")
    ours_dec, ours_comp, hf_one, hf_all = [], [], [], []
    ours_int8 = {name: [] for name in int8_loops}
    for _ in range(args.repeats):
        ours_dec.append(ours_decode_tok_s(engine, loop, chat, args.new_tokens))
        if on:
            ours_comp.append(ours_decode_tok_s(engine, compiled, chat, args.new_tokens))
        for name, lp8 in int8_loops.items():
            ours_int8[name].append(ours_decode_tok_s(int8, lp8, chat, args.new_tokens))
        # the one-token run (prompt and first token) is subtracted from the n-token one: its
        # best of three, so that its noise cannot outweigh a short decode (a tiny model's
        # 4 tokens read negative once with one run each)
        hf_one.append(min(hf_generate_s(hf, chat_ids, 1, device) for _ in range(3)))
        hf_all.append(hf_generate_s(hf, chat_ids, args.new_tokens, device))
    hf_decode = (args.new_tokens - 1) / (min(hf_all) - min(hf_one))

    # what a memory turn decodes over: the reply after a long prompt, where each token's
    # attention reads every key before it (the chat prompt above is ~30 tokens)
    log(f"decode {args.new_tokens} tokens after a {len(ids)}-token prompt, one stream ...")
    long_ours, long_comp, long_hf_one, long_hf_all = [], [], [], []
    for r in range(args.repeats):
        rotated = ids[r + 1:] + ids[:r + 1]
        long_ours.append(ours_decode_tok_s(engine, loop, rotated, args.new_tokens))
        if on:
            long_comp.append(ours_decode_tok_s(engine, compiled, rotated, args.new_tokens))
        long_hf_one.append(min(hf_generate_s(hf, rotated, 1, device) for _ in range(3)))
        long_hf_all.append(hf_generate_s(hf, rotated, args.new_tokens, device))
    hf_decode_long = (args.new_tokens - 1) / (min(long_hf_all) - min(long_hf_one))

    # compile=auto keeps, per bucket, the faster of the two paths as timed at run time
    # (compiled.py); compile=on always runs compiled
    log(f"decode {args.new_tokens} tokens, {args.streams} streams ...")
    # both paths, interleaved, as for one stream: compile=auto keeps per bucket the faster of
    # the two (an always-compiled batch against the single stream's faster path had measured
    # 8 streams on the path the engine drops where compiled loses: 4.48x for 5.0x eager)
    batch_loops = {"eager": loop, "compiled": compiled} if on else {"eager": loop}
    batch = {name: [] for name in batch_loops}
    for r in range(args.repeats):
        for name, lp in batch_loops.items():
            batch[name].append(ours_batch(engine, lp, [story_prompt(engine, i, tag=r) for i in range(args.streams)],
                                          args.new_tokens))
    batch_best = {name: max(runs) for name, runs in batch.items()}
    batch_path = (max(batch_best, key=lambda n: batch_best[n][0]) if measured
                  else "compiled" if on_kept else "eager")
    rate, util, reserved = batch_best[batch_path]
    log(f"decode {BATCH_LONG_TOKENS} tokens, {args.streams} streams after {args.batch_prompt_tokens}-token prompts ...")
    long_rate, long_one = [], []
    for r in range(args.repeats):
        prompts = [prose_ids(engine, args.batch_prompt_tokens, seed=1000 + 100 * r + i) for i in range(args.streams)]
        long_rate.append(ours_batch(engine, batch_loops[batch_path], prompts, BATCH_LONG_TOKENS)[0])
        long_one.append(ours_decode_tok_s(engine, batch_loops[batch_path], prompts[0], BATCH_LONG_TOKENS))

    log("logits vs HF in fp32, perplexities ...")
    err_ids = ids[:512]
    fp32 = engine if dtype == torch.float32 and weights == "fp32" else Engine.load(
        engine.config.model_copy(update={"dtype": "float32", "weights": "fp32"}))
    if fp32 is not engine:
        del hf
    err = max_logit_err(fp32, hf if fp32 is engine else load_hf(path, torch.float32, device), err_ids)
    ppl_fp32, ref = perplexity(fp32, err_ids)
    ppl_own, _ = perplexity(engine, err_ids)
    ppl = {"fp32": round(ppl_fp32, 4), weights: round(ppl_own, 4)}
    # the same tokens one at a time, through decode's products (int8: the GEMV route chosen here)
    ppl_decode, int8_logits = {}, None
    if int8 is not None:
        ppl_int8, int8_logits = perplexity(int8, err_ids)
        ppl["int8"] = round(ppl_int8, 4)
        ppl_decode["int8"] = round(decode_perplexity(int8, err_ids), 4)
    if weights != "int8":
        ppl_decode[weights] = round(decode_perplexity(engine, err_ids), 4)
    dense_fmt = "bf16" if dtype == torch.bfloat16 else "fp32"
    if dense_fmt not in ppl:  # the engine dtype's dense weights, what int8 is judged against
        ppl[dense_fmt] = round(perplexity(Engine.load(engine.config.model_copy(update={"weights": dense_fmt})),
                                          err_ids)[0], 4)

    log("machine, again ...")
    fp32_peak, bf16_peak, peak, mem = (max(a, b) for a, b in
                                       zip(machine, machine_figures(dtype, device, weights, rows_math), strict=True))
    prefill = args.prompt_tokens / min(ours_pf)
    def kept(eager_runs: list[float], compiled_runs: list[float]) -> float:
        """The best run on the path the engine keeps: the faster one under compile=auto,
        compiled under compile=on, else eager (as where compile=auto compiles nothing)."""
        return (max(max(eager_runs), max(compiled_runs)) if measured else max(compiled_runs) if on_kept
                else max(eager_runs))

    eager = max(ours_dec)
    decode = kept(ours_dec, ours_comp)
    decode_int8 = (None if int8 is None else decode if int8 is engine
                   else kept(ours_int8["eager"], ours_int8.get("compiled", [])))
    decode_long = kept(long_ours, long_comp)
    bound = mem * 1e9 / decode_weight_bytes(margs, WEIGHT_BYTES[weights], WEIGHT_BYTES[engine.model.head_p.fmt])
    result = {
        "prefill_tok_s": round(prefill, 1),
        "hf_prefill_tok_s": round(args.prompt_tokens / min(hf_pf), 1),
        "decode_tok_s": round(decode, 2),
        "hf_decode_tok_s": round(hf_decode, 2),
        "decode_long_tok_s": round(decode_long, 2),
        "hf_decode_long_tok_s": round(hf_decode_long, 2),
        "decode_long_speedup_vs_hf": round(decode_long / hf_decode_long, 2),
        "weights": weights,
        "kv_dtype": str(engine.kv_dtype).removeprefix("torch."),  # the paged pool's (Engine.kv_dtype)
        "rows_math": rows_math,
        "rows_attention": cpu_bf16.rows_route(margs.n_heads, margs.n_kv_heads, margs.head_dim)
        if device.type == "cpu" and dtype == torch.bfloat16 else "sdpa",
        "compiled": on_kept,
        "decode_tok_s_eager": round(eager, 2),
        "decode_tok_s_compiled": round(max(ours_comp), 2) if on else None,
        "decode_tok_s_int8": round(decode_int8, 2) if decode_int8 is not None else None,
        "compile_s": None if compile_s is None else round(compile_s, 1),
        "ttft_350_s": round(ttft, 3),
        "batch8_decode_tok_s" if args.streams == 8 else f"batch{args.streams}_decode_tok_s": round(rate, 1),
        "batch_decode_tok_s_by_path": {name: round(best[0], 1) for name, best in batch_best.items()},
        "batch_path": batch_path,
        "batch_long_decode_tok_s": round(max(long_rate), 1),
        "batch_long_single_decode_tok_s": round(max(long_one), 1),
        "batch_long_speedup_vs_single": round(max(long_rate) / max(long_one), 2),
        "batch_long_prompt_tokens": args.batch_prompt_tokens,
        "max_logit_err": err,
        "perplexity": ppl,
        "decode_perplexity": ppl_decode,
        "int8_route": (cpu_bf16.q8_route if cpu_bf16.loaded() is not None
                       else "avx2" if cpu_fp32.loaded() is not None else "torch"),
        "int8_max_logit_err_vs_fp32": None if int8_logits is None else round(float((int8_logits - ref).abs().max()), 4),
        "kv_utilization": round(util, 4),
        "dtype": str(dtype).removeprefix("torch."),
        "prefill_speedup_vs_hf": round(prefill * min(hf_pf) / args.prompt_tokens, 2),
        "decode_speedup_vs_hf": round(decode / hf_decode, 2),
        "batch_speedup_vs_single": round(rate / decode, 2),
        "kv_utilization_reserved": round(reserved, 4),
        "machine_matmul_gflops": round(peak, 1),
        "machine_fp32_matmul_gflops": round(fp32_peak, 1),
        "machine_bf16_matmul_gflops": round(bf16_peak, 1),
        "machine_mem_gb_s": round(mem, 1),
        "prefill_pct_of_matmul_peak": round(100 * prefill * prefill_flops(margs, args.prompt_tokens)
                                            / args.prompt_tokens / (peak * 1e9), 1),
        "decode_bound_tok_s": round(bound, 1),
        "decode_pct_of_bandwidth_bound": round(100 * decode / bound, 1),
        "decode_int8_pct_of_bandwidth_bound": round(100 * decode_int8 * decode_weight_bytes(margs, 1) / (mem * 1e9), 1)
        if decode_int8 is not None else None,
        "cpu_flags": simd_flags(),
        **(llamacpp_figures(model_path, ids, chat_ids, args.new_tokens, threads)
           if model_path is None or model_path.suffix == ".gguf"
           else {"llamacpp_prefill_tok_s": None, "llamacpp_decode_tok_s": None}),
        "prompt_tokens": args.prompt_tokens,  # prefill's, and decode_long's prompt
        "new_tokens": args.new_tokens,
        "streams": args.streams,
        "repeats": args.repeats,
        "threads": threads,
        "device": _device_name(device),
        "cpus": os.cpu_count(),
        "model": engine.model_id,
        "peer": f"HF transformers {peer}, "
        "same dtype/threads/device, KV cache on, torch.inference_mode; "
        "prefill = forward(use_cache=True, logits_to_keep=1), decode = greedy generate()",
        "method": "best of `repeats` interleaved runs; decode excludes the first token; prefill ours = "
        "Engine.generate time to first token; decode_tok_s under compile=auto: the faster of eager and "
        "compiled, the path the engine keeps after timing both; the streams likewise (batch_path)",
    }
    if not args.json:
        for key, value in result.items():
            log(f"{key:>32}: {value}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
