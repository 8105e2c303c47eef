"""The REST service through a real server on a loopback port, driven by the official openai
client and by httpx: chat (plain and streamed), memory endpoints, tenant isolation, limits,
metrics, and a short bounded load run."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
import types

import httpx
import pytest
from _serve import serve
from openai import OpenAI

from agentmem.api import create_tenant_with_key
from agentmem.config import Config
from agentmem.tiers.store import MemoryStore


@pytest.fixture(scope="module")
def api(engine, embedder, tmp_path_factory):
    # chunk KV of deleted tenants is dropped from the test's data dir, not the user's cache
    with serve(engine, embedder, tmp_path_factory.mktemp("api"), tenants=("acme", "globex"), ui=True,
               max_body_bytes=64_000, max_message_chars=4000, max_tokens=64, rate_per_minute=10_000) as s:
        yield s.url, s.keys, s.store


def client(api, tenant="acme") -> httpx.Client:
    url, keys, _ = api
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {keys[tenant][1]}"}, timeout=120)


def _shape(response: httpx.Response, ident) -> tuple[int, dict]:
    """The status and error body with the requested id blanked out: what must not differ
    between another tenant's id and a missing one."""
    err = dict(response.json()["error"])
    err["message"] = err["message"].replace(str(ident), "ID")
    return response.status_code, err


