"""`agentmem bench serve`: the REST service under 1, 4 and 16 concurrent clients.

Each level runs a fixed number of chat turns per client (every client is its own user, so
every turn recalls memory and is stored, as in real use) against a real `agentmem serve`
process on loopback, and reports throughput, p50/p99 latency and errors. The peer, measured
in the same run on the same workload, is the same server started with `--serial`: one
request at a time, as a server without a batching engine answers. Both servers are up for
the whole run and each level runs on one, then at once on the other. The speedup per level
is batched throughput over serial throughput.

The noisy-neighbour run (on the batched server, after the levels) measures a quiet tenant's
search and time-to-first-token p95 alone, then again while a second tenant floods the
same server at its limits: `--flood-clients` concurrent clients each streaming chat turns
and posting messages of the longest allowed size (a 429 makes a client wait its
Retry-After). `neighbour_search_p95_s` and `neighbour_ttft_p95_s` beside
`alone_search_p95_s` and `alone_ttft_p95_s` show what the flood costs the quiet tenant.

The fair-share run (`--fair`, on the batched server, last) measures the engine's share
between tenants: one tenant's short requests (stateless, `--fair-short-tokens` tokens, one
at a time) alone, then while another tenant keeps `--fair-streams` long streamed replies
(`--fair-long-tokens` tokens each, restarted as each ends) running on the same engine.
`fair_short_alone_p95_s` and `fair_short_with_long_p95_s` are the short tenant's p95
latency in the two phases, `fair_ratio` the second over the first, `fair_meets_target`
whether it is within FAIR_TARGET (2x). An unmeasured warm-up of both tenants comes first:
the decode step's buckets for the wider batch are compiled then, not during a measured phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import AsyncExitStack, ExitStack, contextmanager
from pathlib import Path

import httpx

from ..api.local import free_port

FAIR_TARGET = 2.0  # the short tenant's p95 beside the long streams, at most this times its p95 alone

QUESTIONS = (
    "I just adopted a dog called Pepper. Any tips for the first week?",
    "What should I cook tonight with rice and beans?",
    "Remind me what my dog is called.",
    "Give me one idea for a weekend trip.",
    "Summarise what you know about me in one sentence.",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentmem bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--quick", action="store_true", help="smoke size: levels 1,4, one turn per client, 4 tokens")
    p.add_argument("--levels", default="1,4,16", help="concurrent clients per level, comma-separated")
    p.add_argument("--requests", type=int, default=3, help="chat turns per client per level")
    p.add_argument("--max-tokens", type=int, default=16, help="reply tokens per turn")
    p.add_argument("--stateless", action="store_true", help="chat without `user` (no memory), prompt only")
    p.add_argument("--dtype", help="server dtype: auto | float32 | bfloat16")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
    p.add_argument("--neighbour", choices=("on", "off", "only"), default="on",
                   help="the noisy-neighbour run after the levels (only: skip the levels and the serial peer)")
    p.add_argument("--neighbour-probes", type=int, default=12, help="quiet tenant's searches and chats per phase")
    p.add_argument("--flood-clients", type=int, default=16, help="the noisy tenant's concurrent clients")
    p.add_argument("--flood-chars", type=int, default=30_000, help="characters of each message the flood posts")
    p.add_argument("--fair", choices=("on", "off", "only"), default="on",
                   help="the fair-share run after the others (only: skip the levels, the serial peer and the "
                        "noisy-neighbour run)")
    p.add_argument("--fair-streams", type=int, default=8, help="the long tenant's concurrent streams")
    p.add_argument("--fair-long-tokens", type=int, default=128, help="tokens of each long stream")
    p.add_argument("--fair-short-tokens", type=int, default=4, help="tokens of each short request")
    p.add_argument("--fair-probes", type=int, default=8, help="the short tenant's requests per phase")
    p.add_argument("--replicas", type=int, default=1,
                   help="N > 1: N replicas on one PostgreSQL (--db-url) against one replica (bench/serve_replicas.py)")
    p.add_argument("--db-url", help="with --replicas: the PostgreSQL the replicas share (a schema of its own is used)")
    p.add_argument("--redis-url", help="with --replicas: also measure the shared chunk-KV tier in this Redis")
    p.add_argument("--kv-users", type=int, default=4, help="with --redis-url: users per arm of the KV measurement")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --replicas: each level's arms this many times, interleaved (figures over all rounds)")
    p.add_argument("--kv-turns", type=int, default=6, help="with --redis-url: turns on the first replica per user")
    return p


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def measure(url: str | list[str], key: str, clients: int, requests: int, max_tokens: int, prefix: str,
            stateless: bool = False, timeout: float = 900.0, sticky: bool = False,
            keep_latencies: bool = False) -> dict:
    """`clients` concurrent clients, each sending `requests` chat turns back to back, all
    starting together; latency is per request, throughput over the whole level's wall time.
    Given several URLs (replicas), turn n of client i goes to URL (i + n) mod len, or to URL
    i mod len with `sticky` (a load balancer routing by user). The clients are coroutines on
    one event loop (async httpx), so the load generator itself costs little CPU: its share
    of one core over the level is `loadgen_cpu_share`. `keep_latencies`: each request's
    seconds under `latencies_s` too."""
    return asyncio.run(_measure(url, key, clients, requests, max_tokens, prefix, stateless, timeout, sticky,
                                keep_latencies))


async def _measure(url, key, clients, requests, max_tokens, prefix, stateless, timeout, sticky,
                   keep_latencies) -> dict:
    urls = [url] if isinstance(url, str) else list(url)
    latencies: list[float] = []
    errors: list[str] = []
    tokens = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with AsyncExitStack() as stack:
        cs = [await stack.enter_async_context(httpx.AsyncClient(
            base_url=u, headers={"Authorization": f"Bearer {key}"}, timeout=timeout, limits=limits)) for u in urls]

        async def client(i: int) -> None:
            nonlocal tokens
            for n in range(requests):
                c = cs[(i if sticky else i + n) % len(cs)]
                body = {"model": "agentmem", "max_tokens": max_tokens,
                        "messages": [{"role": "user", "content": QUESTIONS[(i + n) % len(QUESTIONS)]}]}
                if not stateless:
                    body["user"] = f"{prefix}-{clients}-{i}"
                t = time.perf_counter()
                try:
                    r = await c.post("/v1/chat/completions", json=body)
                    ok = r.status_code == 200
                    detail = "" if ok else f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as exc:
                    ok, detail = False, repr(exc)
                took = time.perf_counter() - t
                if ok:
                    latencies.append(took)
                    tokens += r.json()["usage"]["completion_tokens"]
                else:
                    errors.append(detail)

        # this thread only: the clients are coroutines on its loop (an in-process server, as in
        # the tests, runs on other threads and is not the load generator)
        cpu0, t0 = time.thread_time(), time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    lat = sorted(latencies)
    out = {"clients": clients, "requests": len(lat) + len(errors), "errors": len(errors),
           "throughput_req_s": round(len(lat) / wall, 4), "p50_s": round(percentile(lat, 0.5), 4),
           "p99_s": round(percentile(lat, 0.99), 4), "tokens_s": round(tokens / wall, 2),
           "wall_s": round(wall, 3), "loadgen_cpu_share": round(cpu / wall, 4), "error_samples": errors[:3]}
    if keep_latencies:
        out["latencies_s"] = lat
    return out


def _ttft(c: httpx.Client, body: dict) -> float:
    """Seconds until the first SSE event of a streamed chat (the server sends it with the
    first token)."""
    t = time.perf_counter()
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - t
        if first is None:
            raise RuntimeError("a streamed chat sent no event")
        return first


def _probe(url: str, key: str, probes: int, max_tokens: int, timeout: float) -> dict:
    """The quiet tenant's requests, one at a time: a search, then a streamed chat turn."""
    searches, ttfts = [], []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout) as c:
        for i in range(probes):
            t = time.perf_counter()
            c.post("/v1/users/quiet/search", json={"query": QUESTIONS[i % len(QUESTIONS)], "k": 5}).raise_for_status()
            searches.append(time.perf_counter() - t)
            ttfts.append(_ttft(c, {"user": "quiet", "max_tokens": max_tokens,
                                   "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}))
    searches.sort()
    ttfts.sort()
    return {"search_p95_s": round(percentile(searches, 0.95), 4), "ttft_p95_s": round(percentile(ttfts, 0.95), 4),
            "search_p50_s": round(percentile(searches, 0.5), 4), "ttft_p50_s": round(percentile(ttfts, 0.5), 4)}


def neighbour(url: str, quiet_key: str, noisy_key: str, args) -> dict:
    """The quiet tenant's search and TTFT p95 alone, then while the noisy tenant floods."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {quiet_key}"}, timeout=args.timeout) as c:
        for q in QUESTIONS:  # the quiet user has a history to search
            c.post("/v1/users/quiet/messages", json={"messages": [{"role": "user", "content": q}]}).raise_for_status()
    alone = _probe(url, quiet_key, args.neighbour_probes, args.max_tokens, args.timeout)
    stop = threading.Event()
    sent = {"chats": 0, "posts": 0, "shed": 0, "errors": 0}
    lock = threading.Lock()
    filler = ("My notes for today, in full detail. " * (args.flood_chars // 36 + 1))[: args.flood_chars]

    def flood(i: int) -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {noisy_key}"}, timeout=args.timeout) as c:
            n = 0
            while not stop.is_set():
                try:
                    if n % 2:
                        c.post(f"/v1/users/noisy-{i}/messages",
                               json={"messages": [{"role": "user", "content": f"{n} {filler}"}]}).raise_for_status()
                        kind = "posts"
                    else:
                        _ttft(c, {"user": f"noisy-{i}", "max_tokens": args.max_tokens,
                                  "messages": [{"role": "user", "content": QUESTIONS[n % len(QUESTIONS)]}]})
                        kind = "chats"
                except httpx.HTTPStatusError as exc:  # a 429 is the server shedding the flood: back off
                    kind = "shed" if exc.response.status_code == 429 else "errors"
                    if kind == "shed":
                        stop.wait(float(exc.response.headers.get("Retry-After", "1")))
                except (httpx.HTTPError, RuntimeError):
                    kind = "errors"
                with lock:
                    sent[kind] += 1
                n += 1

    threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(args.flood_clients)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the flood is under way before the quiet tenant is measured
    flooded = _probe(url, quiet_key, args.neighbour_probes, args.max_tokens, args.timeout)
    stop.set()
    for t in threads:
        t.join()
    return {"alone": alone, "flooded": flooded, "flood_clients": args.flood_clients,
            "flood_chars": args.flood_chars, "flood_requests": sent, "probes": args.neighbour_probes,
            "search_ratio": round(flooded["search_p95_s"] / alone["search_p95_s"], 3) if alone["search_p95_s"] else 0,
            "ttft_ratio": round(flooded["ttft_p95_s"] / alone["ttft_p95_s"], 3) if alone["ttft_p95_s"] else 0}


def _short_requests(url: str, key: str, n: int, max_tokens: int, timeout: float) -> list[float]:
    """`n` stateless chat requests of `max_tokens` tokens, one at a time: each one's seconds."""
    out = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout) as c:
        for i in range(n):
            body = {"model": "agentmem", "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
            t = time.perf_counter()
            c.post("/v1/chat/completions", json=body).raise_for_status()
            out.append(time.perf_counter() - t)
    return out


class LongStreams:
    """`streams` threads of one tenant, each streaming chat replies of up to `max_tokens` tokens
    (asking for a long story, sampled, so a reply rarely ends early) back to back until
    stopped; counts the replies and events received."""

    def __init__(self, url: str, key: str, streams: int, max_tokens: int, timeout: float):
        self.url, self.key, self.max_tokens, self.timeout = url, key, max_tokens, timeout
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.replies = self.events = self.errors = 0
        self.refusal: str | None = None
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(streams)]

    def _run(self, i: int) -> None:
        body = {"model": "agentmem", "max_tokens": self.max_tokens, "stream": True, "temperature": 1.0,
                "messages": [{"role": "user", "content": f"Write a long story about a dog called Pepper, part {i}."}]}
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"},
                          timeout=self.timeout) as c:
            while not self.stop.is_set():
                try:
                    with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if line.startswith("data:"):
                                with self.lock:
                                    self.events += 1
                            if self.stop.is_set():
                                break
                    with self.lock:
                        self.replies += 1
                except httpx.HTTPStatusError as exc:  # refused (a limit): no point asking again
                    with self.lock:
                        self.errors += 1
                        self.refusal = f"HTTP {exc.response.status_code}"
                    return
                except httpx.HTTPError:
                    with self.lock:
                        self.errors += 1
                    self.stop.wait(1.0)

    def __enter__(self) -> LongStreams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def wait_events(self, n: int, timeout: float) -> None:
        """Until the streams have sent `n` events in all (they are all decoding then)."""
        deadline = time.monotonic() + timeout
        while self.events < n and time.monotonic() < deadline and not self.stop.is_set():
            if self.refusal is not None:
                raise RuntimeError(f"a long stream was refused: {self.refusal}")
            time.sleep(0.1)


def fair(url: str, short_key: str, long_key: str, args) -> dict:
    """The short tenant's p95 latency alone, then beside the long tenant's streams."""
    short = lambda n: _short_requests(url, short_key, n, args.fair_short_tokens, args.timeout)  # noqa: E731
    t0 = time.perf_counter()
    with LongStreams(url, long_key, args.fair_streams, args.fair_long_tokens, args.timeout) as warm:
        # warm-up, unmeasured: every stream decoding and the short tenant's request beside them
        warm.wait_events(2 * args.fair_streams, args.timeout)
        short(2)
    warm_s = time.perf_counter() - t0
    short(1)
    alone = sorted(short(args.fair_probes))
    with LongStreams(url, long_key, args.fair_streams, args.fair_long_tokens, args.timeout) as streams:
        streams.wait_events(2 * args.fair_streams, args.timeout)
        beside = sorted(short(args.fair_probes))
        replies, events, errors = streams.replies, streams.events, streams.errors
    a, b = percentile(alone, 0.95), percentile(beside, 0.95)
    ratio = b / a if a else 0.0
    return {"fair_short_alone_p95_s": round(a, 4), "fair_short_with_long_p95_s": round(b, 4),
            "fair_ratio": round(ratio, 3), "fair_meets_target": bool(a) and ratio <= FAIR_TARGET,
            "fair": {"target_ratio": FAIR_TARGET, "streams": args.fair_streams, "long_tokens": args.fair_long_tokens,
                     "short_tokens": args.fair_short_tokens, "probes": args.fair_probes,
                     "short_alone_s": [round(x, 3) for x in alone], "short_with_long_s": [round(x, 3) for x in beside],
                     "long_replies": replies, "long_events": events, "errors": errors, "warm_up_s": round(warm_s, 1)}}


@contextmanager
def serve_process(cmd: list[str], env: dict[str, str], port: int, procs: list | None = None):
    """Run an `agentmem serve` command line, wait for its /healthz, yield its URL, stop it after
    (its log is shown if it dies on the way up). `procs`: the Popen is appended to it."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        if procs is not None:
            procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"agentmem serve exited: {log.read().decode()[-2000:]}")
                try:
                    if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("agentmem serve did not come up in 300 s")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def server(data_dir: Path, serial: bool, max_tokens: int, dtype: str | None):
    """A real `agentmem serve` process on a free loopback port; yields its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "agentmem.cli", "serve", "--data-dir", str(data_dir), "--port", str(port),
           "--rate-limit", "0", "--reflect-every-turns", "0", "--no-ui", "--preload", "--log-level", "warning", "--max-tokens", str(max_tokens)]
    if serial:
        cmd.append("--serial")
    if dtype:
        cmd += ["--dtype", dtype]
    # chunk KV in the run's own directory: nothing carries over between runs or into the user's cache
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", AGENTMEM_KV_DISK_DIR=str(data_dir / "chunks"))
    with serve_process(cmd, env, port) as url:
        yield url


