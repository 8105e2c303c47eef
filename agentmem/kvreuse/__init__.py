"""Chunk KV reuse: the chunk store, prefix reuse and the CacheBlend fuser.

`enable_chunk_reuse(engine)` installs it as the engine's prefill planner (Engine.load does
so unless kv_mode is "full"); `get_reuse(engine)` returns it for precompute, namespace
deletion and stats.
"""

from .fuser import MODES, Fused, Piece, fuse, place_k
from .identity import chunk_key, next_context
from .reuse import ChunkReuse, enable_chunk_reuse, get_reuse, store_from_config
from .store import ChunkKV, ChunkStore

__all__ = [
    "MODES",
    "ChunkKV",
    "ChunkReuse",
    "ChunkStore",
    "Fused",
    "Piece",
    "chunk_key",
    "enable_chunk_reuse",
    "fuse",
    "get_reuse",
    "next_context",
    "place_k",
    "store_from_config",
]
