"""Replicas on one database: each `MemoryStore` (with its own data directory, as a replica on
another machine has) stands for one `agentmem serve` process; the last test runs two real
ones on PostgreSQL and SIGKILLs one under concurrent clients."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
import sqlalchemy as sa

from agentmem.api import create_tenant_with_key
from agentmem.api.local import free_port
from agentmem.cluster.forget import ForgetBroadcast
from agentmem.config import Config
from agentmem.reflect import ReflectionScheduler
from agentmem.reflect.lease import Leases
from agentmem.session import AgentSession
from agentmem.tiers import MemoryStore
from agentmem.tiers.records import Conflict


def _replicas(tmp_path, url: str | None, embedder, n: int = 2) -> list[MemoryStore]:
    return [MemoryStore(Config(data_dir=tmp_path / f"r{i}", db_url=url, kv_mode="full"), embedder=embedder)
            for i in range(n)]


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'shared.db'}"
    return request.getfixturevalue("pg_url")


def test_core_block_edits_never_lose_an_update(db_url, tmp_path, embedder):
    a, b = _replicas(tmp_path, db_url, embedder)
    try:
        first = a.set_core_block("t", "u", "human", "Name: Ada", expected_version=0)
        assert first.version == 1
        with pytest.raises(Conflict):  # it exists now: "create only" is refused
            b.set_core_block("t", "u", "human", "Name: Bob", expected_version=0)
        seen = b.core_blocks("t", "u")[0]
        a.set_core_block("t", "u", "human", "Name: Ada\nCity: Porto", expected_version=seen.version)
        with pytest.raises(Conflict):  # b read version 1; a has replaced it since
            b.set_core_block("t", "u", "human", "Name: Ada\nDog: Rex", expected_version=seen.version)
        assert a.core_blocks("t", "u")[0].value == "Name: Ada\nCity: Porto"

        # read-modify-write from both replicas at once, retrying on conflict: every line lands
        def appender(store: MemoryStore, tag: str) -> None:
            for i in range(10):
                while True:
                    cur = next(blk for blk in store.core_blocks("t", "u") if blk.label == "human")
                    try:
                        store.set_core_block("t", "u", "human", f"{cur.value}\n{tag}{i}", expected_version=cur.version)
                        break
                    except Conflict:
                        continue

        threads = [threading.Thread(target=appender, args=(s, tag)) for s, tag in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lines = a.core_blocks("t", "u")[0].value.splitlines()
        assert sorted(ln for ln in lines if ln[:1] in "ab" and ln[1:].isdigit()) == sorted(
            f"{tag}{i}" for tag in "ab" for i in range(10))
        assert a.core_blocks("t", "u")[0].version == 22
    finally:
        a.close()
        b.close()


def test_reflection_lease_one_replica_at_a_time(pg_url, tmp_path, embedder):
    a, b = _replicas(tmp_path, pg_url, embedder)
    try:
        sid = a.open_session("t", "u").id
        a.add_messages("t", "u", sid, [{"role": "user", "content": c} for c in
                                        ("I live in Porto.", "I work as a cook.", "I like green tea.")])
        leases = [Leases(s.archive.engine) for s in (a, b)]
        with leases[0].hold("t", "u") as got:
            assert got
            with leases[1].hold("t", "u") as other:
                assert not other  # the other replica is refused while the lease is held
            with leases[1].hold("t", "someone-else") as unrelated:
                assert unrelated
        with leases[1].hold("t", "u") as again:
            assert again  # released at the end of the block

        reports: list = []
        scheds = [ReflectionScheduler(s, None, every_turns=1, use_model=False, on_report=reports.append)
                  for s in (a, b)]
        start = threading.Barrier(2)

        def run(s: ReflectionScheduler) -> None:
            start.wait()
            s.run_due()

        threads = [threading.Thread(target=run, args=(s,)) for s in scheds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(reports) == 1 and reports[0].user_id == "u"
        facts = [m.text for m in b.list_memories("t", "u")]
        assert len(facts) == len(set(facts)) and any("Porto" in f for f in facts)
    finally:
        a.close()
        b.close()


def test_turns_alternating_between_replicas(db_url, tmp_path, engine, embedder):
    """One conversation served by two replicas in turn: each sees the other's turns in its
    prompt and in recall at once; nothing lost or stored twice; a user deleted on one is
    gone from the other, in-memory session included."""
    a, b = _replicas(tmp_path, db_url, embedder)
    try:
        cfg = a.config.model_copy(update={"context_budget": 1024, "prompt_replies": True})  # every turn in the prompt
        sa_ = AgentSession("u", tenant_id="t", session_id="s1", config=cfg, engine=engine, store=a)
        sb = AgentSession("u", tenant_id="t", session_id="s1", config=cfg, engine=engine, store=b)
        said = [f"Note {i}: my locker code is {1000 + 37 * i}." for i in range(4)]
        for i, text in enumerate(said):
            (sa_ if i % 2 == 0 else sb).chat(text, max_tokens=2)
        msgs = a.session_messages("t", "u", "s1")
        assert [m.text for m in msgs if m.role == "user"] == said  # in order, once each
        assert len({m.id for m in msgs}) == len(msgs) and sum(m.role == "assistant" for m in msgs) <= len(said)
        ctx = sb.context("What is my locker code?")
        in_prompt = {s.ref for s in ctx.segments if s.tier == "turn"}
        assert {f"message:{m.id}" for m in msgs} <= in_prompt  # a's turns too, without a restart
        hit = b.search("t", "u", said[2], k=1)[0]  # written through a, found through b's own index
        assert hit.text == said[2]

        b.recall.flush("t", "u")  # the index is saved in batches and on close; save it now
        b_files = list(b.recall.directory.rglob("*.faiss"))
        assert b_files  # b holds the user's index on its own disk
        b_forgot: list = []
        if db_url.startswith("postgresql"):  # replicas hear of deletions (in-memory caches, disk)
            b.forget_hooks.append(lambda t, u: b_forgot.append((t, u)))
            listeners = [ForgetBroadcast(a).start(), ForgetBroadcast(b).start()]
        a.delete_user("t", "u")
        if db_url.startswith("postgresql"):
            deadline = time.monotonic() + 10
            while not b_forgot and time.monotonic() < deadline:
                time.sleep(0.05)
            assert b_forgot == [("t", "u")] and not any(p.exists() for p in b_files)
            for li in listeners:
                li.stop()
        assert b.search("t", "u", said[2]) == []
        ctx = sb.context("What is my locker code?")
        assert not [s for s in ctx.segments if s.tier in ("turn", "recall")]
        sb.chat("Hello again.", max_tokens=2)
        assert [m.text for m in a.session_messages("t", "u", "s1") if m.role == "user"] == ["Hello again."]
        assert set(b.recall.sync("t", "u").messages) == set(b.archive.message_ids("t", "u"))
    finally:
        a.close()
        b.close()


# --- two real `agentmem serve` processes ------------------------------------------------------
def _serve(data_dir, db_url: str, port: int):
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", AGENTMEM_THREADS="1",
               AGENTMEM_KV_MODE="full")
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / f"serve-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "agentmem.cli", "serve", "--data-dir", str(data_dir),
                                 "--db-url", db_url, "--port", str(port), "--rate-limit", "0", "--preload",
                                 "--reflect-every-turns", "0", "--no-ui", "--log-level", "warning"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log_path
    return proc


def _wait_up(url: str, proc, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.log_path.read_text(errors="replace")[-2000:]
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("replica did not come up")


@pytest.mark.slow  # a load test over two `agentmem serve` processes, one killed
def test_two_serve_replicas_sigkill_one_under_load(pg_url, tmp_path, embedder):
    store = MemoryStore(Config(data_dir=tmp_path / "admin", db_url=pg_url), embedder=embedder)
    tenant, key = create_tenant_with_key(store, "replicated")
    headers = {"Authorization": f"Bearer {key}"}
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [_serve(tmp_path / f"replica{i}", pg_url, p) for i, p in enumerate(ports)]
    acked: dict[str, list[str]] = {f"c{i}": [] for i in range(3)}
    errors: list[str] = []
    try:
        for url, proc in zip(urls, procs, strict=True):
            _wait_up(url, proc)
            # --preload: model and embedder loaded before the first request
            assert httpx.get(url + "/healthz", timeout=5).json() == {"status": "ok", "model_loaded": True,
                                                                      "embedder_loaded": True}
        # block edits through both replicas: the stale one gets a 409
        put = [httpx.put(f"{u}/v1/users/c0/core/human", headers=headers, timeout=30,
                         json={"value": f"from {i}", "version": 0}) for i, u in enumerate(urls)]
        assert sorted(r.status_code for r in put) == [200, 409], [r.text for r in put]
        assert put[1].json()["error"]["code"] == "version_conflict"

        def client(user: str) -> None:
            alive = list(urls)
            for n in range(40):
                text = f"{user} turn {n}: remember the number {n * 7919 % 10007}"
                for _ in range(len(urls)):
                    url = alive[n % len(alive)]
                    try:
                        r = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=60, json={
                            "model": "agentmem", "user": user, "max_tokens": 2,
                            "messages": [{"role": "user", "content": text}]})
                    except httpx.HTTPError:
                        alive.remove(url)  # the replica died: the load balancer would route elsewhere
                        if not alive:
                            return
                        continue
                    if r.status_code != 200:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                        return
                    acked[user].append(text)
                    break

        threads = [threading.Thread(target=client, args=(u,)) for u in acked]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while sum(map(len, acked.values())) < 15 and time.monotonic() < deadline:
            time.sleep(0.05)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=10)
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors[:3]
        assert all(len(v) == 40 for v in acked.values()), {k: len(v) for k, v in acked.items()}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for user, texts in acked.items():
        stored = [m.text for m in store.archive.messages(tenant, user) if m.role == "user"]
        # every acknowledged turn is there, once; a turn cut by the kill may be there unacknowledged
        assert all(stored.count(t) == 1 for t in texts), user
        assert [t for t in stored if t in texts] == texts
    with sa.create_engine(pg_url).connect() as c:
        assert c.execute(sa.text("select count(*) from core_blocks where user_id = 'c0' and label = 'human'")).scalar() == 1
    store.close()
