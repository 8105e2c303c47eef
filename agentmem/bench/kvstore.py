"""`agentmem bench kvstore`: the chunk KV store under a multi-user trace, LRU with raw KV
against value per byte with the compressed codec, at the same bytes per tier.

The trace is what a tenant's service sends: N users, each with sessions of several turns;
every prompt starts with the tenant's persona (shared by all users) and the user's core
block, then memories recalled from the user's own pool with a Zipf law (a few come back
often, most rarely), the last two turns of the session, and the new message. Some turns end
in a tool call; their continuation (the same prompt, the call and the tool's result) comes
a few seconds later. Times are the trace's own clock (a turn every 20-40 s per user,
sessions an hour apart); TTFT is measured: the real model's prefill with whatever the store
holds (RAM, then a disk tier, then Redis on its own `redis-server`), and the first token.

Both configurations replay the same trace on empty tiers of equal budgets, turn by turn in
alternating order (a change in the machine's load hits both alike). The codec is the disk's
and Redis's; the policy's RAM holds its blobs too only with `--ram-codec on` (default: the
config's `kv_ram_codec`, off). TTFT includes putting the turn's new chunks into RAM and
the evictions that makes; their disk writes are behind, as in a configured store (a
background thread), and are waited for between turns outside the timing, like Redis's
(their seconds per turn are reported: in a service they run during the reply's decode).
Quality is measured twice: on the trace itself (every `--kl-every`th turn, KL against full
prefill and top-1 agreement, for both configurations), and for the codec apart on `bench
blend`'s prompts: the blend's KL against full prefill with KV through the codec over its KL
with raw KV, and top-1 agreement with full prefill.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

from ..config import Config
from ..engine import Engine, Segment
from ..kvreuse import codec as kvcodec
from ..kvreuse.entry import ChunkKV
from ..kvreuse.fuser import Piece, fuse
from ..kvreuse.policy import Rates, make_policy
from ..kvreuse.reuse import ChunkReuse
from ..kvreuse.store import ChunkStore
from .blend import CITIES, JOBS, NAMES, PETS, THINGS, _fact, build_prompts, kl

TENANT = "acme"
PERSONA = ("You are Juniper, the assistant of Acme Outdoor Supply. You help customers plan trips, choose gear, "
           "track orders and returns, and remember what they told you in earlier conversations. Be warm and brief. "
           "Never invent order numbers or prices; when you need live data, call a tool. Tools: order_status(order_id), "
           "stock(sku, store), weather(city, date), and create_return(order_id, reason). Answer in the customer's "
           "language. Use the notes below about the customer, and say when a note may be out of date. Our stores are "
           "in Lyon, Porto, Graz and Bergen; returns are free within 60 days with a receipt; repairs take two weeks. "
           "Loyalty members get free shipping over 50 euros and early access to seasonal sales. If a customer is "
           "unhappy, apologise once, then fix the problem. Keep safety first: for mountain trips mention the weather, "
           "the daylight and a plan B. Do not give medical or legal advice.\n")


def _zipf_pick(rng: random.Random, n: int, k: int, s: float) -> list[int]:
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    picked: list[int] = []
    while len(picked) < min(k, n):
        i = rng.choices(range(n), weights)[0]
        if i not in picked:
            picked.append(i)
    return picked


def build_trace(engine: Engine, users: int, sessions: int, turns: int, pool: int, recalled: int, tool_rate: float,
                zipf_s: float, seed: int) -> list[dict]:
    """Events in time order: {t, user, segments, tool (ends in a tool call)}."""
    rng = random.Random(seed)
    sys_open, sys_close = engine.chat.wraps["system"]
    persona = Segment(f"{sys_open}{PERSONA}", tier="system", namespace=TENANT)
    events: list[dict] = []
    for u in range(users):
        name = NAMES[u % len(NAMES)] + ("" if u < len(NAMES) else str(u))
        core = Segment(f"Customer: {name}, loyalty member since 20{10 + u % 14}, lives in {rng.choice(CITIES)}, works as "
                       f"a {rng.choice(JOBS)}, has a {rng.choice(PETS)}, prefers {rng.choice(THINGS)[2:]} for gifts, "
                       f"writes in English.\n", tier="core", namespace=TENANT)
        memories = []
        for _ in range(pool):
            a, _ = _fact(rng)
            b, _ = _fact(rng)
            memories.append(Segment(f"- note: {(a + ' ' + b).replace('Maya', name)}\n", tier="recall",
                                    namespace=TENANT))
        rank = list(range(pool))
        rng.shuffle(rank)
        t = rng.uniform(0, 60)
        for _ in range(sessions):
            recent: list[Segment] = []
            for i in range(turns):
                q, _ = _fact(rng)
                msg = f"About my notes: {q.replace('Maya', name)} Also, turn {i + 1} of today, any advice?"
                picks = [memories[rank[j]] for j in _zipf_pick(rng, pool, recalled, zipf_s)]
                head = [persona, core, *picks, Segment(sys_close, tier="system", namespace=TENANT), *recent]
                user_seg = Segment(engine.format_message("user", msg), tier="user", namespace=TENANT)
                gen = Segment(engine.chat.generation_prefix, cacheable=False, tier="generation")
                tool = rng.random() < tool_rate
                events.append({"t": t, "user": name, "segments": [*head, user_seg, gen], "tool": tool})
                reply = f"Here is what I found for you, {name}: the notes say {picks[0].text[8:80].strip()}"
                if tool:
                    call = Segment(engine.format_message("assistant", '{"tool": "order_status", "args": {"order_id": '
                                                         f'"A{rng.randrange(10**6):06d}"}}'), tier="turn",
                                   namespace=TENANT)
                    result = Segment(engine.format_message("user", f"[tool result] order shipped on day {i + 2}, "
                                                           f"arrives in {rng.randint(2, 6)} days at the {rng.choice(CITIES)} "
                                                           "store; tracking is available in the app."),
                                     tier="tool", namespace=TENANT)
                    t_tool = t + rng.uniform(2, 20)
                    events.append({"t": t_tool, "user": name, "segments": [*head, user_seg, call, result, gen],
                                   "tool": False, "continuation": True})
                    t = t_tool
                turn = Segment(engine.format_message("user", msg) + engine.format_message("assistant", reply),
                               tier="turn", namespace=TENANT)
                recent = (recent + [turn])[-2:]
                t += rng.uniform(20, 40)
            t += 3600
    events.sort(key=lambda e: e["t"])
    return events


class _RedisServer:
    """A private redis-server on a free loopback port, for the run only."""

    def __init__(self, tmp: Path):
        from ..api.local import free_port

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(tmp)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        import redis

        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if redis.Redis.from_url(self.url).ping():
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


class _TraceClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Replay:
    """One configuration's run of the trace on empty tiers: per-turn TTFT and the counters."""

    def __init__(self, engine: Engine, cfg: Config, policy_name: str, codec: str, budgets: dict, tmp: Path,
                 redis_url: str | None, prefix: str, ram_codec: bool = False):
        self.engine, self.cfg, self.name = engine, cfg, f"{policy_name}+{codec}"
        self.clock = _TraceClock()
        rates = Rates(recompute_share=cfg.blend_ratio)
        kw = {"half_life_s": cfg.kv_half_life_s, "min_tokens": cfg.kv_min_tokens} if policy_name == "value" else {}
        policy = make_policy(policy_name, clock=self.clock, rates=rates, **kw)
        self.shared = None
        if redis_url:
            from ..cluster.link import RedisLink
            from ..kvreuse.shared_tier import SharedTier

            self.shared = SharedTier(RedisLink(redis_url, timeout_s=2.0, prefix=prefix), budgets["redis"])
        # the baseline is the store as it was: LRU, raw KV, every tier's copy loaded
        self.store = ChunkStore([("cpu", budgets["ram"])], tmp / f"disk-{prefix.strip(':')}", budgets["disk"],
                                shared=self.shared, policy=policy, codec=codec, ram_codec=ram_codec,
                                choose_loads=policy_name != "lru", write_behind=True)
        self.reuse = ChunkReuse(engine, cfg, store=self.store)
        self.pin = policy_name == "value"
        self.ttft: list[float] = []
        self.pins_held = self.pins_broken = 0
        self.kls: list[float] = []
        self.top1: list[float] = []

    def step(self, ev: dict, full_logits: torch.Tensor | None = None) -> None:
        self.clock.t = ev["t"]
        parts = self.engine.tokenize_prompt(ev["segments"])
        t0 = time.perf_counter()
        r = self.reuse.plan(parts, user=ev["user"])
        int(r.last_logits.argmax())
        self.ttft.append(time.perf_counter() - t0)
        if full_logits is not None:
            self.kls.append(kl(full_logits, r.last_logits))
            self.top1.append(float(int(r.last_logits.argmax()) == int(full_logits.argmax())))
        self.pins_held += sum(s.get("kv_pin") == "held" for s in r.segments)
        self.pins_broken += sum(s.get("kv_pin") == "evicted" for s in r.segments)
        if self.pin and ev["tool"]:
            self.reuse.pin(parts[:-1], self.cfg.tool_pin_s)
        del r
        self.store.flush()
        if self.shared is not None:
            self.shared.flush()

    def result(self) -> dict:
        s = self.store.stats()
        n = len(self.ttft)
        q = statistics.quantiles(self.ttft, n=20)
        return {"hit_rate": s["token_hit_ratio"], "ttft_p50_s": statistics.median(self.ttft), "ttft_p95_s": q[18],
                "disk_read_bytes_per_turn": s["disk_read_bytes"] / n,
                "redis_read_bytes_per_turn": s["redis_read_bytes"] / n, "recompute_chosen": s["recompute_chosen"],
                "rejected": s["rejected"], "evictions": s["evictions"], "pins_held": self.pins_held,
                "pins_evicted": self.pins_broken, "disk_write_s_per_turn": s["disk_write_s"] / n,
                "trace_kl": statistics.fmean(self.kls) if self.kls else None,
                "trace_top1": statistics.fmean(self.top1) if self.top1 else None, "stats": s}


