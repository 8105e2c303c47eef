"""`agentmem bench serve --replicas N`: N `agentmem serve` processes on one PostgreSQL, each
pinned to a core of its own, with the clients' turns spread over them as a load balancer
would: routed by user (client i on replica i mod N: its chunk KV stays warm there), and
alternating (turn n of client i on replica (i + n) mod N: every turn finds the other
replica's writes). The peer, in the same run on the same workload: one replica on one core.
`replicas_speedup` is N replicas' throughput (routed by user) over one's at the highest
level; `alternating_speedup` the same for alternating turns. With `--rounds`, each level's
arms run that many times, interleaved and in reversed order every other round, so that a
change in the machine's other load hits every arm alike.

Where the CPU went is measured beside each arm (Linux /proc): each replica's share of a
core, its CPU seconds per request, the load generator's share (async clients on one event
loop), PostgreSQL's (all of its processes), and `other_cores`, the rest of the machine's
busy time: work that is not this run's but competes with the replicas for their cores.
`speedup_at_full_cores` is what the measured CPU cost per request implies when each replica
has its core to itself: N x (1 replica's CPU seconds per request) / (N replicas'). It is a
projection from measured figures, printed beside the measured `replicas_speedup`, not
instead of it.

With `--redis-url`, a second part measures the shared chunk-KV tier: users have a first turn
on replica A, then their next turn on replica B with Redis (A's chunk KV is there) or on
replica C without it; `ttft_saved_s` is C's mean time to first token minus B's, and
`redis_kv_hit_ratio` B's hit ratio in Redis.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..api.local import free_port
from .serve import QUESTIONS, measure, percentile, serve_process


@contextmanager
def pg_schema(url: str):
    """A fresh schema of this run's own on `url` (dropped afterwards); yields its URL."""
    import sqlalchemy as sa

    schema = f"agentmem_bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(url)
    with admin.begin() as c:
        c.execute(sa.text(f"create schema {schema}"))
    try:
        yield sa.engine.make_url(url).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(False)
    finally:
        with admin.begin() as c:
            c.execute(sa.text(f"drop schema {schema} cascade"))
        admin.dispose()


@dataclass
class Replica:
    url: str
    pid: int


@contextmanager
def replica(data_dir: Path, db_url: str, cpu: int | None, max_tokens: int, dtype: str | None,
            redis_url: str | None = None):
    """One `agentmem serve` process on `db_url` with its own data directory, pinned to `cpu`
    (taskset; torch on one thread); yields a `Replica`."""
    port = free_port()
    cmd = [sys.executable, "-m", "agentmem.cli", "serve", "--data-dir", str(data_dir), "--db-url", db_url,
           "--port", str(port), "--rate-limit", "0", "--reflect-every-turns", "0", "--no-ui", "--preload",
           "--log-level", "warning", "--max-tokens", str(max_tokens)]
    if dtype:
        cmd += ["--dtype", dtype]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu)] + cmd
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", AGENTMEM_THREADS="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", AGENTMEM_KV_DISK_DIR=str(data_dir / "chunks"))
    env.pop("AGENTMEM_REDIS_URL", None)
    if redis_url:
        env["AGENTMEM_REDIS_URL"] = redis_url
    data_dir.mkdir(parents=True, exist_ok=True)
    procs: list = []
    with serve_process(cmd, env, port, procs) as url:
        yield Replica(url, procs[0].pid)


