"""The service under hostile and careless tenants, against a real server: input
that used to answer 500 answers 4xx or 200 and leaves nothing behind, every error is JSON and
counted, deletion is final, authentication is bounded and rate limited."""

from __future__ import annotations

import json
import secrets
import time
from datetime import datetime

import httpx
import pytest
import sqlalchemy as sa
from _serve import serve

from agentmem.api.auth import KeyCache
from agentmem.engine.loop import EngineLoop
from agentmem.tiers.records import NotFound
from agentmem.tiers.store import MemoryStore

EXTREME_TIMES = ("0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00")


def _serve(engine, embedder, data, db_url=None, **limits):
    """This file's server: tenants acme and globex, tight limits, no rate limit."""
    return serve(engine, embedder, data, tenants=("acme", "globex"), db_url=db_url,
                 **({"max_body_bytes": 64_000, "max_message_chars": 4000, "max_tokens": 16, "rate_per_minute": 0}
                    | limits))


@pytest.fixture(scope="module")
def svc(engine, embedder, tmp_path_factory):
    with _serve(engine, embedder, tmp_path_factory.mktemp("tenants")) as s:
        yield s.server, s.keys, s.store


def _client(svc, tenant="acme") -> httpx.Client:
    server, keys, _ = svc
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {keys[tenant][1]}"}, timeout=120)


def _users(store, keys, tenant="acme") -> set[str]:
    return {u.id for u in store.list_users(keys[tenant][0])}