def start(stack: ExitStack, root: Path, mode: str, args) -> tuple[str, str, dict[str, str]]:
    """A fresh server for `mode` (its own data dir and tenant, plus the quiet and noisy
    tenants of the neighbour run and the short and long ones of the fair-share run), warmed
    by one unmeasured turn (it loads the embedder and starts the engine loop); returns
    (url, key, {tenant name: key})."""
    from ..api.auth import create_tenant_with_key
    from ..config import Config
    from ..tiers.store import MemoryStore

    data = root / mode
    store = MemoryStore(Config(data_dir=data))
    _, key = create_tenant_with_key(store, f"bench-{mode}")
    others = {name: create_tenant_with_key(store, name)[1] for name in ("quiet", "noisy", "short", "long")}
    store.close()
    # the server's largest max_tokens: the fair-share run's long streams ask for more than a turn
    largest = max(args.max_tokens, getattr(args, "fair_long_tokens", 0))
    url = stack.enter_context(server(data, mode == "serial", largest, args.dtype))
    warm = measure(url, key, 1, 1, args.max_tokens, f"{mode}-warm", args.stateless, args.timeout)
    if warm["errors"]:
        raise RuntimeError(f"warm-up request failed: {warm['error_samples']}")
    return url, key, others


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.quick:
        args.levels, args.requests, args.max_tokens = "1,4", 1, 4
        args.neighbour_probes, args.flood_clients, args.flood_chars = 3, 4, 2000
        args.fair_streams, args.fair_long_tokens, args.fair_probes = 4, 32, 3
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    if not levels or min(levels) < 1 or args.requests < 1 or args.max_tokens < 1:
        print("agentmem bench serve: levels, --requests and --max-tokens must be positive", file=sys.stderr)
        return 2
    if args.replicas > 1:
        from .serve_replicas import main as replicas_main

        return replicas_main(args)
    # both servers stay up and each level runs on one right after the other, so a change in
    # the machine's other load hits both sides of a comparison alike
    results: dict[str, list[dict]] = {"batched": [], "serial": []}
    if args.neighbour == "only" or args.fair == "only":
        levels, results = [], {"batched": []}
    run_neighbour = args.neighbour != "off" and args.fair != "only"
    nb = fs = None
    with tempfile.TemporaryDirectory(prefix="agentmem-bench-serve-") as tmp, ExitStack() as stack:
        started = {mode: start(stack, Path(tmp), mode, args) for mode in results}
        servers = {mode: (url, key) for mode, (url, key, _) in started.items()}
        url, key = servers["batched"]
        model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
        for n in levels:
            for mode, (url, key) in servers.items():
                r = measure(url, key, n, args.requests, args.max_tokens, mode, args.stateless, args.timeout)
                results[mode].append(r)
                if not args.json:
                    print(f"  {mode:<8} {n:>3} clients: {r['throughput_req_s']:.3f} req/s, p50 {r['p50_s']:.2f} s, "
                          f"p99 {r['p99_s']:.2f} s, {r['errors']} errors", file=sys.stderr, flush=True)
        url, _, tenants = started["batched"]
        if run_neighbour:
            nb = neighbour(url, tenants["quiet"], tenants["noisy"], args)
        if args.fair != "off":
            fs = fair(url, tenants["short"], tenants["long"], args)
    batched, serial = results["batched"], results.get("serial", [])
    rows = []
    for b, s in zip(batched, serial, strict=True):
        speedup = b["throughput_req_s"] / s["throughput_req_s"] if s["throughput_req_s"] else 0.0
        rows.append({**b, "serial": s, "speedup": round(speedup, 3)})
    result = {
        "bench": "serve",
        "model": model["data"][0]["id"],
        "workload": "stateless chat" if args.stateless else "chat turns with memory (one user per client)",
        "requests_per_client": args.requests,
        "max_tokens": args.max_tokens,
        "peer": "the same server with --serial (one request at a time)",
        "levels": rows,
        "speedup": rows[-1]["speedup"] if rows else None,
        "errors": sum(r["errors"] + r["serial"]["errors"] for r in rows),
    }
    if nb is not None:
        result.update(neighbour=nb, neighbour_search_p95_s=nb["flooded"]["search_p95_s"],
                      neighbour_ttft_p95_s=nb["flooded"]["ttft_p95_s"], alone_search_p95_s=nb["alone"]["search_p95_s"],
                      alone_ttft_p95_s=nb["alone"]["ttft_p95_s"])
        result["errors"] += nb["flood_requests"]["errors"]
    if fs is not None:
        result.update(fs)
        result["errors"] += fs["fair"]["errors"]
        if not args.json:
            print(f"fair share: short requests p95 {fs['fair_short_alone_p95_s']:.2f} s alone, "
                  f"{fs['fair_short_with_long_p95_s']:.2f} s beside {args.fair_streams} long streams "
                  f"-> {fs['fair_ratio']:.2f}x", file=sys.stderr)
    if not args.json:
        for r in rows:
            print(f"{r['clients']:>3} clients: batched {r['throughput_req_s']:.3f} req/s vs serial "
                  f"{r['serial']['throughput_req_s']:.3f} req/s -> {r['speedup']:.2f}x", file=sys.stderr)
    print(json.dumps(result))
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
