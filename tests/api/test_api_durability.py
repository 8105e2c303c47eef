"""Durability: SIGKILL the server (a real `agentmem serve` subprocess) in the middle of a burst
of concurrent writes, restart it on the same data, and check that every acknowledged message
is there and the recall index agrees with the archive."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from agentmem.api.local import free_port
from agentmem.config import Config
from agentmem.tiers.store import MemoryStore

WRITERS = 4


def _serve(data_dir, port: int) -> subprocess.Popen:
    """The server's output goes to a file: a pipe nobody reads could fill and stall it."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", AGENTMEM_THREADS="1")
    log_path = data_dir / f"serve-{port}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "agentmem.cli", "serve", "--data-dir", str(data_dir),
                                 "--port", str(port), "--rate-limit", "0", "--reflect-every-turns", "0", "--no-ui", "--log-level", "warning"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log_path
    return proc


def _wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.log_path.read_text(errors="replace")[-2000:]
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not come up")


def _all(c: httpx.Client, path: str) -> list[dict]:
    """Every row of a listing, page by page."""
    rows, params = [], {"limit": 1000}
    while True:
        body = c.get(path, params=params).json()
        rows += body["data"]
        if not body.get("next_cursor"):
            return rows
        params["cursor"] = body["next_cursor"]


def test_sigkill_during_writes_loses_no_acknowledged_message(tmp_path, embedder):
    out = subprocess.run([sys.executable, "-m", "agentmem.cli", "tenant", "--data-dir", str(tmp_path), "--json",
                          "create", "durable"], capture_output=True, text=True, check=True)
    created = json.loads(out.stdout.strip().splitlines()[-1])
    tenant, headers = created["tenant_id"], {"Authorization": f"Bearer {created['api_key']}"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(tmp_path, port)
    acked: dict[str, list[tuple[int, str]]] = {f"w{i}": [] for i in range(WRITERS)}
    refused: list[str] = []
    try:
        _wait_up(url, proc)
        # load the embedder in the server before the burst, so the burst is all writes
        httpx.post(url + "/v1/users/w0/messages", headers=headers, timeout=60,
                   json={"messages": [{"role": "user", "content": "warm up"}]}).raise_for_status()
        acked["w0"].append((-1, "warm up"))

        def writer(user: str) -> None:
            with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
                for n in range(400):
                    text = f"{user} note {n}: the parcel code is {n * 7919 % 10007}"
                    try:
                        r = c.post(f"/v1/users/{user}/messages", json={"messages": [{"role": "user", "content": text}]})
                    except httpx.HTTPError:
                        return  # the server died under us: this write was never acknowledged
                    if r.status_code != 201:
                        refused.append(f"{r.status_code} {r.text}")
                        return
                    acked[user].append((r.json()["data"][0]["id"], text))

        threads = [threading.Thread(target=writer, args=(u,)) for u in acked]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(map(len, acked.values())) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        for t in threads:
            t.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not refused, refused[:3]
    total = sum(map(len, acked.values()))
    assert total >= 40

    proc = _serve(tmp_path, port)
    try:
        _wait_up(url, proc)
        c = httpx.Client(base_url=url, headers=headers, timeout=60)
        for user, writes in acked.items():
            stored = {}
            for s in _all(c, f"/v1/users/{user}/sessions"):
                for m in _all(c, f"/v1/users/{user}/sessions/{s['id']}/messages"):
                    stored[m["id"]] = m["text"]
            for mid, text in writes:
                assert text in stored.values() and (mid == -1 or stored[mid] == text)
    finally:
        proc.kill()
        proc.wait(timeout=10)

    # the recall index left on disk by the killed server is reconciled (rebuilt where stale)
    # and then holds exactly the archive's messages; the last acknowledged one is found
    store = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    for user, writes in acked.items():
        index = store.recall.sync(tenant, user)
        assert set(index.messages) == set(store.archive.message_ids(tenant, user))
        assert index.index.ntotal == sum(index.messages.values()) + len(index.memories)
        assert store.search(tenant, user, writes[-1][1], k=1)[0].text == writes[-1][1]
    store.close()
