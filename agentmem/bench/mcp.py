"""`agentmem bench mcp`: what the MCP protocol adds to a memory call.

One user with a long history (10,000 generated multi-session turns by default, the scale
test's conversations); the two calls an agent makes on every exchange, `search_memory`
(k = 10) with the generator's own questions and `add_messages` (the user's turn and the
reply), timed at the caller three ways in one run:
- through the Python API (`MemoryStore.search`, `MemoryStore.add_messages`): the peer;
- over stdio, the official `mcp` client talking to an `agentmem mcp` child process;
- over streamable HTTP, the same client against an `agentmem serve` child process's `/mcp`.
Each server process loads its own copy of the user's index, so every path gets warm-up calls
that are not timed. The protocol's overhead is a path's p50 minus the Python API's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .recall_data.generator import scale_history

K = 10
BATCH = 500
WARMUP = 5
TARGET_OVERHEAD_MS = 10.0
CALLS = ("search_memory", "add_messages")


def _ms(times: list[float]) -> dict:
    a = np.asarray(times) * 1000
    return {"p50_ms": round(float(np.percentile(a, 50)), 3), "p95_ms": round(float(np.percentile(a, 95)), 3),
            "n": len(times)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


async def _time_mcp(client, user_args: dict, queries: list[str], turns: list[list[dict]]) -> dict:
    async def call(name: str, args: dict) -> float:
        t0 = time.perf_counter()
        r = await client.call_tool(name, {**args, **user_args})
        spent = time.perf_counter() - t0
        if r.is_error:
            raise RuntimeError(f"{name} failed: {r.content[0].text}")
        return spent

    for q in queries[:WARMUP]:
        await call("search_memory", {"query": q, "k": K})
    search = [await call("search_memory", {"query": q, "k": K}) for q in queries]
    add = [await call("add_messages", {"messages": _plain(t)}) for t in turns]
    await call("search_memory", {"query": queries[0], "k": K})  # the added turns are searchable
    return {"search_memory": _ms(search), "add_messages": _ms(add)}


def _plain(turn: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in turn]


async def _stdio(data: Path, tenant: str, user: str, queries, turns) -> dict:
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    params = StdioServerParameters(command=sys.executable, env=_child_env(), args=[
        "-m", "agentmem.cli", "mcp", "--user", user, "--tenant", tenant, "--data-dir", str(data)])
    async with Client(params, read_timeout_seconds=600) as client:
        return await _time_mcp(client, {}, queries, turns)


async def _http(url: str, key: str, user: str, queries, turns) -> dict:
    import httpx2  # the mcp client's HTTP library
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {key}", "X-Agentmem-User": user}
    async with httpx2.AsyncClient(headers=headers, timeout=600) as http:
        async with Client(streamable_http_client(url, http_client=http), read_timeout_seconds=600) as client:
            return await _time_mcp(client, {}, queries, turns)


def _serve(data: Path, port: int) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "agentmem.cli", "serve", "--data-dir", str(data), "--port",
                             str(port), "--no-ui", "--reflect-every-turns", "0", "--log-level", "warning"],
                            env=_child_env(), stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"agentmem serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("agentmem serve did not come up in 300 s")


def measure(messages: int, calls: int, seed: int, data: Path) -> dict:
    from ..api.auth import create_tenant_with_key
    from ..config import Config
    from ..tiers.store import MemoryStore

    history, questions = scale_history(seed, messages + 2 * (3 * calls + 1))
    rng = random.Random(seed)
    queries = [rng.choice(questions) for _ in range(calls)]
    extra = history[messages:]
    turns = [extra[i:i + 2] for i in range(0, 2 * 3 * calls, 2)]
    config = Config(data_dir=data, embed_bulk_nice=0)  # the set-up's indexing at full priority
    store = MemoryStore(config)
    tenant, key = create_tenant_with_key(store, "bench-mcp")
    user = "bench-user"
    sid = store.open_session(tenant, user).id
    with tqdm(total=messages, desc="history", file=sys.stderr) as bar:
        for i in range(0, messages, BATCH):
            batch = history[i:min(messages, i + BATCH)]
            store.add_messages(tenant, user, sid, batch)
            bar.update(len(batch))
    t0 = time.perf_counter()
    store.search(tenant, user, queries[0], K)  # embeds the history
    index_s = time.perf_counter() - t0

    for q in queries[:WARMUP]:
        store.search(tenant, user, q, K)
    search, add = [], []
    for q in tqdm(queries, desc="python search", file=sys.stderr):
        t0 = time.perf_counter()
        store.search(tenant, user, q, K)
        search.append(time.perf_counter() - t0)
    for t in turns[:calls]:
        t0 = time.perf_counter()
        store.add_messages(tenant, user, sid, _plain(t))
        add.append(time.perf_counter() - t0)
    store.search(tenant, user, queries[0], K)
    result = {"python": {"search_memory": _ms(search), "add_messages": _ms(add)}}
    store.close()

    print("stdio ...", file=sys.stderr)
    result["stdio"] = asyncio.run(_stdio(data, tenant, user, queries, turns[calls:2 * calls]))
    port = _free_port()
    proc = _serve(data, port)
    try:
        print("http ...", file=sys.stderr)
        result["http"] = asyncio.run(_http(f"http://127.0.0.1:{port}/mcp", key, user, queries,
                                           turns[2 * calls:3 * calls]))
    finally:
        proc.terminate()
        proc.wait(30)
    overhead = {path: {c: round(result[path][c]["p50_ms"] - result["python"][c]["p50_ms"], 3) for c in CALLS}
                for path in ("stdio", "http")}
    return {"bench": "mcp", "messages": messages, "calls": calls, "k": K, "index_s": round(index_s, 2), **result,
            "overhead_p50_ms": overhead, "target_overhead_p50_ms": TARGET_OVERHEAD_MS,
            "meets_target": all(v <= TARGET_OVERHEAD_MS for o in overhead.values() for v in o.values())}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agentmem bench mcp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--messages", type=int, default=10_000, help="the user's history")
    ap.add_argument("--calls", type=int, default=100, help="timed calls of each kind per path")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.messages < 1 or args.calls < 2:
        ap.error("--messages must be >= 1 and --calls >= 2")
    with tempfile.TemporaryDirectory(prefix="agentmem-bench-mcp-") as tmp:
        result = measure(args.messages, args.calls, args.seed, Path(tmp))
    if not args.json:
        for path in ("python", "stdio", "http"):
            row = "  ".join(f"{c} p50 {result[path][c]['p50_ms']:.1f} ms p95 {result[path][c]['p95_ms']:.1f} ms"
                            for c in CALLS)
            print(f"{path:<7} {row}")
        print(f"overhead p50: {result['overhead_p50_ms']} (target <= {TARGET_OVERHEAD_MS} ms)")
    print(json.dumps(result))
    return 0
