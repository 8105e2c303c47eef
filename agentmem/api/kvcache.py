"""The service's two uses of the chunk-KV store (`agentmem.kvreuse`): drop a deleted
tenant's entries, and read the store's counters for /metrics. Both do nothing while that
package is absent, so the service runs without it."""

from __future__ import annotations


def drop_cached_kv(config, engine, namespace: str) -> int:
    """Remove every cached chunk of `namespace` (a tenant) from RAM and disk; how many.

    With no loaded engine (the admin command, or a server that has not chatted yet) the
    chunks of earlier runs may still be on disk, so the disk tier is opened on its own
    rather than loading the model just to delete."""
    try:
        from ..kvreuse import get_reuse, store_from_config
    except ImportError:
        return 0
    reuse = get_reuse(engine) if engine is not None else None
    if reuse is not None:
        return reuse.drop_namespace(namespace)
    import torch

    return store_from_config(config, torch.device("cpu")).drop_namespace(namespace)


def chunk_stats(engine) -> dict | None:
    """{hits, misses, evictions, ram_bytes, disk_bytes, hit_ratio, ...} of the engine's chunk
    store, or None when there is none (no engine yet, kvreuse absent or kv_mode "full")."""
    if engine is None:
        return None
    try:
        from ..kvreuse import get_reuse
    except ImportError:
        return None
    reuse = get_reuse(engine)
    return None if reuse is None else reuse.stats()
