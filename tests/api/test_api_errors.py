"""Error bodies state what they check: every sampling range a 400 states is the one applied
(its ends accepted, just past them refused) and the one docs/replies.md gives; an import's
out-of-range time names its field; every code these answers carry is in docs/api.md's
table of error codes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _serve import serve

CHAT = "/v1/chat/completions"
DOCS = Path(__file__).resolve().parents[2] / "docs"
HI = [{"role": "user", "content": "hi"}]
# field, lowest accepted, highest accepted, just below, just above, the range as stated
RANGES = [("temperature", 0, 2, -0.01, 2.01, "[0, 2]"), ("top_p", 0.01, 1, 0, 1.01, "(0, 1]"),
          ("min_p", 0, 1, -0.01, 1.01, "[0, 1]"), ("repetition_penalty", 0.01, 10, 0, 10.01, "(0, 10]"),
          ("frequency_penalty", -2, 2, -2.01, 2.01, "[-2, 2]"), ("presence_penalty", -2, 2, -2.01, 2.01, "[-2, 2]"),
          ("top_logprobs", 0, 20, -1, 21, "[0, 20]")]


@pytest.fixture(scope="module")
def svc(engine, embedder, tmp_path_factory):
    with serve(engine, embedder, tmp_path_factory.mktemp("errors"), tenants=("acme",), rate_per_minute=0,
               max_tokens=8) as s:
        yield s


def _codes_documented() -> set[str]:
    table = DOCS.joinpath("api.md").read_text().split("## Errors", 1)[1].split("\n## ", 1)[0]
    return {c for row in table.splitlines() if row.startswith("| `") for c in re.findall(r"`([a-z_]+)`", row.split("|")[1])}


SEEN: set[str] = set()


def _err(r, code: str, param: str | None) -> dict:
    assert r.status_code in (400, 422), r.text
    e = r.json()["error"]
    assert (e["code"], e["param"]) == (code, param), e
    SEEN.add(code)
    return e


@pytest.mark.parametrize(("field", "low", "high", "below", "above", "stated"), RANGES)
def test_each_sampling_range_is_stated_as_applied(svc, field, low, high, below, above, stated):
    c = svc.client("acme")
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    for ok in (low, high):
        r = c.post(CHAT, json={"messages": HI, "max_tokens": 1, field: ok, **extra})
        assert r.status_code == 200, (field, ok, r.text)
    for bad in (below, above):
        e = _err(c.post(CHAT, json={"messages": HI, "max_tokens": 1, field: bad, **extra}), "invalid_sampling", field)
        assert stated in e["message"], (field, e["message"])
    row = next(line for line in DOCS.joinpath("replies.md").read_text().splitlines() if f"`{field}`" in line
               and line.startswith("|"))
    assert stated in row, (field, row)


def test_an_imports_out_of_range_time_names_its_field(svc):
    c = svc.client("acme")
    c.post("/v1/users/timey/messages", json={"messages": [{"role": "user", "content": "hello"}]}).raise_for_status()
    c.post("/v1/users/timey/memories", json={"text": "a fact"}).raise_for_status()
    doc = c.get("/v1/users/timey/export").json()
    for key, field in (("messages", "event_time"), ("messages", "created_at"), ("memories", "event_time"),
                       ("sessions", "created_at"), ("memories", "updated_at")):
        for t in ("0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00"):
            bad = {**doc, key: [{**doc[key][0], field: t}, *doc[key][1:]]}
            e = _err(c.post("/v1/users/timey2/import", json=bad), "invalid_export", f"{key}.0.{field}")
            assert "outside" in e["message"]
    assert c.get("/v1/users/timey2/export").status_code == 404  # nothing was stored


def test_every_code_answered_here_is_documented(svc):
    c = svc.client("acme")
    _err(c.get("/v1/users", params={"limit": 5000}), "invalid_limit", "limit")
    _err(c.get("/v1/users", params={"cursor": "zzz"}), "invalid_cursor", "cursor")
    _err(c.post(CHAT, json={"messages": HI, "max_tokens": 10**6}), "max_tokens_too_large", "max_tokens")
    _err(c.post("/v1/users/a.b/memories", json={"text": "x", "event_time": "0001-01-01T00:00:00+05:00"}),
         "validation_error", "event_time")
    missing = SEEN - _codes_documented()
    assert not missing, missing
    assert {"invalid_sampling", "invalid_export", "not_found", "invalid_api_key"} <= _codes_documented()
