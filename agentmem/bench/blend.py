"""`agentmem bench blend`: full prefill vs chunk-KV reuse vs CacheBlend on a memory-QA workload.

Each prompt is a system prompt, 8 memory chunks of ~256 tokens (facts about one user, a
different subset and order per prompt, so chunks land at new positions) and a question. The
chunks are precomputed first (a warm cache), the system prompt is an exact cached prefix.
All three modes run in the same process on the same prompts; `full` is the peer. The last
line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from ..config import Config
from ..engine import DenseKV, Engine, Segment
from ..kvreuse.fuser import METRICS, Clock, resolve_check_layer
from ..kvreuse.reuse import ChunkReuse

NAMES = ["Clara", "Tomas", "Ines", "Viktor", "Lena", "Omar", "Priya", "Jonas", "Aiko", "Rafael", "Sofia",
         "Marek", "Nadia", "Felix", "Greta", "Hugo", "Yara", "Elias", "Mira", "Bruno", "Zoe", "Anton"]
RELATIONS = ["sister", "brother", "cousin", "neighbour", "colleague", "friend", "uncle", "aunt", "mentor"]
JOBS = ["nurse", "carpenter", "pilot", "pharmacist", "teacher", "architect", "chef", "librarian",
        "electrician", "dentist", "journalist", "florist", "engineer", "translator", "baker"]
CITIES = ["Lyon", "Porto", "Tallinn", "Graz", "Bergen", "Cork", "Turin", "Ghent", "Krakow", "Aarhus",
          "Bilbao", "Leipzig", "Malmo", "Utrecht", "Seville", "Riga"]
PETS = ["cat", "dog", "parrot", "rabbit", "tortoise", "hamster", "goldfish", "ferret"]
THINGS = ["a blue bicycle", "an old piano", "a sourdough starter", "a telescope", "a kayak", "a vinyl collection",
          "a vegetable garden", "a sewing machine", "a chess set", "a camera", "a guitar", "a pottery wheel"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
TOPICS = ["family", "work", "pets", "travel", "food", "health", "hobbies", "home", "friends", "plans",
          "music", "sports", "school", "money", "garden", "books"]


def _fact(rng: random.Random) -> tuple[str, str]:
    """One fact sentence about the user, and a question whose answer is in it."""
    name, rel = rng.choice(NAMES), rng.choice(RELATIONS)
    kind = rng.randrange(4)
    if kind == 0:
        job, city = rng.choice(JOBS), rng.choice(CITIES)
        return (f"Maya's {rel} {name} works as a {job} in {city}.",
                f"What does Maya's {rel} {name} do for a living?")
    if kind == 1:
        pet, n = rng.choice(PETS), rng.randint(2, 14)
        return (f"Maya has a {pet} called {name} who is {n} years old.", f"How old is Maya's {pet} {name}?")
    if kind == 2:
        thing, day = rng.choice(THINGS), rng.choice(DAYS)
        return (f"Every {day} Maya uses {thing} that she got from her {rel} {name}.",
                f"What did Maya get from her {rel} {name}?")
    city, n = rng.choice(CITIES), rng.randint(3, 28)
    return (f"Maya plans to visit {name} in {city} for {n} days next spring.",
            f"For how many days will Maya visit {name} in {city}?")


def build_chunks(engine: Engine, n_chunks: int, chunk_tokens: int, seed: int) -> list[tuple[str, list[str]]]:
    """`n_chunks` memory texts of about `chunk_tokens` tokens each, with their questions."""
    rng = random.Random(seed)
    chunks = []
    for i in range(n_chunks):
        lines = [f"- 2024-{1 + i % 12:02d}-{3 + 2 * i % 25:02d} notes on Maya's {TOPICS[i % len(TOPICS)]}:"]
        questions = []
        while engine.count_tokens(" ".join(lines)) < chunk_tokens - 12:
            fact, q = _fact(rng)
            lines.append(fact)
            questions.append(q)
        chunks.append((" ".join(lines) + "\n", questions))
    return chunks


def build_prompts(engine: Engine, n_prompts: int, n_chunks: int, per_prompt: int, chunk_tokens: int,
                  seed: int = 0) -> tuple[list[list[Segment]], list[Segment]]:
    """The workload prompts (as segments) and the memory chunks to precompute."""
    rng = random.Random(seed + 1)
    sys_open, sys_close = engine.chat.wraps["system"]
    system = Segment(f"{sys_open}You are Maya's assistant. Answer her questions briefly and exactly, "
                     "using the notes from earlier conversations below.\n", tier="system")
    close = Segment(sys_close, tier="system")
    chunks = build_chunks(engine, n_chunks, chunk_tokens, seed)
    memory = [Segment(text, tier="recall", ref=f"memory:{i}") for i, (text, _) in enumerate(chunks)]
    prompts = []
    for _ in range(n_prompts):
        picked = rng.sample(range(n_chunks), per_prompt)
        question = rng.choice(chunks[rng.choice(picked)][1])
        prompts.append([system, *(memory[i] for i in picked), close,
                        Segment(engine.format_message("user", question), tier="user"),
                        Segment(engine.chat.generation_prefix, cacheable=False, tier="generation")])
    return prompts, memory


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) of the next-token distributions."""
    lp, lq = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def greedy(engine: Engine, result, n_prompt: int, tokens: int) -> list[int]:
    """Greedy continuation from a prefill's K/V and last logits (the same decode for all modes)."""
    kv = DenseKV(engine.model, n_prompt + tokens, engine.device, engine.dtype)
    kv.load(result.k, result.v)
    out, logits = [], result.last_logits
    for i in range(tokens):
        tok = int(logits.argmax())
        if tok in engine.eos_ids:
            break
        out.append(tok)
        if i + 1 < tokens:
            logits = engine.prefill_dense([tok], kv, start=n_prompt + i)
    return out


