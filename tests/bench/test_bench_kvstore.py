"""`agentmem bench kvstore` at its smallest: both configurations replay the trace and the JSON
contract holds (the figures themselves come from the full run, not from here)."""

from __future__ import annotations

import json
import shutil

import pytest

from agentmem.bench import kvstore

KEYS = {"lru_hit_rate", "policy_hit_rate", "lru_ttft_p50_s", "policy_ttft_p50_s", "lru_ttft_p95_s",
        "policy_ttft_p95_s", "codec_bytes_ratio", "codec_kl_ratio", "codec_top1", "codec_prefix_kl",
        "codec_prefix_top1", "lru_trace_kl", "policy_trace_kl", "lru_disk_read_bytes_per_turn",
        "policy_disk_read_bytes_per_turn", "lru_redis_read_bytes_per_turn", "policy_redis_read_bytes_per_turn",
        "lru_disk_write_s_per_turn", "policy_disk_write_s_per_turn"}


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_quick_run_keeps_the_json_contract(capsys):
    assert kvstore.main(["--quick", "--json", "--kl-every", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= set(out) and out["bench"] == "kvstore" and out["redis"]
    assert 0 <= out["lru_hit_rate"] <= 1 and 0 <= out["policy_hit_rate"] <= 1
    assert out["codec"] == "int4" and out["codec_bytes_ratio"] < 0.35
    assert 0 <= out["codec_prefix_kl"] < 0.1 and 0 <= out["policy_trace_kl"] < 1
    # the budgets are tiny: both configurations spilled to disk and read from it
    assert out["lru_disk_read_bytes_per_turn"] > 0 and out["policy_disk_write_s_per_turn"] > 0
