"""Every listing endpoint pages: `limit` (default 100, at most 1000; outside that a 400
naming `limit`) and an opaque `cursor`, each answer carrying `next_cursor` (null on the last
page) beside its `object` and `data`; walking the pages of a listing that changes meanwhile
sees every row that was there throughout exactly once, in a stable order."""

from __future__ import annotations

import pytest
from _serve import serve
from sqlalchemy import delete

from agentmem.api.pages import DEFAULT_LIMIT, MAX_LIMIT
from agentmem.tiers.schema import SessionRow


@pytest.fixture(scope="module")
def svc(engine, embedder, tmp_path_factory):
    with serve(engine, embedder, tmp_path_factory.mktemp("pages"), tenants=("acme", "other"), rate_per_minute=0) as s:
        yield s


def _walk(c, path: str, limit: int, **params) -> list[list[dict]]:
    pages, cursor = [], None
    while True:
        r = c.get(path, params={"limit": limit, **params, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and set(body) >= {"object", "data", "next_cursor"}
        assert len(body["data"]) <= limit
        pages.append(body["data"])
        cursor = body["next_cursor"]
        if cursor is None:
            return pages
        assert len(pages) < 1000


def _err(r, code: str, param: str) -> None:
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert (e["code"], e["param"]) == (code, param), e


def test_users_page_by_id_with_default_and_max_limits(svc):
    c = svc.client("acme")
    tid = svc.keys["acme"][0]
    ids = [f"u{i:04d}" for i in range(230)]
    for uid in ids:
        svc.store.archive.ensure_user(tid, uid)
    svc.store.archive.ensure_user(svc.keys["other"][0], "u0001-other")
    first = c.get("/v1/users").json()
    assert len(first["data"]) == DEFAULT_LIMIT and first["next_cursor"]
    pages = _walk(c, "/v1/users", 100)
    assert [len(p) for p in pages] == [100, 100, 30]
    assert [u["id"] for p in pages for u in p] == ids  # sorted, no repeats, nothing of the other tenant
    _err(c.get("/v1/users", params={"limit": MAX_LIMIT + 1}), "invalid_limit", "limit")
    _err(c.get("/v1/users", params={"limit": 0}), "invalid_limit", "limit")
    assert len(c.get("/v1/users", params={"limit": MAX_LIMIT}).json()["data"]) == 230
    _err(c.get("/v1/users", params={"cursor": "not-a-cursor"}), "invalid_cursor", "cursor")
    _err(c.get("/v1/users", params={"cursor": "x" * 600}), "invalid_cursor", "cursor")
    # a cursor is its listing's own: a users cursor given to the sessions listing is refused
    _err(c.get("/v1/users/u0000/sessions", params={"cursor": first["next_cursor"]}), "invalid_cursor", "cursor")


def test_a_walk_sees_every_row_present_throughout_once_while_rows_come_and_go(svc):
    c = svc.client("acme")
    tid = svc.keys["acme"][0]
    for i in range(40):
        svc.store.open_session(tid, "walker", f"s{i:02d}")
    svc.store.add_messages(tid, "walker", "s03", [{"role": "user", "content": f"m{i}"} for i in range(3)])
    seen, cursor, n = [], None, 0
    while True:
        r = c.get("/v1/users/walker/sessions", params={"limit": 7, **({"cursor": cursor} if cursor else {})}).json()
        seen += [s["id"] for s in r["data"]]
        n += 1
        if n == 2:  # between pages: one seen session goes, one unseen goes, a new one comes
            with svc.store.archive.tx() as s:
                s.execute(delete(SessionRow).where(SessionRow.tenant_id == tid, SessionRow.id.in_(["s01", "s30"])))
            svc.store.open_session(tid, "walker", "s99-new")
        cursor = r["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen))
    assert {f"s{i:02d}" for i in range(40)} - {"s01", "s30"} <= set(seen) and "s30" not in seen
    assert seen[-1] == "s99-new"  # sessions come oldest first: the newest one on the last page
    counts = {s["id"]: s["message_count"] for p in _walk(c, "/v1/users/walker/sessions", 1000) for s in p}
    assert counts["s03"] == 3 and counts["s04"] == 0


def test_messages_memories_core_and_turns_page(svc):
    c = svc.client("acme")
    tid = svc.keys["acme"][0]
    stored = svc.store.add_messages(tid, "pager", svc.store.open_session(tid, "pager", "conv").id,
                                    [{"role": "user", "content": f"message {i}"} for i in range(25)])
    pages = _walk(c, "/v1/users/pager/sessions/conv/messages", 10)
    assert [len(p) for p in pages] == [10, 10, 5]
    assert [m["id"] for p in pages for m in p] == [m.id for m in stored]

    mems = [svc.store.archive.add_memory(tid, "pager", f"fact {i}", 0.5, (), "fact", None, None, True)
            for i in range(12)]
    svc.store.archive.update_memory(tid, "pager", mems[4].id, superseded_by=mems[5].id)
    pages = _walk(c, "/v1/users/pager/memories", 5, status="all")
    assert [m["id"] for p in pages for m in p] == [m.id for m in mems]
    active = [m["id"] for p in _walk(c, "/v1/users/pager/memories", 5, status="active") for m in p]
    assert active == [m.id for m in mems if m.id != mems[4].id]

    for label in ("a", "b", "c"):
        svc.store.set_core_block(tid, "pager", label, f"block {label}")
    pages = _walk(c, "/v1/users/pager/core", 2)
    assert [[b["label"] for b in p] for p in pages] == [["a", "b"], ["c"]]

    turns = [svc.store.record_turn(tid, "pager", "conv", {"n": i}) for i in range(7)]
    first = c.get("/v1/users/pager/turns").json()
    assert [t["id"] for t in first["data"]] == [t.id for t in turns] and first["next_cursor"] is None
    pages = _walk(c, "/v1/users/pager/turns", 3)  # newest page first, each page oldest first
    assert [[t["trace"]["n"] for t in p] for p in pages] == [[4, 5, 6], [1, 2, 3], [0]]
    _err(c.get("/v1/users/pager/turns", params={"limit": MAX_LIMIT + 1}), "invalid_limit", "limit")
    _err(c.get("/v1/users/pager/memories", params={"cursor": "eyJ4Ijox"}), "invalid_cursor", "cursor")