def run_mode(reuse: ChunkReuse, parts, mode: str, ratio: float | None = None, clock: Clock | None = None):
    """One prefill and its first token; `clock` (started here) splits the time into parts."""
    t0 = time.perf_counter()
    if clock is not None:
        clock.t = t0
    r = reuse.plan(parts, mode=mode, ratio=ratio, store=False, clock=clock)
    int(r.last_logits.argmax())  # the first token is sampled here
    if clock is None:
        return r, time.perf_counter() - t0
    clock.lap("logits")
    return r, clock.t - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentmem bench blend", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--chunks", type=int, default=12, help="memory chunks in the pool")
    ap.add_argument("--per-prompt", type=int, default=8, help="chunks in each prompt")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--ratio", type=float, default=None, help="blend ratio (default: config blend_ratio)")
    ap.add_argument("--metric", choices=METRICS, default=None)
    ap.add_argument("--check-layer", type=int, default=None,
                    help="layers 0..this run every token (default: -1 for query, 1 for the others)")
    ap.add_argument("--drift", type=float, default=None,
                    help="share of each chunk group recomputed for the drift correction (default: config blend_drift; 0: off)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--curve", action="store_true", help="also sweep r and plot docs/img/blend_curve.png")
    ap.add_argument("--curve-prompts", type=int, default=8)
    ap.add_argument("--curve-out", default="docs/img/blend_curve.png")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.chunks, args.per_prompt, args.chunk_tokens = 3, 4, 3, 48
        args.answer_tokens, args.curve_prompts = 4, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))

    with tempfile.TemporaryDirectory() as tmp:
        over = {k: v for k, v in (("blend_ratio", args.ratio), ("blend_metric", args.metric),
                                  ("blend_check_layer", args.check_layer),
                                  ("blend_drift", args.drift)) if v is not None}
        cfg = Config(dtype=args.dtype, kv_mode="full", kv_disk_dir=tmp, **over)
        engine = Engine.load(cfg)
        reuse = ChunkReuse(engine, cfg.model_copy(update={"kv_mode": "blend"}))
        prompts, memory = build_prompts(engine, args.prompts, args.chunks, args.per_prompt, args.chunk_tokens)
        t0 = time.perf_counter()
        reuse.precompute(memory)
        log(f"precomputed {len(memory)} chunks in {time.perf_counter() - t0:.1f}s; dtype {engine.dtype}")
        # warm the exact system-prompt prefix, then compile-free warm-up of each path
        reuse.plan(engine.tokenize_prompt(prompts[0][:1] + prompts[0][-2:]))
        rows = []
        for i, prompt in enumerate(prompts):
            parts = engine.tokenize_prompt(prompt)
            n = sum(len(p[0]) for p in parts)
            row = {"tokens": n}
            results = {}
            for mode in ("full", "reuse", "blend"):
                clock = Clock(engine.device.type == "cuda") if mode == "blend" else None
                r, dt = run_mode(reuse, parts, mode, clock=clock)
                if clock is not None:
                    row["breakdown"] = clock.parts
                row[f"{mode}_ttft_s"] = dt
                row[f"{mode}_answer"] = greedy(engine, r, n, args.answer_tokens)
                # only what the figures need is kept: the K/V are dropped before the next prefill,
                # as the engine loop drops them once in its pool, so that each prefill may take
                # the last one's buffers (fuser.kv_buffers) as it does there
                results[mode] = SimpleNamespace(last_logits=r.last_logits, recomputed=r.recomputed,
                                                prefilled=r.prefilled)
                del r
            full = results["full"]
            top = int(full.last_logits.argmax())
            for mode in ("reuse", "blend"):
                row[f"{mode}_kl"] = kl(full.last_logits, results[mode].last_logits)
                row[f"{mode}_top1"] = float(int(results[mode].last_logits.argmax()) == top)
                row[f"{mode}_match"] = float(row[f"{mode}_answer"] == row["full_answer"])
            # how near a tie full prefill's own choice was: a blend that misses top-1 where the
            # first two logits lie 0.04 apart differs from one that misses a clear answer
            first, second = full.last_logits.float().topk(2).values.tolist()
            row["full_margin"] = first - second
            b = results["blend"]
            row["recompute_ratio"] = (b.recomputed + b.prefilled) / n
            rows.append(row)
            log("    blend parts: " + "  ".join(f"{k} {v:.3f}s" for k, v in row["breakdown"].items()))
            log(f"[{i + 1}/{len(prompts)}] {n} tok  full {row['full_ttft_s']:.2f}s  reuse {row['reuse_ttft_s']:.2f}s "
                f"blend {row['blend_ttft_s']:.2f}s  kl reuse {row['reuse_kl']:.3f} blend {row['blend_kl']:.3f}  "
                f"answer: {engine.decode(row['full_answer'])!r} / {engine.decode(row['blend_answer'])!r}")

        def mean(key):
            return statistics.fmean(r[key] for r in rows)

        out = {
            "bench": "blend",
            "prompts": len(rows),
            "prompt_tokens": mean("tokens"),
            "full_ttft_s": mean("full_ttft_s"),
            "reuse_ttft_s": mean("reuse_ttft_s"),
            "blend_ttft_s": mean("blend_ttft_s"),
            "speedup": mean("full_ttft_s") / mean("blend_ttft_s"),
            "reuse_speedup": mean("full_ttft_s") / mean("reuse_ttft_s"),
            "blend_kl": mean("blend_kl"),
            "reuse_kl": mean("reuse_kl"),
            "blend_top1": mean("blend_top1"),
            "reuse_top1": mean("reuse_top1"),
            # full prefill's top-1 minus top-2 logit on each prompt the blend's top-1 missed
            "blend_top1_miss_full_margins": [round(r["full_margin"], 4) for r in rows if not r["blend_top1"]],
            "blend_answer_match": mean("blend_match"),
            "reuse_answer_match": mean("reuse_match"),
            "recompute_ratio": mean("recompute_ratio"),
            # seconds per part of the blend's TTFT (fuser.Clock: the parts tile it)
            "blend_breakdown_s": {p: statistics.fmean(r["breakdown"].get(p, 0.0) for r in rows) for p in Clock.PARTS},
            "ratio": reuse.ratio,
            "metric": reuse.metric,
            "check_layer": resolve_check_layer(reuse.metric, reuse.check_layer),
            "drift": reuse.drift,
            "chunk_tokens": args.chunk_tokens,
            "chunks_per_prompt": args.per_prompt,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
        }
        if args.curve:
            out["curve"] = curve(engine, reuse, prompts[: args.curve_prompts], log)
            plot_curve(out["curve"], args.curve_out)
            out["curve_plot"] = args.curve_out
    print(json.dumps(out))
    return 0