def test_every_openai_role_is_served(svc):
    """`developer` is what current OpenAI SDKs send instead of `system`; tool results come as
    `tool` (or the legacy `function`): all answer 200, plain and streamed."""
    c = _client(svc)
    for role in ("developer", "tool", "function"):
        msgs = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
        assert r.status_code == 200, r.text
        with c.stream("POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "stream": True}) as s:
            assert s.status_code == 200 and "[DONE]" in s.read().decode()
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 422 and "developer" in r.text  # the refusal names the roles


T0 = "2026-01-01T00:00:00+00:00"


def _doc(messages=(), memories=(), core_blocks=()) -> dict:
    """An export document (every list present, every row with its time) around the given rows."""
    messages = [{"created_at": T0, **m} for m in messages]
    sessions = [{"id": sid, "created_at": T0} for sid in dict.fromkeys(m["session_id"] for m in messages)]
    return {"version": 1, "sessions": sessions, "messages": messages,
            "memories": [{"created_at": T0, **m} for m in memories], "core_blocks": list(core_blocks)}


def test_bad_text_times_and_numbers_are_4xx_and_store_nothing(svc):
    server, keys, store = svc
    c = _client(svc)
    lone = json.dumps({"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 2})
    r = c.post("/v1/chat/completions", content=lone, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_text"
    r = c.post("/v1/users/surr/messages", content=lone.replace('"max_tokens": 2', '"session_id": "s"'),
               headers={"Content-Type": "application/json"})
    assert r.status_code == 422  # pydantic refuses a lone surrogate in a plain string field
    for t in EXTREME_TIMES:
        r = c.post("/v1/users/timey/memories", json={"text": "a fact", "event_time": t})
        assert r.status_code == 422 and "outside" in r.text, r.text
        r = c.post("/v1/users/timey/messages", json={"messages": [{"role": "user", "content": "x", "event_time": t}]})
        assert r.status_code == 422
        doc = _doc([{"id": 1, "session_id": "s", "role": "user", "text": "ok"},
                    {"id": 2, "session_id": "s", "role": "user", "text": "x", "event_time": t}])
        r = c.post("/v1/users/timey/import", json=doc)
        assert r.status_code == 400 and r.json()["error"]["code"] in {"invalid_export", "invalid_input"}, r.text
        assert "outside" in r.json()["error"]["message"]
    big = json.dumps(_doc([{"id": 7, "session_id": "s", "role": "user", "text": "x"}])).replace('"id": 7', '"id": 1e400')
    r = c.post("/v1/users/timey/import", content=big.encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.id")
    r = c.post("/v1/users/timey/import", json=_doc(memories=[{"id": 1, "text": "x", "kind": "k" * 33}]))
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("memories.0.kind")
    r = c.post("/v1/users/timey/import", json=_doc(core_blocks=[{"label": "a", "value": "", "limit": -1}]))
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("core_blocks.0.limit")
    assert not {"surr", "timey"} & _users(store, keys)  # no failed request created its user


def test_failing_import_leaves_nothing_and_a_retry_duplicates_nothing(svc):
    _, keys, store = svc
    c = _client(svc)
    msgs = [{"id": i, "session_id": f"s{i % 2}", "role": "user", "text": f"message {i}"} for i in range(1, 7)]
    mems = [{"id": 1, "text": "Ann keeps bees.", "source_ids": [1]},
            {"id": 2, "text": "Ann moved.", "status": "superseded", "superseded_by": 3},
            {"id": 3, "text": "Ann lives in Oslo."}]
    bad = _doc(msgs, [*mems, {"id": 4, "text": ""}])
    assert c.post("/v1/users/ann/import", json=bad).status_code == 400
    assert "ann" not in _users(store, keys)
    long = _doc([{"id": 1, "session_id": "s", "role": "user", "text": "y" * 4001}])
    r = c.post("/v1/users/ann/import", json=long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "message_too_long"  # the live limit
    good = _doc(msgs, mems)
    r = c.post("/v1/users/ann/import", json=good)
    assert r.status_code == 201 and r.json()["created"] == {"sessions": 2, "messages": 6, "memories": 3, "core_blocks": 0}
    r = c.post("/v1/users/ann/import", json=good)  # the retry
    assert r.status_code == 200 and r.json()["unchanged"] is True
    tid = keys["acme"][0]
    assert len(store.archive.messages(tid, "ann")) == 6 and len(store.list_sessions(tid, "ann")) == 2
    old = {m.text: m for m in store.list_memories(tid, "ann")}
    assert old["Ann moved."].superseded_by == old["Ann lives in Oslo."].id


def test_context_preview_stores_no_session(svc):
    _, keys, store = svc
    c = _client(svc)
    assert c.post("/v1/users/cleo/memories", json={"text": "Cleo plays chess."}).status_code == 201
    r = c.post("/v1/users/cleo/context", json={"query": "What does Cleo play?"})
    assert r.status_code == 200 and "chess" in json.dumps(r.json())
    assert store.list_sessions(keys["acme"][0], "cleo") == []


def test_a_crash_is_a_json_500_that_closes_and_is_counted(svc):
    server, keys, store = svc
    c = _client(svc)
    original = store.archive.core_blocks
    store.archive.core_blocks = lambda *a: 1 / 0
    try:
        c.post("/v1/users/zed/memories", json={"text": "z"})
        r = c.get("/v1/users/zed/core")
    finally:
        store.archive.core_blocks = original
    assert r.status_code == 500 and r.headers["connection"] == "close"
    assert r.json()["error"]["code"] == "internal_error"
    metrics = httpx.get(server.url + "/metrics").text
    assert 'route="/v1/users/{user_id}/core",status="500"' in metrics


def test_oversize_bodies_are_413_chunked_or_not_and_counted(svc):
    server, _, _ = svc
    c = _client(svc)

    def chunks():
        for _ in range(70):
            yield b"x" * 1000

    for body in (b"x" * 70_000, chunks()):
        r = c.post("/v1/users/big/memories", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert 'status="413"' in httpx.get(server.url + "/metrics").text


def test_deleted_tenant_is_final_in_every_process(engine, embedder, tmp_path):
    """The CLI (another process: here another store on the same database) deletes a tenant
    while the server's key cache holds its key: the next write fails at once and nothing
    recreates the tenant; nor does background work recreate a deleted user."""
    with _serve(engine, embedder, tmp_path) as s:
        store, keys, server = s.store, s.keys, s.server
        tid, key = keys["acme"]
        c = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert c.post("/v1/users/u/memories", json={"text": "before"}).status_code == 201
        assert c.get("/v1/users").status_code == 200  # the key is cached now
        other = MemoryStore(store.config, embedder=embedder)
        other.delete_tenant(tid)
        other.close()
        r = c.post("/v1/users/u/memories", json={"text": "after"})
        assert r.status_code == 401
        assert tid not in {t.id for t in store.list_tenants()}
        with pytest.raises(NotFound):
            store.ensure_tenant(tid)
        with pytest.raises(NotFound):
            store.add_memory(tid, "u", "resurrected?")
        g = keys["globex"][0]
        store.add_memory(g, "gone", "x")
        store.delete_user(g, "gone")
        with pytest.raises(NotFound):  # what reflection does after the user's deletion
            store.add_memory(g, "gone", "a reflected fact", create_user=False)
        with pytest.raises(NotFound):
            store.set_core_block(g, "gone", "human", "v", create_user=False)
        assert "gone" not in _users(store, keys, "globex")


def test_key_cache_is_bounded_and_failed_auth_is_limited(engine, embedder, tmp_path):
    cache = KeyCache(lambda h: None, max_entries=1000, ttl_s=60)
    for _ in range(100_000):
        assert cache.get(secrets.token_hex(32)) is None
    assert len(cache) == 1000
    with _serve(engine, embedder, tmp_path) as s:
        keys, server = s.keys, s.server
        anon = httpx.Client(base_url=server.url, timeout=30)
        codes = [anon.get("/v1/users", headers={"Authorization": f"Bearer am-{i}"}).status_code for i in range(32)]
        assert codes[:30] == [401] * 30 and codes[30:] == [429, 429]
        assert len(server._server.config.app.state.services.keys) <= 32
        good = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {keys['acme'][1]}"})
        assert good.get("/v1/users").status_code == 429  # the address, not the key, is limited
        r = httpx.get(server.url + f"/v1/users?api_key={keys['acme'][1]}",
                      headers={"Authorization": f"Bearer {keys['acme'][1]}"})
        assert r.status_code == 400  # refused before anything else


def test_api_key_in_the_url_is_refused(svc):
    server, keys, _ = svc
    r = httpx.get(server.url + f"/v1/users?api_key={keys['acme'][1]}",
                  headers={"Authorization": f"Bearer {keys['acme'][1]}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "key_in_url"


def test_postgresql_takes_what_the_api_allows(engine, embedder, pg_url, tmp_path):
    """On PostgreSQL (which enforces column sizes) a 128-character session id is stored and a
    33-character kind is a 4xx, through every write path."""
    with _serve(engine, embedder, tmp_path, db_url=pg_url) as s:
        store, keys, server = s.store, s.keys, s.server
        c = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {keys['acme'][1]}"}, timeout=60)
        sid = "s" * 128
        r = c.post("/v1/users/p/messages", json={"session_id": sid, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 201 and r.json()["session_id"] == sid
        assert c.get(f"/v1/users/p/sessions/{sid}/messages").json()["data"][0]["text"] == "hi"
        r = c.post("/v1/users/p/chat", json={})  # unknown route: JSON 404
        assert r.status_code == 404 and "error" in r.json()
        assert c.post("/v1/users/p/memories", json={"text": "x", "kind": "k" * 33}).status_code == 422
        r = c.post("/v1/users/q/import", json={"version": 1, "memories": [{"id": 1, "text": "x", "kind": "k" * 33}]})
        assert r.status_code == 400
        for t in EXTREME_TIMES:
            assert c.post("/v1/users/q/memories", json={"text": "x", "event_time": t}).status_code == 422
        assert "q" not in _users(store, keys)


def test_equal_client_ids_in_two_tenants_are_separate(svc):
    """A's `support-1` and B's `support-1` are two sessions; neither request learns of the
    other (no 404 "exists in another tenant")."""
    a, b = _client(svc), _client(svc, "globex")
    for c, words in ((a, "acme's words"), (b, "globex's words")):
        r = c.post("/v1/users/sam/messages", json={"session_id": "support-1",
                                                   "messages": [{"role": "user", "content": words}]})
        assert r.status_code == 201 and r.json()["session_id"] == "support-1"
    for c, words in ((a, "acme's words"), (b, "globex's words")):
        texts = [m["text"] for m in c.get("/v1/users/sam/sessions/support-1/messages").json()["data"]]
        assert texts == [words]
        assert [s["id"] for s in c.get("/v1/users/sam/sessions").json()["data"]] == ["support-1"]


def test_server_ids_are_never_reused_and_hide_counts(svc):
    _, keys, store = svc
    tid = keys["acme"][0]
    ids = [store.add_memory(tid, "ida", f"fact {i}").id for i in range(40)]
    assert ids == sorted(ids) and len(set(ids)) == 40 and max(ids) < 2**53
    assert {b - a for a, b in zip(ids, ids[1:], strict=False)} != {1}  # not a visible counter
    low = [i & 4095 for i in ids]
    assert sorted(low) != list(range(min(low), min(low) + 40))
    store.delete_memory(tid, "ida", ids[-1])
    again = store.add_memory(tid, "ida", "after the delete").id
    assert again > ids[-1]  # SQLite used to hand out the deleted row's id again


def _old_store(url: str) -> None:
    """A store at revision 0003 (global session ids, autoincrement row ids) with data in it."""
    from agentmem.tiers.archive import migrate

    engine = sa.create_engine(url)
    with engine.begin() as c:
        migrate(c, "0003")
        now = datetime(2026, 1, 1)
        c.execute(sa.text("insert into tenants (id, name, created_at) values ('t', 't', :n)"), {"n": now})
        c.execute(sa.text("insert into users (tenant_id, id, created_at) values ('t', 'u', :n)"), {"n": now})
        c.execute(sa.text("insert into sessions (id, tenant_id, user_id, agent_id, created_at) "
                          "values ('support-1', 't', 'u', 'default', :n)"), {"n": now})
        for text in ("first", "second"):
            c.execute(sa.text("insert into messages (tenant_id, user_id, session_id, role, text, created_at) "
                              "values ('t', 'u', 'support-1', 'user', :t, :n)"), {"t": text, "n": now})
        c.execute(sa.text("insert into memories (tenant_id, user_id, kind, text, importance, status, source_ids, "
                          "created_at, updated_at) values ('t', 'u', 'fact', 'old fact', 0.5, 'active', '[1]', :n, :n)"),
                  {"n": now})
    engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migration_keeps_data_and_old_ids(backend, tmp_path, embedder, request):
    from agentmem.config import Config

    url = request.getfixturevalue("pg_url") if backend == "postgresql" else f"sqlite:///{tmp_path / 'old.db'}"
    _old_store(url)
    store = MemoryStore(Config(data_dir=tmp_path, db_url=url), embedder=embedder)
    try:
        assert [m.text for m in store.session_messages("t", "u", "support-1")] == ["first", "second"]
        old = store.get_memory("t", "u", 1)
        assert old.text == "old fact" and old.source_ids == [1]
        store.add_messages("t", "u", "support-1", [{"role": "user", "content": "third"}])
        msgs = store.session_messages("t", "u", "support-1")
        assert [m.text for m in msgs] == ["first", "second", "third"] and msgs[-1].id > 2**40
        store.ensure_tenant("t2")
        assert store.open_session("t2", "u", "support-1").message_count == 0  # now per tenant
        new = store.add_memory("t", "u", "new fact")
        store.supersede("t", "u", 1, new.id)
        assert store.get_memory("t", "u", 1).superseded_by == new.id
    finally:
        store.close()


SECRET = "Quixotic-Zebra-7731 keeps the spare key under the blue flowerpot"


def test_forget_leaves_no_text_in_the_data_dir(engine, embedder, tmp_path):
    """Everything a user said, through every write path, then DELETE: no file under the
    data dir (database, WAL, recall index, chunk KV) holds any of it; files are private."""
    import stat

    with _serve(engine, embedder, tmp_path) as s:
        keys, server = s.keys, s.server
        c = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {keys['acme'][1]}"}, timeout=120)
        other = "Someone else entirely likes plain toast"
        assert c.post("/v1/users/keep/memories", json={"text": other}).status_code == 201
        assert c.post("/v1/users/vic/messages", json={"messages": [{"role": "user", "content": SECRET}]}).status_code \
            == 201
        assert c.post("/v1/users/vic/memories", json={"text": SECRET + " (memory)"}).status_code == 201
        assert c.put("/v1/users/vic/core/human", json={"value": SECRET}).status_code == 200
        assert c.put("/v1/users/vic/core/human", json={"value": "edited"}).status_code == 200
        r = c.post("/v1/chat/completions", json={"user": "vic", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": SECRET + "?"}]})
        assert r.status_code == 200
        assert c.post("/v1/users/vic/search", json={"query": "flowerpot"}).status_code == 200

        def found(needle: bytes) -> list[str]:
            return [str(p) for p in tmp_path.rglob("*") if p.is_file() and needle in p.read_bytes()]

        assert found(b"Quixotic-Zebra-7731") and found(b"plain toast")  # the scan can see text
        assert c.delete("/v1/users/vic").status_code == 200
        for needle in (b"Quixotic", b"quixot", b"flowerpot", b"Zebra-7731"):
            assert found(needle) == [], needle
        assert found(b"plain toast")  # the other user's words are still there
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700
    for name in ("agentmem.db", "agentmem.db-wal"):
        p = tmp_path / name
        assert not p.exists() or stat.S_IMODE(p.stat().st_mode) == 0o600


def test_operator_endpoints_need_the_operator_key(engine, embedder, tmp_path):
    with serve(engine, embedder, tmp_path, tenants=(), config={"operator_key": "op-secret"}) as s:
        server = s.server
        for path in ("/metrics", "/docs", "/openapi.json"):
            assert httpx.get(server.url + path).status_code == 404
            assert httpx.get(server.url + path, headers={"Authorization": "Bearer nope"}).status_code == 404
            assert httpx.get(server.url + path, headers={"Authorization": "Bearer op-secret"}).status_code == 200
        assert httpx.get(server.url + "/healthz").status_code == 200


def test_access_log_has_no_query_string_and_db_sync_full(tmp_path):
    import logging

    from agentmem.api.logs import NoQuery, log_config
    from agentmem.tiers.archive import Archive

    rec = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                            ("1.2.3.4:5", "GET", "/v1/users?api_key=am-secret", "1.1", 400), None)
    assert NoQuery().filter(rec) and "am-secret" not in rec.getMessage() and "/v1/users" in rec.getMessage()
    assert log_config()["handlers"]["access"]["filters"] == ["no_query"]
    a = Archive(f"sqlite:///{tmp_path / 'full.db'}", sync="full")
    with a.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert c.exec_driver_sql("PRAGMA secure_delete").scalar() == 1
    a.close()


def test_idempotency_key_makes_post_retries_safe(svc):
    _, keys, store = svc
    c = _client(svc)
    tid = keys["acme"][0]
    body = {"session_id": "idem", "messages": [{"role": "user", "content": "only once"}]}
    first = c.post("/v1/users/ivy/messages", json=body, headers={"Idempotency-Key": "k-1"})
    again = c.post("/v1/users/ivy/messages", json=body, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == again.status_code == 201 and first.content == again.content
    assert again.headers["idempotent-replayed"] == "true"
    assert len(store.session_messages(tid, "ivy", "idem")) == 1
    other = c.post("/v1/users/ivy/messages", json={**body, "session_id": "x"}, headers={"Idempotency-Key": "k-1"})
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    # the same key in another tenant is that tenant's own
    g = _client(svc, "globex").post("/v1/users/ivy/messages", json=body, headers={"Idempotency-Key": "k-1"})
    assert g.status_code == 201 and "idempotent-replayed" not in g.headers
    # a refused request frees its key: the corrected retry runs
    bad = c.post("/v1/users/ivy/memories", json={"text": ""}, headers={"Idempotency-Key": "k-2"})
    assert bad.status_code == 422
    ok = c.post("/v1/users/ivy/memories", json={"text": "fine now"}, headers={"Idempotency-Key": "k-2"})
    assert ok.status_code == 201
    doc = _doc(memories=[{"id": 1, "text": "imported once"}])
    for _ in range(2):
        assert c.post("/v1/users/ivy/import", json=doc, headers={"Idempotency-Key": "k-3"}).status_code == 201
    assert [m.text for m in store.list_memories(tid, "ivy")].count("imported once") == 1
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True, "user": "ivy"}
    streams = [c.post("/v1/chat/completions", json=chat, headers={"Idempotency-Key": "k-4"}) for _ in range(2)]
    assert streams[0].text == streams[1].text and "[DONE]" in streams[1].text
    assert streams[1].headers["content-type"].startswith("text/event-stream")
    assert c.delete("/v1/users/ivy").status_code == 200
    assert c.post("/v1/users/ivy/messages", json=body, headers={"Idempotency-Key": "k-1"}).headers.get(
        "idempotent-replayed") is None  # forgotten with the user


def test_a_plain_request_whose_client_left_stops_generating(engine, embedder, tmp_path, monkeypatch):
    # the loop detector would end a counting reply ("12345678901234567890...") after one
    # cycle, well within the client's patience; this test is about the cancel, not loops
    monkeypatch.setattr(EngineLoop, "_looped", lambda self, seq, tok: False)
    with _serve(engine, embedder, tmp_path, max_tokens=400) as s:
        keys, server = s.keys, s.server
        c = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {keys['acme'][1]}"}, timeout=1.5)
        # end-of-sequence banned (logit_bias), so the reply runs to its 400 tokens, far past the
        # client's 1.5 s on any machine (a quick model may otherwise answer in under a second)
        body = {"messages": [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}],
                "max_tokens": 400, "logit_bias": {str(t): -100 for t in engine.eos_ids}}
        try:
            r = c.post("/v1/chat/completions", json=body)
        except httpx.ReadTimeout:
            pass
        else:
            pytest.fail(f"answered within the client's 1.5 s: {r.status_code} {r.text[:400]}")

        def settled() -> bool:
            text = httpx.get(server.url + "/metrics").text
            return 'route="/v1/chat/completions",status="499"' in text and "agentmem_queue_length 0.0" in text

        deadline = time.monotonic() + 30  # generous for a loaded machine; without the cancel there is no 499 at all
        while time.monotonic() < deadline and not (settled() and not engine.loop.scheduler.has_work()):
            time.sleep(0.1)
        assert settled()  # ended as 499 (client gone), not as a 200 sent to nobody
        assert not engine.loop.scheduler.has_work()  # the sequence was cancelled, not left running