def replay(runs: list[Replay], events: list[dict], log, kl_every: int = 4) -> None:
    """Every turn through every configuration, in alternating order, so that a machine whose
    load changes during the run (other processes) slows both alike. Every `kl_every`th turn
    is also prefilled in full (untimed, nothing stored) to score both against."""
    for i, ev in enumerate(events):
        full = None
        if kl_every and i % kl_every == kl_every - 1:
            full = runs[0].reuse.plan(runs[0].engine.tokenize_prompt(ev["segments"]), mode="full",
                                      store=False).last_logits
        for run in runs if i % 2 == 0 else runs[::-1]:
            run.step(ev, full)
        if (i + 1) % 20 == 0:
            log(f"  {i + 1}/{len(events)} turns: " + "  ".join(
                f"{r.name} hit rate {r.store.hit_tokens / max(r.store.looked_tokens, 1):.3f}" for r in runs))


def codec_quality(engine: Engine, cfg: Config, codec: str, prompts: int, chunk_tokens: int, log) -> dict:
    """The blend's KL against full prefill with KV through `codec` over with raw KV; top-1;
    bytes, encode and decode seconds per token."""
    prompt_list, memory = build_prompts(engine, prompts, 8, 4, chunk_tokens, seed=3)
    raw = ChunkReuse(engine, cfg, store=ChunkStore([("cpu", 4 << 30)]))
    raw.precompute(memory)
    coded = ChunkStore([("cpu", 4 << 30)], codec=codec, ram_codec=True)
    raw_bytes = coded_bytes = tokens = 0
    enc_s = dec_s = inflate_s = 0.0
    plain_payload = zlib_payload = 0
    layout: dict[str, int] = {}
    for key, held in raw.store.tiers[0].entries.items():
        t0 = time.perf_counter()
        blob = kvcodec.encode(key, held.namespace, held.kv, codec, entropy=False)
        enc_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        _, back = kvcodec.decode(blob, key)
        dec_s += time.perf_counter() - t0
        where = kvcodec.layout(blob)
        for part, n in where.items():
            layout[part] = layout.get(part, 0) + n
        # the optional entropy coding, measured on the payload: what it saves, what inflating costs
        payload = blob[where["header"]:]
        packed = zlib.compress(payload, 1)
        t0 = time.perf_counter()
        zlib.decompress(packed)
        inflate_s += time.perf_counter() - t0
        plain_payload += len(payload)
        zlib_payload += len(packed)
        raw_bytes += held.kv.nbytes
        coded_bytes += len(blob)
        tokens += held.kv.tokens
        coded.put(key, held.namespace, back)
    blended = ChunkReuse(engine, cfg, store=coded)
    blended.plan(engine.tokenize_prompt(prompt_list[0][:1] + prompt_list[0][-2:]))  # exact system prefix, both
    raw.plan(engine.tokenize_prompt(prompt_list[0][:1] + prompt_list[0][-2:]))
    kls_raw, kls_codec, top_raw, top_codec = [], [], [], []
    for prompt in prompt_list:
        parts = engine.tokenize_prompt(prompt)
        full = raw.plan(parts, mode="full", store=False).last_logits
        a = raw.plan(parts, mode="blend", store=False).last_logits
        b = blended.plan(parts, mode="blend", store=False).last_logits
        top = int(full.argmax())
        kls_raw.append(kl(full, a))
        kls_codec.append(kl(full, b))
        top_raw.append(float(int(a.argmax()) == top))
        top_codec.append(float(int(b.argmax()) == top))
        log(f"  quality: KL raw {kls_raw[-1]:.4f} {codec} {kls_codec[-1]:.4f}")
    prefix_kl, prefix_top1 = prefix_quality(engine, prompt_list, codec)
    return {"codec_prefix_kl": prefix_kl, "codec_prefix_top1": prefix_top1,"codec_bytes_ratio": coded_bytes / raw_bytes, "codec_kl_ratio": statistics.fmean(kls_codec) /
            max(statistics.fmean(kls_raw), 1e-9), "codec_top1": statistics.fmean(top_codec),
            "raw_top1": statistics.fmean(top_raw), "raw_kl": statistics.fmean(kls_raw),
            "codec_kl": statistics.fmean(kls_codec), "codec_bytes_per_token": coded_bytes / tokens,
            "raw_bytes_per_token": raw_bytes / tokens, "codec_encode_s_per_token": enc_s / tokens,
            "codec_decode_s_per_token": dec_s / tokens, "entropy_zlib_ratio": zlib_payload / plain_payload,
            "entropy_inflate_s_per_token": inflate_s / tokens,
            "codec_bytes_breakdown": {part: n / raw_bytes for part, n in layout.items()}}


