"""Deleting a tenant while its requests run, against a real server: streamed and plain chats,
searches and adds of that tenant are in flight when `DELETE /v1/tenant` comes. Each of them
ends, in bounded time, with a success or a clear 4xx (a stream with an in-band error event
naming it), never a 500 or a hang; afterwards nothing of the tenant is left: no row in any
table, no recall index file, no chunk KV on disk, and its key is refused. Another tenant's
requests meanwhile all succeed."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import httpx
import pytest
from _serve import serve
from sqlalchemy import inspect, text

from agentmem.config import Config
from agentmem.kvreuse import get_reuse

CHAT = "/v1/chat/completions"
CLEAR = {200, 201, 401, 404, 409}  # 401: the key is gone; 404: the tenant or user is gone


@pytest.fixture(scope="module")
def blend_engine(tmp_path_factory):
    """Chunk reuse on (blend), so the tenant has chunk KV, in RAM and on disk, to lose."""
    pytest.importorskip("agentmem.kvreuse")
    from agentmem.engine import Engine

    data = tmp_path_factory.mktemp("tenant-delete")
    return Engine.load(Config(dtype="float32", device="cpu", kv_mode="blend", data_dir=data,
                              kv_disk_dir=data / "chunks", kv_ram_bytes=2 << 20))


def _stream(c: httpx.Client, body: dict) -> dict:
    """A streamed chat read to its end: its status, and the error event it ended with, if any."""
    with c.stream("POST", CHAT, json=body | {"stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "body": r.text}
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    last = json.loads(events[-1]) if events and events[-1] != "[DONE]" else {}
    return {"status": 200, "done": bool(events) and events[-1] == "[DONE]", "error": last.get("error"),
            "events": len(events)}


def test_delete_a_tenant_while_its_requests_run(blend_engine, embedder):
    tmp_path = blend_engine.config.data_dir
    with serve(blend_engine, embedder, tmp_path, tenants=("doomed", "bystander"), rate_per_minute=0,
               max_tokens=48) as s:
        tid = s.keys["doomed"][0]
        c = s.client("doomed", timeout=120)
        for uid in ("ann", "bob"):
            c.post(f"/v1/users/{uid}/memories", json={"text": f"{uid} keeps bees on the roof."}).raise_for_status()
            r = c.post(CHAT, json={"user": uid, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi!"}]})
            assert r.status_code == 200, r.text
            s.store.recall.flush(tid, uid)  # the index on disk now, not at its next periodic save
        recall_dir = s.store.recall.directory / hashlib.sha256(tid.encode()).hexdigest()[:24]
        assert get_reuse(blend_engine).store.flush()  # the chunk KV's disk writes are behind the requests
        assert recall_dir.exists() and any((tmp_path / "chunks").rglob("*.kv"))

        results: dict[str, list] = {}
        stop = threading.Event()
        long_turn = {"max_tokens": 48, "messages": [{"role": "user", "content": "Tell me a long story about bees."}]}

        def record(name: str, fn) -> None:
            out = results.setdefault(name, [])
            try:
                while True:
                    out.append(fn())
                    if name.startswith(("stream", "chat")) or stop.is_set() or out[-1]["status"] in (401, 404):
                        return  # a client told its tenant is gone stops asking
            except httpx.TimeoutException as exc:
                out.append({"status": "timeout", "error": repr(exc)})
            except httpx.HTTPError as exc:
                out.append({"status": "transport", "error": repr(exc)})

        def search(uid: str) -> dict:
            r = c.post(f"/v1/users/{uid}/search", json={"query": "bees", "k": 3})
            return {"status": r.status_code, "body": r.text}

        def add(uid: str) -> dict:
            r = c.post(f"/v1/users/{uid}/messages", json={"messages": [{"role": "user", "content": "more bees"}]})
            return {"status": r.status_code, "body": r.text}

        def bystander() -> dict:
            with s.client("bystander") as b:
                r = b.post("/v1/users/cat/memories", json={"text": "Cat sails."})
                return {"status": r.status_code, "body": r.text}

        jobs = {
            "stream-user": lambda: _stream(c, long_turn | {"user": "ann"}),
            "stream-stateless": lambda: _stream(c, long_turn),
            "chat-user": lambda: (lambda r: {"status": r.status_code, "body": r.text})(
                c.post(CHAT, json=long_turn | {"user": "bob"})),
            "search": lambda: search("ann"),
            "add": lambda: add("bob"),
            "memory": lambda: (lambda r: {"status": r.status_code, "body": r.text})(
                c.post("/v1/users/ann/memories", json={"text": "Ann also keeps wasps."})),
            "bystander": bystander,
        }
        threads = [threading.Thread(target=record, args=(name, fn)) for name, fn in jobs.items()]
        for t in threads:
            t.start()
        time.sleep(1.5)  # the streams have started, the loops have run
        d = s.client("doomed").delete("/v1/tenant")
        assert d.status_code == 200, d.text
        time.sleep(0.5)
        stop.set()
        t0 = time.monotonic()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a request hung after its tenant was deleted"
        assert time.monotonic() - t0 < 120

        for name, outs in results.items():
            assert outs, name
            for o in outs:
                assert o["status"] in CLEAR, (name, o)
                if name == "bystander":
                    assert o["status"] == 201, o
                if o.get("error"):  # a stream cut by the deletion says why, in OpenAI's error shape
                    e = o["error"]
                    assert e["code"] in ("not_found", "invalid_api_key", "tenant_deleted"), (name, e)
                    assert e["type"] != "api_error", (name, e)
                elif name.startswith("stream") and o["status"] == 200:
                    assert o["done"], (name, o)
        assert any(o["status"] in (401, 404) or o.get("error") for outs in results.values() for o in outs)

        # nothing of the tenant remains: rows, recall index files, chunk KV, the key
        assert s.client("doomed").get("/v1/users").status_code == 401
        assert tid not in {t.id for t in s.store.list_tenants()}
        with s.store.archive.engine.connect() as conn:
            for table in inspect(conn).get_table_names():
                cols = {col["name"] for col in inspect(conn).get_columns(table)}
                if "tenant_id" in cols:
                    n = conn.execute(text(f"SELECT count(*) FROM {table} WHERE tenant_id = :t"), {"t": tid}).scalar()
                    assert n == 0, f"{n} rows of the deleted tenant in {table}"
        assert not recall_dir.exists()

        assert get_reuse(blend_engine).drop_namespace(tid) == 0
        kv_files = [p for p in (tmp_path / "chunks").rglob("*") if tid in str(p)]
        assert kv_files == []
        assert s.client("bystander").get("/v1/users/cat/memories").json()["data"]
    # the server's shutdown saves every cached index: none of the deleted tenant's comes back
    assert not recall_dir.exists()
