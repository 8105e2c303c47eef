"""The engine's fair share between tenants, against a real server: while one tenant's 8
long streams fill every slot of the batch, another tenant's short requests are admitted in
the step they arrive (a slot is taken back from the tenant over its share) and each runs in
as many steps as it would alone. Counted in scheduler steps, not seconds, so a loaded
machine cannot make it flake; `agentmem bench serve --fair` measures the latency ratio."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
from _serve import serve

from agentmem.engine.loop import EngineLoop
from agentmem.engine.scheduler import Scheduler

STREAMS = 8
SHORT_TOKENS = 4


def test_a_short_request_is_served_at_once_beside_a_tenant_holding_every_slot(engine, embedder, tmp_path,
                                                                              monkeypatch):
    # a batch of 8 that one tenant may fill entirely: before the fair scheduler, the short
    # tenant's request waited here until one of the long streams ended
    loop = EngineLoop(engine, max_batch=STREAMS)
    sched = loop.scheduler = Scheduler(loop.blocks, STREAMS, engine.config.prefill_chunk, tenant_cap=STREAMS)
    monkeypatch.setattr(engine, "_loop", loop)
    steps: list[tuple[Counter, Counter, Counter]] = []  # per step: running, scheduled, waiting per tenant
    real = sched.schedule

    def schedule():
        batch = real()
        steps.append((Counter(s.salt for s in sched.running), Counter(sc.seq.salt for sc in batch),
                      Counter(s.salt for s in sched.waiting)))
        return batch

    monkeypatch.setattr(sched, "schedule", schedule)
    no_eos = {str(t): -100 for t in engine.eos_ids}  # the long streams run to their max_tokens
    stop = threading.Event()
    errors: list[str] = []
    try:
        with serve(engine, embedder, tmp_path, tenants=("long", "short"), max_tokens=512, rate_per_minute=0) as s:
            long_id, short_id = s.keys["long"][0], s.keys["short"][0]

            def stream(i: int) -> None:
                body = {"max_tokens": 500, "stream": True, "temperature": 1.0, "logit_bias": no_eos,
                        "messages": [{"role": "user", "content": f"Write a long story, part {i}."}]}
                with s.client("long", timeout=300) as c:
                    try:
                        with c.stream("POST", "/v1/chat/completions", json=body) as r:
                            if r.status_code != 200:
                                errors.append(r.read().decode())
                                return
                            for _ in r.iter_lines():
                                if stop.is_set():
                                    return
                    except httpx.HTTPError as exc:
                        if not stop.is_set():
                            errors.append(repr(exc))

            threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(STREAMS)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 240
            while not (steps and steps[-1][0][long_id] == STREAMS and steps[-1][1][long_id] == STREAMS):
                assert time.monotonic() < deadline and not errors, errors
                time.sleep(0.05)
            first = len(steps)  # every slot is the long tenant's, each decoding
            with s.client("short") as c:
                for i in range(3):
                    r = c.post("/v1/chat/completions", json={
                        "max_tokens": SHORT_TOKENS, "temperature": 0, "logit_bias": no_eos,
                        "messages": [{"role": "user", "content": f"Say hello, {i}."}]})
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["completion_tokens"] == SHORT_TOKENS
            during = steps[first:]
            stop.set()
            for t in threads:  # each leaves at its next token; the server cancels its stream
                t.join(120)
    finally:
        stop.set()
        loop.close()
    assert not errors, errors
    # never left waiting: admitted in the step each request arrived, a long stream preempted for it
    assert not any(waiting[short_id] for _, _, waiting in during), during
    assert sched.preemptions >= 1
    # each ran in as many steps as alone (its prompt in one chunk, then a token a step), while
    # the long streams went on decoding beside it, all but the one that gave up its slot
    ran = [step for step in during if step[1][short_id]]
    assert len(ran) <= 3 * (SHORT_TOKENS + 1), len(ran)
    assert all(running[long_id] >= STREAMS - 1 and running[short_id] <= 1 for running, _, _ in ran), ran
