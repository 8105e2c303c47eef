"""Chunk identity: which cached KV belongs to which tokens.

A chunk is named by a hash of the model, its dtype, the namespace (the tenant) and its token
ids: the same text under another model, precision or tenant is another chunk, so entries are
never shared across them. A context hash chains the ids of every segment before a position,
so an entry computed right after exactly the same segments can be recognised as an exact
prefix and used as is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

ROOT_CONTEXT = "root"  # the context of the first segment of a prompt


def _ids_bytes(ids: Sequence[int]) -> bytes:
    return torch.tensor(list(ids), dtype=torch.int32).numpy().tobytes()


def chunk_key(model_id: str, dtype: torch.dtype | str, ids: Sequence[int], namespace: str = "") -> str:
    h = hashlib.blake2b(digest_size=20, person=b"agentmem-chunk")
    for field in (model_id, str(dtype), namespace):
        h.update(field.encode() + b"\x00")
    h.update(_ids_bytes(ids))
    return h.hexdigest()


def next_context(context: str, ids: Sequence[int]) -> str:
    """The context after a segment with `ids` follows `context`."""
    h = hashlib.blake2b(digest_size=20, person=b"agentmem-ctx")
    h.update(context.encode() + b"\x00")
    h.update(len(ids).to_bytes(4, "little"))
    h.update(_ids_bytes(ids))
    return h.hexdigest()
