"""`agentmem bench mcp`: what the MCP protocol adds to a memory call.

One user with a long history (10,000 generated multi-session turns by default, the scale
test's conversations); the two calls an agent makes on every exchange, `search_memory`
(k = 10) with the generator's own questions and `add_messages` (the user's turn and the
reply), timed at the caller three ways in one run:
- through the Python API (`MemoryStore.search`, `MemoryStore.add_messages`): the peer;
- over stdio, the official `mcp` client talking to an `agentmem mcp` child process;
- over streamable HTTP, the same client against an `agentmem serve` child process's `/mcp`.
Each server process loads its own copy of the user's index, so every path gets warm-up calls
that are not timed. The three paths run side by side and every call is made on each of them
back to back, in a random order, so that the machine's other load falls on all of them alike.
The MCP calls name the session, as the Python calls do, so both do the same work.
The protocol's overhead is a path's p50 minus the Python API's (`overhead_p50_ms`, the
target's measure); `overhead_paired_median_ms` is the median of the back-to-back differences.
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
from contextlib import AsyncExitStack
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


def _plain(turn: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in turn]


class _Mcp:
    """One MCP client session; `time` calls a tool and returns the seconds it took at the caller."""

    def __init__(self, client):
        self.client = client

    async def time(self, name: str, args: dict) -> float:
        t0 = time.perf_counter()
        r = await self.client.call_tool(name, args)
        spent = time.perf_counter() - t0
        if r.is_error:
            raise RuntimeError(f"{name} failed: {r.content[0].text}")
        return spent


class _Python:
    """The peer: the same work through the Python API, in this process."""

    def __init__(self, store, tenant: str, user: str):
        self.store, self.tenant, self.user = store, tenant, user

    async def time(self, name: str, args: dict) -> float:
        t0 = time.perf_counter()
        if name == "search_memory":
            self.store.search(self.tenant, self.user, args["query"], args["k"])
        else:
            self.store.add_messages(self.tenant, self.user, args["session_id"], args["messages"])
        return time.perf_counter() - t0


async def _stdio_client(stack: AsyncExitStack, data: Path, tenant: str, user: str) -> _Mcp:
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    params = StdioServerParameters(command=sys.executable, env=_child_env(), args=[
        "-m", "agentmem.cli", "mcp", "--user", user, "--tenant", tenant, "--data-dir", str(data)])
    return _Mcp(await stack.enter_async_context(Client(params, read_timeout_seconds=600)))


async def _http_client(stack: AsyncExitStack, url: str, key: str, user: str) -> _Mcp:
    import httpx2  # the mcp client's HTTP library
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {key}", "X-Agentmem-User": user}
    http = await stack.enter_async_context(httpx2.AsyncClient(headers=headers, timeout=600))
    return _Mcp(await stack.enter_async_context(
        Client(streamable_http_client(url, http_client=http), read_timeout_seconds=600)))


async def _interleaved(paths: dict, queries: list[str], turns: list[list[dict]], sid: str, seed: int) -> dict:
    """Every call is made on every path back to back, in a fresh random order each time, so
    that whatever else the machine is doing falls on all the paths alike."""
    rng = random.Random(seed)
    times: dict[str, dict[str, list[float]]] = {p: {c: [] for c in CALLS} for p in paths}

    async def each(name: str, args_for, timed: bool) -> None:
        order = list(paths)
        rng.shuffle(order)
        for p in order:
            spent = await paths[p].time(name, args_for(p))
            if timed:
                times[p][name].append(spent)

    for q in queries[:WARMUP]:
        await each("search_memory", lambda p, q=q: {"query": q, "k": K}, False)
    for q in tqdm(queries, desc="search_memory", file=sys.stderr):
        await each("search_memory", lambda p, q=q: {"query": q, "k": K}, True)
    per_path = {p: iter(turns[i::len(paths)]) for i, p in enumerate(paths)}  # each path stores its own turns
    for _ in tqdm(range(len(queries)), desc="add_messages", file=sys.stderr):
        await each("add_messages", lambda p: {"messages": _plain(next(per_path[p])), "session_id": sid}, True)
    for p in paths:  # what was added is searchable on every path
        await paths[p].time("search_memory", {"query": queries[0], "k": K})
    return times


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
    turns = [extra[i:i + 2] for i in range(0, 2 * 3 * calls, 2)]  # 3 paths x calls exchanges
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

    port = _free_port()
    proc = _serve(data, port)
    try:
        async def run() -> dict:
            async with AsyncExitStack() as stack:
                print("starting the stdio server and connecting ...", file=sys.stderr)
                paths = {"python": _Python(store, tenant, user),
                         "stdio": await _stdio_client(stack, data, tenant, user),
                         "http": await _http_client(stack, f"http://127.0.0.1:{port}/mcp", key, user)}
                return await _interleaved(paths, queries, turns, sid, seed)

        times = asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(30)
        store.close()
    result = {p: {c: _ms(times[p][c]) for c in CALLS} for p in times}
    paired = {p: {c: round(float(np.median(np.subtract(times[p][c], times["python"][c]))) * 1000, 3)
                  for c in CALLS} for p in ("stdio", "http")}
    overhead = {path: {c: round(result[path][c]["p50_ms"] - result["python"][c]["p50_ms"], 3) for c in CALLS}
                for path in ("stdio", "http")}
    return {"bench": "mcp", "messages": messages, "calls": calls, "k": K, "index_s": round(index_s, 2), **result,
            "overhead_p50_ms": overhead, "overhead_paired_median_ms": paired, "target_overhead_p50_ms": TARGET_OVERHEAD_MS,
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