# --- where the CPU went (Linux /proc) ---------------------------------------------------------
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def postgres_seconds() -> float:
    """CPU seconds of every PostgreSQL process on this machine (others' included)."""
    total = 0.0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() in ("postgres", "postmaster"):
                    total += cpu_seconds(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return total


def machine_seconds() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole machine since boot, from /proc/stat."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = v[3] + v[4]
    return (sum(v[:8]) - idle - v[7]) / TICK, v[7] / TICK


def allowed_cpus(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def run_arm(reps: list[Replica], key: str, clients: int, args, prefix: str, sticky: bool) -> dict:
    """One measured level on `reps`, with where the CPU went meanwhile: each replica's share of
    a core, PostgreSQL's (all of it on the machine), the load generator's, and the rest of the
    machine's (other users of these cores: it competes with the replicas)."""
    rep0, pg0, (busy0, steal0) = [cpu_seconds(r.pid) for r in reps], postgres_seconds(), machine_seconds()
    r = measure([x.url for x in reps], key, clients, args.requests, args.max_tokens, prefix, timeout=args.timeout,
                sticky=sticky, keep_latencies=True)
    rep = [cpu_seconds(x.pid) - a for x, a in zip(reps, rep0, strict=True)]
    busy, steal = machine_seconds()
    wall, ok = r["wall_s"], r["requests"] - r["errors"]
    pg = postgres_seconds() - pg0
    r |= {"replica_cpu_share": [round(x / wall, 3) for x in rep], "postgres_cpu_share": round(pg / wall, 3),
          "machine_busy_cores": round((busy - busy0) / wall, 3), "stolen_cores": round((steal - steal0) / wall, 3),
          "other_cores": round((busy - busy0 - sum(rep) - pg) / wall - r["loadgen_cpu_share"], 3),
          "replica_cpu_s_per_request": round(sum(rep) / ok, 4) if ok else None}
    return r


def merge(rounds: list[dict]) -> dict:
    """One level's rounds as one: throughput over their summed wall time, percentiles over all
    requests, CPU shares weighted by wall time."""
    wall = sum(r["wall_s"] for r in rounds)
    lat = sorted(x for r in rounds for x in r.pop("latencies_s"))
    ok = sum(r["requests"] - r["errors"] for r in rounds)

    def share(k: str) -> float:
        return round(sum(r[k] * r["wall_s"] for r in rounds) / wall, 3)

    return {"clients": rounds[0]["clients"], "requests": sum(r["requests"] for r in rounds),
            "errors": sum(r["errors"] for r in rounds), "rounds": len(rounds),
            "throughput_req_s": round(ok / wall, 4), "p50_s": round(percentile(lat, 0.5), 4),
            "p99_s": round(percentile(lat, 0.99), 4),
            "tokens_s": round(sum(r["tokens_s"] * r["wall_s"] for r in rounds) / wall, 2), "wall_s": round(wall, 3),
            "replica_cpu_share": [round(sum(r["replica_cpu_share"][i] * r["wall_s"] for r in rounds) / wall, 3)
                                  for i in range(len(rounds[0]["replica_cpu_share"]))],
            **{k: share(k) for k in ("loadgen_cpu_share", "postgres_cpu_share", "machine_busy_cores",
                                     "stolen_cores", "other_cores")},
            "replica_cpu_s_per_request": round(sum(r["replica_cpu_s_per_request"] * (r["requests"] - r["errors"])
                                                   for r in rounds) / ok, 4) if ok else None,
            "error_samples": [e for r in rounds for e in r["error_samples"]][:3]}


def _tenant(db_url: str, data_dir: Path, name: str) -> str:
    from ..api.auth import create_tenant_with_key
    from ..config import Config
    from ..tiers.store import MemoryStore

    store = MemoryStore(Config(data_dir=data_dir, db_url=db_url))
    _, key = create_tenant_with_key(store, name)
    store.close()
    return key


def _turn(url: str, key: str, user: str, text: str, max_tokens: int) -> dict:
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=600,
                   json={"model": "agentmem", "user": user, "max_tokens": max_tokens,
                         "messages": [{"role": "user", "content": text}]})
    r.raise_for_status()
    return r.json()


def _metric(url: str, name: str) -> float | None:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def shared_kv(root: Path, db_url: str, redis_url: str, args) -> dict:
    """First turns on A (with Redis), second turns on B (with Redis) or C (without)."""
    key = _tenant(db_url, root / "admin-kv", "bench-kv")
    users = max(1, args.kv_users)
    with ExitStack() as stack:
        a, b, c = (stack.enter_context(replica(root / f"kv-{name}", db_url, None, args.max_tokens, args.dtype, redis))
                   for name, redis in (("a", redis_url), ("b", redis_url), ("c", None)))
        a, b, c = a.url, b.url, c.url
        # users in pairs with the same questions: one of each pair goes on to B, the other to C
        for i in range(2 * users):
            for n in range(args.kv_turns):
                _turn(a, key, f"kv-{i}", QUESTIONS[(i // 2 + n) % len(QUESTIONS)], args.max_tokens)
        time.sleep(1.0)  # A's writes to Redis leave the request path: let them land
        with_redis, without, prompt_tokens = [], [], []
        for i in range(2 * users):
            url, out = (b, with_redis) if i % 2 == 0 else (c, without)
            r = _turn(url, key, f"kv-{i}", QUESTIONS[(i // 2 + args.kv_turns) % len(QUESTIONS)], args.max_tokens)
            prompt_tokens.append(r["usage"]["prompt_tokens"])
            out.append(r["agentmem"]["ttft_s"])
        hit_ratio = _metric(b, "agentmem_kv_chunk_redis_hit_ratio")
    return {"redis_kv_hit_ratio": round(hit_ratio or 0.0, 4),
            "ttft_with_redis_s": round(statistics.mean(with_redis), 4),
            "ttft_without_redis_s": round(statistics.mean(without), 4),
            "ttft_saved_s": round(statistics.mean(without) - statistics.mean(with_redis), 4),
            "kv_users_per_arm": users, "kv_first_turns": args.kv_turns,
            "kv_prompt_tokens_mean": round(statistics.mean(prompt_tokens), 1)}


def main(args) -> int:
    from ..config import Config

    db_url = args.db_url or Config().db_url
    if not db_url or not db_url.startswith("postgresql"):
        print("agentmem bench serve --replicas: give --db-url postgresql+psycopg://... (replicas share PostgreSQL)",
              file=sys.stderr)
        return 2
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    cpus = os.cpu_count() or 1
    arms = ("single", "replicas", "alternating")
    results: dict[str, list[dict]] = {name: [] for name in arms}
    load = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="agentmem-bench-replicas-") as tmp, pg_schema(db_url) as url:
        root = Path(tmp)
        key = _tenant(url, root / "admin", "bench-replicas")
        with ExitStack() as stack:
            many = [stack.enter_context(replica(root / f"r{i}", url, i % cpus, args.max_tokens, args.dtype))
                    for i in range(args.replicas)]
            single = [stack.enter_context(replica(root / "single", url, 0, args.max_tokens, args.dtype))]
            pinned = {"replicas": [allowed_cpus(r.pid) for r in many], "single": allowed_cpus(single[0].pid)}
            for name, reps in (("replicas", many), ("single", single)):  # warm: embedder, engine loop
                for r in reps:
                    measure([r.url], key, 1, 1, args.max_tokens, f"warm-{name}-{r.pid}", timeout=args.timeout)
            setup = {"single": (single, True), "replicas": (many, True), "alternating": (many, False)}
            for n in levels:
                rounds: dict[str, list[dict]] = {name: [] for name in arms}
                for k in range(args.rounds):  # arms interleaved, order reversed each round: load drift hits all
                    for name in arms if k % 2 == 0 else arms[::-1]:
                        reps, sticky = setup[name]
                        rounds[name].append(run_arm(reps, key, n, args, f"{name}-r{k}", sticky))
                for name in arms:
                    r = merge(rounds[name])
                    results[name].append(r)
                    print(f"  {name:<11} {n:>3} clients: {r['throughput_req_s']:.3f} req/s, p50 {r['p50_s']:.2f} s, "
                          f"cpu {r['replica_cpu_share']}, {r['replica_cpu_s_per_request']} cpu-s/req, other "
                          f"{r['other_cores']} cores, {r['errors']} errors", file=sys.stderr, flush=True)
        rows = []
        for m, alt, s in zip(results["replicas"], results["alternating"], results["single"], strict=True):
            one = s["throughput_req_s"]
            rows.append({**m, "single": s, "alternating": alt,
                         "speedup": round(m["throughput_req_s"] / one, 3) if one else 0.0,
                         "alternating_speedup": round(alt["throughput_req_s"] / one, 3) if one else 0.0})
        top = rows[-1]
        top_arms = (top, top["single"], top["alternating"])
        result = {
            "bench": "serve",
            "replicas": args.replicas,
            "workload": "chat turns with memory, every client its own user; replicas: each client on one replica "
                        "(routing by user), alternating: turn n of client i on replica (i + n) mod N; single: "
                        "all clients on the one replica",
            "database": "postgresql",
            "pinning": f"replica i on cpu i mod {cpus} (taskset), AGENTMEM_THREADS=1 and OMP_NUM_THREADS=1; "
                       "the peer: one replica on cpu 0",
            "pinned_cpus": pinned,
            "requests_per_client": args.requests,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "peer": "1 replica, same database and workload, same run, arms interleaved",
            "levels": rows,
            "replicas_speedup": top["speedup"],
            "alternating_speedup": top["alternating_speedup"],
            # where the 2 cores went at the top level (cores, i.e. CPU seconds per second)
            "loadgen_cpu_share": max(r["loadgen_cpu_share"] for r in top_arms),
            "replica_cpu_share": {"replicas": top["replica_cpu_share"], "single": top["single"]["replica_cpu_share"]},
            "replica_cpu_s_per_request": {"replicas": top["replica_cpu_s_per_request"],
                                          "single": top["single"]["replica_cpu_s_per_request"]},
            "speedup_at_full_cores": round(args.replicas * top["single"]["replica_cpu_s_per_request"]
                                           / top["replica_cpu_s_per_request"], 3)
            if top["replica_cpu_s_per_request"] and top["single"]["replica_cpu_s_per_request"] else None,
            "other_cores": {"replicas": top["other_cores"], "single": top["single"]["other_cores"]},
            "load_average": {"start": load, "end": [round(x, 2) for x in os.getloadavg()]},
            "errors": sum(r["errors"] + r["single"]["errors"] + r["alternating"]["errors"] for r in rows),
        }
        if args.redis_url:
            result |= shared_kv(root, url, args.redis_url, args)
    print(json.dumps(result))
    return 0 if result["errors"] == 0 else 1
