"""engine/threads.py: the caller's OpenMP pool is freed before it waits on the engine loop.

The pool check runs in a fresh interpreter: in the test session's own process other
threads (servers, embedders, engine loops of earlier tests) start and end at any moment,
so a count of the process's threads says nothing about one thread's pool there (CI saw
133 threads before and after a release that had worked)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
