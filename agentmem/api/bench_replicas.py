"""`agentmem bench serve --replicas N`: N `agentmem serve` processes on one PostgreSQL, each
pinned to a core of its own, with the clients' turns spread over them as a load balancer
would: routed by user (client i on replica i mod N: its chunk KV stays warm there), and
alternating (turn n of client i on replica (i + n) mod N: every turn finds the other
replica's writes). The peer, in the same run on the same workload: one replica on one core.
`replicas_speedup` is N replicas' throughput (routed by user) over one's at the highest
level; `alternating_speedup` the same for alternating turns.

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
from pathlib import Path

import httpx

from .bench import QUESTIONS, measure, serve_process
from .local import free_port


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


@contextmanager
def replica(data_dir: Path, db_url: str, cpu: int | None, max_tokens: int, dtype: str | None,
            redis_url: str | None = None):
    """One `agentmem serve` process on `db_url` with its own data directory, pinned to `cpu`."""
    port = free_port()
    cmd = [sys.executable, "-m", "agentmem.cli", "serve", "--data-dir", str(data_dir), "--db-url", db_url,
           "--port", str(port), "--rate-limit", "0", "--reflect-every-turns", "0", "--no-ui", "--preload",
           "--log-level", "warning", "--max-tokens", str(max_tokens)]
    if dtype:
        cmd += ["--dtype", dtype]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu)] + cmd
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", AGENTMEM_THREADS="1",
               AGENTMEM_KV_DISK_DIR=str(data_dir / "chunks"))
    env.pop("AGENTMEM_REDIS_URL", None)
    if redis_url:
        env["AGENTMEM_REDIS_URL"] = redis_url
    data_dir.mkdir(parents=True, exist_ok=True)
    with serve_process(cmd, env, port) as url:
        yield url


def _tenant(db_url: str, data_dir: Path, name: str) -> str:
    from ..config import Config
    from ..tiers.store import MemoryStore
    from .auth import create_tenant_with_key

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
        a = stack.enter_context(replica(root / "kv-a", db_url, None, args.max_tokens, args.dtype, redis_url))
        b = stack.enter_context(replica(root / "kv-b", db_url, None, args.max_tokens, args.dtype, redis_url))
        c = stack.enter_context(replica(root / "kv-c", db_url, None, args.max_tokens, args.dtype))
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
    db_url = args.db_url or os.environ.get("AGENTMEM_DB_URL")
    if not db_url or not db_url.startswith("postgresql"):
        print("agentmem bench serve --replicas: give --db-url postgresql+psycopg://... (replicas share PostgreSQL)",
              file=sys.stderr)
        return 2
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    cpus = os.cpu_count() or 1
    results: dict[str, list[dict]] = {"replicas": [], "alternating": [], "single": []}
    with tempfile.TemporaryDirectory(prefix="agentmem-bench-replicas-") as tmp, pg_schema(db_url) as url:
        root = Path(tmp)
        key = _tenant(url, root / "admin", "bench-replicas")
        with ExitStack() as stack:
            many = [stack.enter_context(replica(root / f"r{i}", url, i % cpus, args.max_tokens, args.dtype))
                    for i in range(args.replicas)]
            single = [stack.enter_context(replica(root / "single", url, 0, args.max_tokens, args.dtype))]
            for urls, name in ((many, "replicas"), (single, "single")):  # warm: embedder, engine loop
                for u in urls:
                    measure([u], key, 1, 1, args.max_tokens, f"warm-{name}-{u[-5:]}", timeout=args.timeout)
            arms = (("replicas", many, True), ("alternating", many, False), ("single", single, True))
            for n in levels:
                for name, urls, sticky in arms:
                    r = measure(urls, key, n, args.requests, args.max_tokens, name, timeout=args.timeout,
                                sticky=sticky)
                    results[name].append(r)
                    print(f"  {name:<11} {n:>3} clients: {r['throughput_req_s']:.3f} req/s, p50 {r['p50_s']:.2f} s, "
                          f"{r['errors']} errors", file=sys.stderr, flush=True)
        rows = []
        for m, alt, s in zip(results["replicas"], results["alternating"], results["single"], strict=True):
            one = s["throughput_req_s"]
            rows.append({**m, "single": s, "alternating": alt,
                         "speedup": round(m["throughput_req_s"] / one, 3) if one else 0.0,
                         "alternating_speedup": round(alt["throughput_req_s"] / one, 3) if one else 0.0})
        result = {
            "bench": "serve",
            "replicas": args.replicas,
            "workload": "chat turns with memory; replicas: each client on one replica (routing by user), "
                        "alternating: turn n of client i on replica (i + n) mod N",
            "database": "postgresql",
            "pinning": f"replica i on cpu i mod {cpus}, AGENTMEM_THREADS=1; the peer: one replica on cpu 0",
            "requests_per_client": args.requests,
            "max_tokens": args.max_tokens,
            "peer": "1 replica, same database and workload, same run",
            "levels": rows,
            "replicas_speedup": rows[-1]["speedup"],
            "alternating_speedup": rows[-1]["alternating_speedup"],
            "errors": sum(r["errors"] + r["single"]["errors"] + r["alternating"]["errors"] for r in rows),
        }
        if args.redis_url:
            result |= shared_kv(root, url, args.redis_url, args)
    print(json.dumps(result))
    return 0 if result["errors"] == 0 else 1
