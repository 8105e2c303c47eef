"""engine/threads.py: the caller's OpenMP pool is freed before it waits on the engine loop.

The pool check runs in a fresh interpreter: in the test session's own process other
threads (servers, embedders, engine loops of earlier tests) start and end at any moment,
so a count of the process's threads says nothing about one thread's pool there (CI saw
133 threads before and after a release that had worked)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from agentmem.engine.threads import release_omp_pool

_CHECK = textwrap.dedent("""
    import os, sys, time
    import torch
    from agentmem.engine.threads import _libgomp, release_omp_pool

    def threads():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    if _libgomp() is None:
        print("no-libgomp"); sys.exit(0)
    torch.nn.functional.silu(torch.randn(256, 4096))  # a parallel region: the pool exists
    before = threads()
    assert release_omp_pool()
    deadline = time.monotonic() + 10
    while threads() > before - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    after = threads()
    torch.nn.functional.silu(torch.randn(256, 4096))  # and a new pool serves the next region
    print(before, after, threads())
""")


def test_release_frees_the_calling_threads_workers():
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = out.stdout.split()
    if line == ["no-libgomp"]:
        import pytest

        pytest.skip("torch is not on GNU OpenMP here")
    before, after, again = map(int, line)
    assert after == before - 1  # 2 threads: the caller and one worker; the worker is gone
    assert again == before  # a parallel region afterwards makes a new pool


def test_release_is_safe_without_a_pool():
    release_omp_pool()
    assert release_omp_pool() in (True, False)  # twice in a row, nothing to free: no error



def test_the_embedder_releases_the_pool_of_the_thread_that_ran_the_model(monkeypatch):
    """An idle OpenMP pool left on a request thread or the bulk worker halved the engine
    loop's decode on 2 cores (58 -> 29 tok/s with two such threads): every embed call frees
    the pool of the thread its model ran on, after the model ran, on both lanes."""
    import threading

    import numpy as np

    from agentmem.engine import threads
    from agentmem.tiers.embed import QUICK_CHARS, Embedder

    events = []
    monkeypatch.setattr(threads, "release_omp_pool", lambda: events.append(("release", threading.get_native_id())))

    class Model:
        def get_sentence_embedding_dimension(self):
            return 4

        def encode(self, texts, **kw):
            events.append(("encode", threading.get_native_id()))
            return np.ones((len(texts), 4), dtype=np.float32)

    for nice in (0, 5):  # bulk on the caller's thread, then on the embedder's own worker
        emb = Embedder(Model(), bulk_threads=1, bulk_nice=nice)
        for texts in (["a query"], ["x" * (QUICK_CHARS + 1)]):
            events.clear()
            emb.embed(texts)
            assert [e[0] for e in events] == ["encode", "release"] and events[0][1] == events[1][1]


def test_module_calls_wait_out_a_torch_fx_trace_in_another_thread(embedder):
    """torch.compile traces with torch.fx, which patches nn.Module process-wide while it runs: a
    module called from another thread meanwhile fails. The embedder (like the engine's steps)
    takes TRACE_LOCK, which compiles hold, and so waits instead."""
    import time

    import torch.fx

    from agentmem.engine.threads import TRACE_LOCK

    tracing, done = threading.Event(), threading.Event()

    class Slow(torch.nn.Module):
        def forward(self, x):
            tracing.set()
            done.wait(10)  # the patch stays on while this runs
            return x + 1

    def trace(lock: bool) -> threading.Thread:
        def run():
            if lock:
                with TRACE_LOCK.exclusive():
                    torch.fx.symbolic_trace(Slow())
            else:
                torch.fx.symbolic_trace(Slow())
        tracing.clear()
        done.clear()
        t = threading.Thread(target=run)
        t.start()
        assert tracing.wait(10)
        return t

    t = trace(lock=False)  # the failure the lock prevents
    try:
        with pytest.raises(NameError, match="not installed as a submodule"):
            embedder.model.encode(["hello there"])
    finally:
        done.set()
        t.join()
    t = trace(lock=True)
    threading.Timer(0.3, done.set).start()
    t0 = time.perf_counter()
    vec = embedder.embed(["hello there"])  # waits for the trace, then runs
    t.join()
    assert time.perf_counter() - t0 >= 0.25 and vec.shape == (1, embedder.dim)


def test_the_trace_lock_lets_module_calls_run_together_and_a_compile_alone():
    import time

    from agentmem.engine.threads import TraceLock

    lock = TraceLock()
    inside, events = threading.Event(), []

    def reader(name: str, hold: float):
        with lock.shared():
            events.append(f"{name} in")
            inside.set()
            time.sleep(hold)
            events.append(f"{name} out")

    a = threading.Thread(target=reader, args=("a", 0.3))
    a.start()
    inside.wait(5)
    with lock.shared():  # a second holder does not wait for the first
        events.append("main in")
    assert events == ["a in", "main in"]
    with lock.exclusive():  # a compile waits for the holder in flight
        events.append("compile")
    a.join()
    assert events[-2:] == ["a out", "compile"]
    with lock.shared(), lock.shared(), lock.exclusive(), lock.shared():  # nested, and a foreground compile
        events.append("nested")
    assert events[-1] == "nested"


_PER_THREAD = textwrap.dedent("""
    import threading
    import torch
    from agentmem.engine.threads import _libgomp, omp_threads

    torch.set_num_threads(2)
    if _libgomp() is None:
        print("no-libgomp"); raise SystemExit(0)
    seen = {}
    inside, leave = threading.Event(), threading.Event()

    def query():
        with omp_threads(1):
            seen["inside"] = torch.get_num_threads()
            torch.nn.functional.silu(torch.randn(256, 4096))  # torch work on the one thread
            inside.set()
            leave.wait(10)
        seen["after"] = torch.get_num_threads()

    def fresh(name):  # a thread that runs torch for the first time now
        torch.nn.functional.silu(torch.randn(256, 4096))
        seen[name] = torch.get_num_threads()

    q = threading.Thread(target=query)
    q.start()
    inside.wait(10)
    t = threading.Thread(target=fresh, args=("fresh_during",)); t.start(); t.join()
    torch.nn.functional.silu(torch.randn(256, 4096))
    seen["main_during"] = torch.get_num_threads()
    leave.set(); q.join()
    t = threading.Thread(target=fresh, args=("fresh_after",)); t.start(); t.join()
    with omp_threads(None):
        seen["none"] = torch.get_num_threads()
    print(" ".join(f"{k}={v}" for k, v in sorted(seen.items())))
""")


def test_omp_threads_sets_the_calling_thread_only():
    """A query's one-thread forward must not leak: torch.set_num_threads stores a process-wide
    default that threads starting torch later copy; omp_threads changes this thread's OpenMP
    setting alone. Checked in a fresh interpreter, with threads that first touch torch while
    the setting is held and after it (with torch.set_num_threads(1) in its place, the same
    script reads 1 on the main thread and on the thread started meanwhile: torch 2.13)."""
    out = subprocess.run([sys.executable, "-c", _PER_THREAD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if out.stdout.split() == ["no-libgomp"]:
        pytest.skip("torch is not on GNU OpenMP here")
    seen = dict(kv.split("=") for kv in out.stdout.split())
    assert seen["inside"] == "1"
    assert seen["after"] == "2"  # restored on the thread that set it
    assert seen["fresh_during"] == seen["fresh_after"] == seen["main_during"] == seen["none"] == "2"


def test_the_embedders_query_runs_on_one_thread_and_bulk_on_its_count():
    import numpy as np
    import torch

    from agentmem.engine.threads import _libgomp
    from agentmem.tiers.embed import QUERY_THREADS, QUICK_CHARS, Embedder

    if _libgomp() is None:
        pytest.skip("torch is not on GNU OpenMP here")
    seen = []

    class Model:
        def get_sentence_embedding_dimension(self):
            return 4

        def encode(self, texts, **kw):
            seen.append(torch.get_num_threads())
            return np.ones((len(texts), 4), dtype=np.float32)

    before = torch.get_num_threads()
    emb = Embedder(Model(), bulk_threads=max(1, before - 1) if before > 1 else 2)
    emb.embed(["where did I park?"])
    emb.embed(["x" * (QUICK_CHARS + 1)])
    assert seen == [QUERY_THREADS, emb.bulk_threads]
    assert torch.get_num_threads() == before


_WHICH = textwrap.dedent("""
    import ctypes, os
    try:
        import sklearn.utils  # noqa: F401  (loads scikit-learn's own libgomp, as sentence-transformers does)
    except ImportError:
        pass
    import torch
    torch.set_num_threads(2)
    torch.nn.functional.silu(torch.randn(256, 4096))
    from agentmem.engine.threads import _libgomp, omp_threads
    copies = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line and "/" in line})
    lib = _libgomp()
    with omp_threads(1):
        inside = torch.get_num_threads()
    print(len(copies), lib is not None and lib._name.startswith(os.path.dirname(torch.__file__)), inside)
""")


def test_the_runtime_asked_is_torchs_when_another_libgomp_is_loaded_first():
    """scikit-learn (imported by sentence-transformers) bundles a libgomp of its own. Releasing
    pools or setting thread counts in that copy does nothing to torch's threads: one stream's
    decode read 47 tok/s against 179 after request threads had embedded queries (Xeon VM
    with AMX, 2026-11-27), because their idle pools were never released."""
    out = subprocess.run([sys.executable, "-c", _WHICH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    copies, torchs, inside = out.stdout.split()
    if copies == "0":
        pytest.skip("torch is not on GNU OpenMP here")
    assert torchs == "True" and inside == "1"