def test_openai_client_plain_and_streamed_agree(api):
    url, keys, _ = api
    oa = OpenAI(base_url=url + "/v1", api_key=keys["acme"][1])
    assert oa.models.list().data[0].id
    msgs = [{"role": "user", "content": "Name a colour."}]
    plain = oa.chat.completions.create(model="agentmem", messages=msgs, max_tokens=8, seed=11)
    text = plain.choices[0].message.content
    assert text and plain.usage.completion_tokens <= 8
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    assert plain.usage.prompt_tokens > 5
    chunks = list(oa.chat.completions.create(model="agentmem", messages=msgs, max_tokens=8, stream=True, seed=11,
                                             stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # the same seed: the stream carries exactly the same reply
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason


def test_memory_written_by_rest_is_recalled_in_chat_and_invisible_to_other_tenant(api):
    a, b = client(api, "acme"), client(api, "globex")
    fact = "The user's cat is named Marmalade."
    mem = a.post("/v1/users/alice/memories", json={"text": fact, "importance": 0.9})
    assert mem.status_code == 201
    mid = mem.json()["id"]
    r = a.post("/v1/chat/completions", json={"user": "alice", "max_tokens": 12,
                                             "messages": [{"role": "user", "content": "What is my cat's name?"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert f"memory:{mid}" in body["agentmem"]["memories_used"]
    trace = a.get("/v1/users/alice/turns").json()["data"][-1]["trace"]
    assert any(s["tier"] == "recall" and "Marmalade" in s["text"] for s in trace["segments"])
    assert {"tokens", "kv"} <= set(trace["segments"][0])

    # the other tenant: the same user id is a different, empty user; the id answers 404
    # with exactly the body a missing id gets inside acme
    missing = a.get(f"/v1/users/alice/memories/{mid + 10_000}")
    foreign = b.get(f"/v1/users/alice/memories/{mid}")
    assert foreign.status_code == missing.status_code == 404
    assert _shape(foreign, mid) == _shape(missing, mid + 10_000)
    assert foreign.json()["error"]["type"] == "not_found_error"
    assert b.get("/v1/users/alice/memories").status_code == 404
    assert _shape(b.get("/v1/users/nobody/memories"), "nobody") == _shape(b.get("/v1/users/alice/memories"), "alice")
    sid = body["session_id"]
    assert b.get(f"/v1/users/alice/sessions/{sid}/messages").status_code == 404
    r = b.post("/v1/chat/completions", json={"user": "alice", "max_tokens": 12, "session_id": sid,
                                             "messages": [{"role": "user", "content": "hi"}]})
    # session ids are per tenant and user: globex's `sid` is a session of its own, not an oracle
    assert r.status_code == 200 and r.json()["agentmem"]["memories_used"] == []
    assert [m["text"] for m in b.get(f"/v1/users/alice/sessions/{sid}/messages").json()["data"]][0] == "hi"
    r = b.post("/v1/chat/completions", json={"user": "alice", "max_tokens": 8,
                                             "messages": [{"role": "user", "content": "What is my cat's name?"}]})
    assert r.status_code == 200 and f"memory:{mid}" not in r.json()["agentmem"]["memories_used"]
    b_trace = b.get("/v1/users/alice/turns").json()["data"][-1]["trace"]
    assert not any("Marmalade" in s["text"] for s in b_trace["segments"])
    assert [u["id"] for u in b.get("/v1/users").json()["data"]] == ["alice"]


def test_memory_endpoints_roundtrip(api):
    a = client(api)
    a.post("/v1/users/carol/messages", json={"messages": [{"role": "user", "content": "I moved to Lisbon in May."},
                                                          {"role": "assistant", "content": "Noted!"}]})
    m = a.post("/v1/users/carol/memories", json={"text": "Carol lives in Lisbon."}).json()
    assert a.patch(f"/v1/users/carol/memories/{m['id']}", json={"text": "Carol lives in Porto."}).json()["text"] \
        == "Carol lives in Porto."
    hits = a.post("/v1/users/carol/search", json={"query": "Where does Carol live?", "k": 3}).json()["data"]
    assert hits[0]["text"] == "Carol lives in Porto."
    assert a.put("/v1/users/carol/core/human", json={"value": "Name: Carol"}).status_code == 200
    assert {"label": "human", "value": "Name: Carol"}.items() <= \
        next(b for b in a.get("/v1/users/carol/core").json()["data"] if b["label"] == "human").items()
    sessions = a.get("/v1/users/carol/sessions").json()["data"]
    msgs = a.get(f"/v1/users/carol/sessions/{sessions[0]['id']}/messages").json()["data"]
    assert [x["text"] for x in msgs] == ["I moved to Lisbon in May.", "Noted!"]
    ctx = a.post("/v1/users/carol/context", json={"query": "Where do I live?"}).json()
    assert any("Porto" in s["text"] for s in ctx["segments"]) and ctx["total_tokens"] > 0

    doc = a.get("/v1/users/carol/export").json()
    r = a.post("/v1/users/carol2/import", json=doc)
    assert r.status_code == 201
    assert r.json()["created"] == {"sessions": 1, "messages": 2, "memories": 1, "core_blocks": 1}
    copy = a.get("/v1/users/carol2/export").json()
    assert [x["text"] for x in copy["memories"]] == [x["text"] for x in doc["memories"]]
    assert a.post("/v1/users/carol2/import", json={"version": 99}).status_code == 400

    assert a.delete(f"/v1/users/carol/memories/{m['id']}").status_code == 200
    assert a.get(f"/v1/users/carol/memories/{m['id']}").status_code == 404
    assert a.delete("/v1/users/carol").status_code == 200
    assert a.get("/v1/users/carol/sessions").status_code == 404
    assert a.post("/v1/users/carol2/search", json={"query": "Porto"}).json()["data"]


def test_auth_limits_and_errors_are_clear_4xx(api):
    url, _, _ = api
    anon = httpx.Client(base_url=url, timeout=30)
    assert anon.get("/v1/models").status_code == 401
    bad = anon.get("/v1/models", headers={"Authorization": "Bearer am-nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    a = client(api)
    huge = a.post("/v1/users/dan/memories", json={"text": "x" * 70_000})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "body_too_large"
    long = a.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y " * 2500}]})
    assert long.status_code == 400 and long.json()["error"]["code"] == "message_too_long"
    many = a.post("/v1/chat/completions", json={"max_tokens": 65, "messages": [{"role": "user", "content": "hi"}]})
    assert many.status_code == 400 and many.json()["error"]["param"] == "max_tokens"
    invalid = a.post("/v1/chat/completions", json={"messages": []})
    assert invalid.status_code == 422 and invalid.json()["error"]["type"] == "invalid_request_error"
    nul = a.post("/v1/users/dan/memories", json={"text": "a\x00b"})
    assert nul.status_code == 400


def test_rate_limit_per_tenant(engine, embedder, tmp_path):
    with serve(engine, embedder, tmp_path, tenants=("one", "two"), rate_per_minute=3) as s:
        one = s.client("one")
        codes = [one.get("/v1/users").status_code for _ in range(5)]
        assert codes[:3] == [200] * 3 and codes[3:] == [429, 429]
        r = one.get("/v1/users")
        assert r.json()["error"]["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) >= 1
        two = s.client("two")
        assert two.get("/v1/users").status_code == 200  # another tenant's budget is its own


def test_metrics_health_docs_and_tenant_delete(api, embedder, engine):
    url, _, store = api
    anon = httpx.Client(base_url=url)
    assert anon.get("/healthz").json()["status"] == "ok"
    text = anon.get("/metrics").text
    for name in ("agentmem_requests_total", "agentmem_ttft_seconds_count", "agentmem_prompt_tokens_total",
                 "agentmem_cache_hit_ratio", "agentmem_queue_length"):
        assert name in text
    assert "/v1/chat/completions" in anon.get("/openapi.json").json()["paths"]
    assert anon.get("/docs").status_code == 200

    tid, key = create_tenant_with_key(store, "doomed")
    d = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"})
    d.post("/v1/users/eve/memories", json={"text": "Eve likes tea."})
    assert d.get("/v1/stats/cache").status_code == 200
    assert d.delete("/v1/tenant").json()["deleted"] is True
    assert tid not in [t.id for t in store.list_tenants()]
    assert store.list_memories(tid, "eve") == []
    assert d.get("/v1/users").status_code == 401


def test_bounded_concurrent_load_has_no_errors(api):
    """N clients (AGENTMEM_LOAD_CLIENTS, default 4) chat for a fixed time
    (AGENTMEM_LOAD_SECONDS, default 6; each client stops after 20 turns): every request must
    succeed. p50 / p99 are printed, not asserted."""
    from agentmem.bench.serve import percentile

    clients = int(os.environ.get("AGENTMEM_LOAD_CLIENTS", "4"))
    stop = time.monotonic() + float(os.environ.get("AGENTMEM_LOAD_SECONDS", "6"))
    latencies: list[float] = []
    errors: list[str] = []

    def worker(i: int) -> None:
        with client(api) as c:
            n = 0
            while time.monotonic() < stop and n < 20:
                t = time.perf_counter()
                try:
                    r = c.post("/v1/chat/completions", json={
                        "max_tokens": 6, "user": f"load{i}", "messages": [{"role": "user", "content": f"Count to {n}."}]})
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))
                    return
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t)
                else:
                    errors.append(f"{r.status_code} {r.text}")
                n += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert len(latencies) >= clients
    lat = sorted(latencies)
    print(f"\nload: {len(lat)} chats from {clients} clients, p50 {percentile(lat, 0.5):.2f} s, "
          f"p99 {percentile(lat, 0.99):.2f} s")


def _concurrent_chats(url: str, key: str, n: int, tag: str) -> list[dict]:
    out: list[dict] = [{}] * n
    start = threading.Barrier(n)

    def one(i: int) -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as c:
            start.wait()
            r = c.post("/v1/chat/completions", json={"max_tokens": 8, "user": f"{tag}{i}",
                                                     "messages": [{"role": "user", "content": f"Say {i}."}]})
            out[i] = {"status": r.status_code, "body": r.json()}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def test_concurrent_chats_share_engine_steps_unless_serial(engine, embedder, tmp_path):
    """Concurrent turns go through the engine's batching scheduler: 4 of them take fewer
    forward steps together than one after another (the `serial` server, the bench's peer)."""
    steps = {}
    for serial in (False, True):
        with serve(engine, embedder, tmp_path / str(serial), tenants=("steps",), serial=serial,
                   rate_per_minute=0) as s:
            key = s.keys["steps"][1]
            _concurrent_chats(s.url, key, 1, "warm")  # embedder and loop warm, user rows exist
            before = engine.loop.steps
            done = _concurrent_chats(s.url, key, 4, "u")
            steps[serial] = engine.loop.steps - before
        assert [d["status"] for d in done] == [200] * 4
        tokens = sum(d["body"]["usage"]["completion_tokens"] for d in done)
        if serial:  # one sequence per step: at least one decode step per generated token
            assert steps[True] >= tokens
    assert steps[False] < steps[True]


class _FakeReuse:
    def __init__(self):
        self.dropped: list[str] = []

    def drop_namespace(self, ns: str) -> int:
        self.dropped.append(ns)
        return 3

    def stats(self) -> dict:
        return {"hits": 7, "misses": 3, "evictions": 1, "ram_bytes": 4096, "disk_bytes": 0, "hit_ratio": 0.7}


def test_deletes_drop_cached_kv_and_metrics_show_chunk_cache(api, monkeypatch):
    """Against the kvreuse contract (get_reuse(engine).drop_namespace / .stats), with a fake
    store standing in for it."""
    url, _, store = api
    fake = _FakeReuse()
    mod = types.ModuleType("agentmem.kvreuse")
    mod.get_reuse = lambda engine: fake
    mod.store_from_config = None  # the loaded engine's store is used, never a fresh one
    monkeypatch.setitem(sys.modules, "agentmem.kvreuse", mod)
    tid, key = create_tenant_with_key(store, "kvdrop")
    c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    c.post("/v1/users/zed/memories", json={"text": "Zed rows a boat."}).raise_for_status()
    assert c.delete("/v1/users/zed").status_code == 200
    assert fake.dropped == [tid]
    text = httpx.get(url + "/metrics").text
    assert "agentmem_kv_chunk_hit_ratio 0.7" in text and "agentmem_kv_chunk_hits_total 7.0" in text
    assert c.delete("/v1/tenant").status_code == 200
    assert fake.dropped == [tid, tid]


def test_real_chunk_cache_is_dropped_with_its_tenant(embedder, tmp_path):
    """With chunk reuse on, a user's turns store chunk KV of the tenant (RAM, then disk);
    deleting the tenant leaves none of it, and /metrics reports the store."""
    pytest.importorskip("agentmem.kvreuse", reason="agentmem.kvreuse has not landed")
    from agentmem.engine import Engine
    from agentmem.kvreuse import get_reuse

    cfg = Config(dtype="float32", device="cpu", kv_mode="blend", data_dir=tmp_path, kv_disk_dir=tmp_path / "chunks",
                 kv_ram_bytes=2 << 20)  # a small RAM tier: chunks spill to disk too
    engine = Engine.load(cfg)
    reuse = get_reuse(engine)
    with serve(engine, embedder, tmp_path, tenants=("kvreal",), rate_per_minute=0) as s:
        tid = s.keys["kvreal"][0]
        c = s.client("kvreal")
        c.post("/v1/users/kim/memories", json={"text": "Kim grows tomatoes on her balcony."}).raise_for_status()
        for q in ("What do I grow?", "Where do I grow it?"):
            r = c.post("/v1/chat/completions", json={"user": "kim", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": q}]})
            assert r.status_code == 200, r.text
        assert r.json()["agentmem"]["reused_tokens"] > 0  # the second turn reused the first's chunks
        metrics = httpx.get(s.url + "/metrics").text
        assert "agentmem_kv_chunk_hit_ratio" in metrics and "agentmem_kv_chunk_ram_bytes" in metrics
        assert reuse.store.flush()  # the disk writes are behind the requests
        assert reuse.stats()["entries"] > 0 and any((tmp_path / "chunks").rglob("*.kv"))
        assert c.delete("/v1/tenant").status_code == 200
    assert reuse.drop_namespace(tid) == 0  # nothing of the tenant was left to drop
    assert reuse.stats()["entries"] == 0 and not any((tmp_path / "chunks").rglob("*.kv"))


def test_two_replicas_on_postgresql_share_tenants_and_memory(engine, embedder, pg_url, tmp_path):
    """Two servers, each with its own recall index directory, on one PostgreSQL: a key made
    on one works on the other, and memory written through either is recalled through the
    other (its index is rebuilt from the shared archive)."""
    with serve(engine, embedder, tmp_path / "a", db_url=pg_url, tenants=("pg",), rate_per_minute=0) as one, \
            serve(engine, embedder, tmp_path / "b", db_url=pg_url, tenants=(), rate_per_minute=0) as two:
        key = one.keys["pg"][1]
        a, b = (httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) for s in (one, two))
        first = a.post("/v1/users/pat/memories", json={"text": "Pat's bike is a red Bianchi."}).json()["id"]
        hits = b.post("/v1/users/pat/search", json={"query": "What bike does Pat ride?", "k": 1}).json()["data"]
        assert hits[0]["ref"] == f"memory:{first}"
        second = b.post("/v1/users/pat/memories", json={"text": "Pat's sister is called Dana."}).json()["id"]
        hits = a.post("/v1/users/pat/search", json={"query": "Who is Pat's sister?", "k": 1}).json()["data"]
        assert hits[0]["ref"] == f"memory:{second}"
        r = b.post("/v1/chat/completions", json={"user": "pat", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "What bike do I ride?"}]})
        assert r.status_code == 200 and f"memory:{first}" in r.json()["agentmem"]["memories_used"]
        sid = r.json()["session_id"]
        assert [m["role"] for m in a.get(f"/v1/users/pat/sessions/{sid}/messages").json()["data"]] == \
            ["user", "assistant"]


def test_bench_measure_reports_each_request(api):
    """The bench's client loop against the live server (the full `agentmem bench serve` runs
    two server processes and is run by hand)."""
    from agentmem.bench.serve import main, measure, percentile

    url, keys, _ = api
    r = measure(url, keys["acme"][1], clients=2, requests=2, max_tokens=2, prefix="bench")
    assert (r["clients"], r["requests"], r["errors"]) == (2, 4, 0)
    assert 0 < r["p50_s"] <= r["p99_s"] <= r["wall_s"] and r["throughput_req_s"] > 0
    assert 0 <= r["loadgen_cpu_share"] < 1  # the async clients cost a fraction of a core
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0
    assert main(["--levels", "0"]) == 2


def test_tenant_admin_command(tmp_path, capsys, monkeypatch):
    """`agentmem tenant create | key | list | delete`: keys are printed once and stored only
    as their hash; deleting a tenant stops its keys and removes its chunk KV from disk even
    though no model is loaded."""
    import json

    monkeypatch.setenv("AGENTMEM_KV_DISK_DIR", str(tmp_path / "chunks"))

    from agentmem.api.admin import main
    from agentmem.api.auth import hash_key

    def run(*argv: str) -> tuple[int, dict]:
        rc = main(["--data-dir", str(tmp_path), "--json", *argv])
        out = capsys.readouterr().out.strip()
        return rc, json.loads(out) if out else {}

    rc, made = run("create", "acme")
    assert rc == 0 and made["api_key"].startswith("am-")
    rc, extra = run("key", made["tenant_id"], "--name", "ci")
    assert rc == 0 and extra["api_key"] != made["api_key"]
    assert [t["id"] for t in run("list")[1]["tenants"]] == [made["tenant_id"]]
    store = MemoryStore(Config(data_dir=tmp_path))
    assert {store.tenant_for_key_hash(hash_key(k)) for k in (made["api_key"], extra["api_key"])} == {made["tenant_id"]}
    db = (tmp_path / "agentmem.db").read_bytes()
    assert made["api_key"].encode() not in db and hash_key(made["api_key"]).encode() in db
    chunk = None
    if importlib.util.find_spec("agentmem.kvreuse") is not None:
        from agentmem.kvreuse.store import DiskTier

        chunk = tmp_path / "chunks" / DiskTier.namespace_dir(made["tenant_id"]) / "0123abcd.kv"
        chunk.parent.mkdir(parents=True)
        chunk.write_bytes(b"left by an earlier run")
    assert run("delete", made["tenant_id"])[0] == 0
    assert store.tenant_for_key_hash(hash_key(made["api_key"])) is None
    assert chunk is None or not chunk.exists()
    store.close()
    assert run("delete", made["tenant_id"])[0] == 1  # unknown tenant: an error, not a crash


def test_bench_replicas_accounts_where_the_cpu_went():
    """`bench serve --replicas`: CPU read from /proc, and rounds merged by wall time."""
    import os

    from agentmem.bench.serve_replicas import allowed_cpus, cpu_seconds, machine_seconds, merge

    t = cpu_seconds(os.getpid())
    # /proc counts in clock ticks (10 ms): on a fast CPU one loop can end inside the same tick,
    # so burn CPU until the reading moves (bounded: a reading that never moves still fails)
    deadline = time.monotonic() + 5
    while cpu_seconds(os.getpid()) <= t and time.monotonic() < deadline:
        sum(i * i for i in range(300_000))
    assert cpu_seconds(os.getpid()) > t > 0
    busy, stolen = machine_seconds()
    assert busy > 0 and stolen >= 0 and allowed_cpus(os.getpid()) != "?"
    rounds = [{"clients": 4, "requests": 8, "errors": 0, "wall_s": 2.0, "tokens_s": 8.0, "latencies_s": [1.0] * 8,
               "replica_cpu_share": [0.9, 0.7], "loadgen_cpu_share": 0.01, "postgres_cpu_share": 0.1,
               "machine_busy_cores": 1.8, "stolen_cores": 0.0, "other_cores": 0.1, "replica_cpu_s_per_request": 0.4,
               "error_samples": []},
              {"clients": 4, "requests": 8, "errors": 1, "wall_s": 6.0, "tokens_s": 4.0, "latencies_s": [3.0] * 7,
               "replica_cpu_share": [0.5, 0.3], "loadgen_cpu_share": 0.03, "postgres_cpu_share": 0.1,
               "machine_busy_cores": 2.0, "stolen_cores": 0.2, "other_cores": 0.9, "replica_cpu_s_per_request": 0.6,
               "error_samples": ["503"]}]
    m = merge(rounds)
    assert (m["requests"], m["errors"], m["rounds"]) == (16, 1, 2)
    assert m["throughput_req_s"] == round(15 / 8.0, 4) and m["p50_s"] == 1.0 and m["p99_s"] == 3.0
    assert m["replica_cpu_share"] == [0.6, 0.4] and m["loadgen_cpu_share"] == 0.025
    assert m["replica_cpu_s_per_request"] == round((0.4 * 8 + 0.6 * 7) / 15, 4)
