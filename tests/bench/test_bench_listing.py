"""`agentmem bench listing` at a small size: every listing walked to its end, pages bounded."""

from __future__ import annotations

import json

from agentmem.bench import listing


def test_bench_listing_walks_every_page(capsys):
    assert listing.main(["--users", "150", "--sessions", "150", "--messages", "150", "--repeat", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["users"] == 150 and out["sessions_per_user"] == 150
    for name in ("users", "sessions", "messages"):
        r = out["listings"][name]
        assert r["page_default"]["rows"] == 100 and r["page_max"]["rows"] == 150
        assert r["walk"]["pages"] == 2 and r["walk"]["rows"] == 150
        assert r["page_default"]["bytes"] < r["page_max"]["bytes"] <= r["walk"]["bytes"]
