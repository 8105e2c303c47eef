"""`agentmem bench mcp` end to end on a small history: the Python API, stdio and HTTP paths
all timed, and the overhead computed from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("mcp")


@pytest.mark.slow
def test_bench_mcp_times_every_path():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "agentmem.cli", "bench", "mcp", "--json", "--messages", "400",
                          "--calls", "4"], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["messages"] == 400 and r["calls"] == 4
    for path in ("python", "stdio", "http"):
        for call in ("search_memory", "add_messages"):
            t = r[path][call]
            assert t["n"] == 4 and 0 < t["p50_ms"] <= t["p95_ms"]
    for path in ("stdio", "http"):
        assert r["overhead_p50_ms"][path]["search_memory"] == pytest.approx(
            r[path]["search_memory"]["p50_ms"] - r["python"]["search_memory"]["p50_ms"], abs=1e-3)
    assert isinstance(r["meets_target"], bool)