def prefix_quality(engine: Engine, prompt_list: list[list[Segment]], codec: str) -> tuple[float, float]:
    """KL against full prefill, and top-1 agreement, of a prompt whose every token before the
    question comes as a prefix through `codec` (computed in this very context, as a hit taken
    for a prefix is: `kv_quantized_prefix`), the question prefilled after it."""
    kls, tops = [], []
    for prompt in prompt_list:
        parts = engine.tokenize_prompt(prompt)
        ids = [t for p in parts for t in p[0]]
        tail = len(parts[-1][0]) + len(parts[-2][0])  # the question and the generation prefix
        head = len(ids) - tail
        full = fuse(engine.model, ids, [Piece(0, len(ids))], "full", keep_raw=True)
        kv = ChunkKV(full.new_k_raw[:, :head].clone(), full.v[:, :head].clone(), "context")
        _, back = kvcodec.decode(kvcodec.encode("prefix", "", kv, codec, entropy=False), "prefix")
        got = fuse(engine.model, ids, [Piece(0, head, back, exact=True), Piece(head, tail)], "reuse").last_logits
        kls.append(kl(full.last_logits, got))
        tops.append(float(int(got.argmax()) == int(full.last_logits.argmax())))
    return statistics.fmean(kls), statistics.fmean(tops)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentmem bench kvstore", description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4, help="turns per session")
    ap.add_argument("--pool", type=int, default=24, help="memories per user")
    ap.add_argument("--recalled", type=int, default=4, help="memories per prompt")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--tool-rate", type=float, default=0.3)
    ap.add_argument("--ram-mb", type=float, default=8)
    ap.add_argument("--disk-mb", type=float, default=16)
    ap.add_argument("--redis-mb", type=float, default=16)
    ap.add_argument("--codec", choices=kvcodec.CODECS, default=None, help="default: config kv_codec")
    ap.add_argument("--ram-codec", choices=("on", "off"), default=None,
                    help="the policy's RAM tier holds the codec's blobs too (default: config kv_ram_codec)")
    ap.add_argument("--quality-prompts", type=int, default=8)
    ap.add_argument("--kl-every", type=int, default=4, help="score every n-th trace turn against full prefill (0: none)")
    ap.add_argument("--quality-chunk-tokens", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-redis", action="store_true", help="without the Redis tier")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    if args.quick:
        args.users, args.sessions, args.turns, args.pool, args.quality_prompts = 2, 1, 3, 6, 2
        args.quality_chunk_tokens, args.ram_mb, args.disk_mb, args.redis_mb = 48, 2, 2, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))
    budgets = {"ram": int(args.ram_mb * 2**20), "disk": int(args.disk_mb * 2**20), "redis": int(args.redis_mb * 2**20)}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        cfg = Config(dtype=args.dtype, kv_mode="full", kv_disk_dir=tmp / "unused")
        codec = args.codec or cfg.kv_codec
        ram_codec = cfg.kv_ram_codec if args.ram_codec is None else args.ram_codec == "on"
        engine = Engine.load(cfg)
        cfg = cfg.model_copy(update={"kv_mode": "blend"})
        events = build_trace(engine, args.users, args.sessions, args.turns, args.pool, args.recalled, args.tool_rate,
                             args.zipf, args.seed)
        log(f"{len(events)} turns of {args.users} users; dtype {engine.dtype}")
        server = None
        if not args.no_redis and shutil.which("redis-server"):
            server = _RedisServer(tmp)
        try:
            url = server.url if server is not None else None
            # warm-up: the kernels' first calls, outside both runs
            ChunkReuse(engine, cfg, store=ChunkStore([("cpu", 1 << 30)])).plan(
                engine.tokenize_prompt(events[0]["segments"]), store=False)
            runs = [Replay(engine, cfg, "lru", "raw", budgets, tmp, url, "lru:"),
                    Replay(engine, cfg, "value", codec, budgets, tmp, url, "policy:", ram_codec)]
            replay(runs, events, log, args.kl_every)
            lru, pol = (r.result() for r in runs)
        finally:
            if server is not None:
                server.stop()
        quality = codec_quality(engine, cfg, codec, args.quality_prompts, args.quality_chunk_tokens, log)
    out = {
        "bench": "kvstore",
        "turns": len(events),
        "users": args.users,
        "codec": codec,
        "ram_codec": ram_codec,
        "lru_hit_rate": lru["hit_rate"],
        "policy_hit_rate": pol["hit_rate"],
        "hit_rate_ratio": pol["hit_rate"] / max(lru["hit_rate"], 1e-9),
        "lru_ttft_p50_s": lru["ttft_p50_s"],
        "policy_ttft_p50_s": pol["ttft_p50_s"],
        "lru_ttft_p95_s": lru["ttft_p95_s"],
        "policy_ttft_p95_s": pol["ttft_p95_s"],
        **{k: quality[k] for k in ("codec_bytes_ratio", "codec_kl_ratio", "codec_top1", "codec_prefix_kl",
                                   "codec_prefix_top1")},
        "lru_trace_kl": lru["trace_kl"],
        "policy_trace_kl": pol["trace_kl"],
        "lru_trace_top1": lru["trace_top1"],
        "policy_trace_top1": pol["trace_top1"],
        "lru_disk_write_s_per_turn": lru["disk_write_s_per_turn"],
        "policy_disk_write_s_per_turn": pol["disk_write_s_per_turn"],
        "lru_disk_read_bytes_per_turn": lru["disk_read_bytes_per_turn"],
        "policy_disk_read_bytes_per_turn": pol["disk_read_bytes_per_turn"],
        "lru_redis_read_bytes_per_turn": lru["redis_read_bytes_per_turn"],
        "policy_redis_read_bytes_per_turn": pol["redis_read_bytes_per_turn"],
        "quality": {k: v for k, v in quality.items() if k not in ("codec_bytes_ratio", "codec_kl_ratio", "codec_top1",
                                                                "codec_prefix_kl", "codec_prefix_top1")},
        "policy_detail": {k: pol[k] for k in ("recompute_chosen", "rejected", "evictions", "pins_held", "pins_evicted")}
        | {"reuse_by_kind": pol["stats"].get("reuse_by_kind", {})},
        "lru_detail": {k: lru[k] for k in ("rejected", "evictions")},
        "budgets_bytes": budgets,
        "redis": server is not None,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