CURVE_RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)


def curve(engine: Engine, reuse: ChunkReuse, prompts: list[list[Segment]], log) -> list[dict]:
    """Speedup and KL against the blend ratio r (reuse is r=0 without the check layers)."""
    sums: dict[float, list[tuple[float, float, float]]] = {r: [] for r in CURVE_RATIOS}
    full_t = []
    for prompt in prompts:
        parts = engine.tokenize_prompt(prompt)
        full, t_full = run_mode(reuse, parts, "full")
        full_t.append(t_full)
        top = int(full.last_logits.argmax())
        for r in CURVE_RATIOS:
            res, dt = run_mode(reuse, parts, "blend", r)
            sums[r].append((dt, kl(full.last_logits, res.last_logits), float(int(res.last_logits.argmax()) == top)))
    out = []
    t_full = statistics.fmean(full_t)
    for r in CURVE_RATIOS:
        dt = statistics.fmean(x[0] for x in sums[r])
        out.append({"ratio": r, "ttft_s": dt, "speedup": t_full / dt, "kl": statistics.fmean(x[1] for x in sums[r]),
                    "top1": statistics.fmean(x[2] for x in sums[r])})
        log(f"r={r:.2f}  speedup {t_full / dt:.2f}x  kl {out[-1]['kl']:.4f}  top1 {out[-1]['top1']:.2f}")
    return out


def plot_curve(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    r = [p["ratio"] for p in points]
    fig, ax1 = plt.subplots(figsize=(6, 3.6))
    ax1.plot(r, [p["speedup"] for p in points], "o-", color="tab:blue")
    ax1.set_xlabel("blend ratio r (share of cached tokens recomputed)")
    ax1.set_ylabel("TTFT speedup vs full prefill", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(r, [p["kl"] for p in points], "s--", color="tab:red")
    ax2.set_ylabel("next-token KL vs full", color="tab:red")
    ax1.set_title("CacheBlend on SmolLM2-135M: speed and quality against r")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
