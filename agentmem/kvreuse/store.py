"""The chunk KV store: memory tiers (GPU on CUDA, then RAM), each an LRU bounded in bytes,
spilling to a disk tier of one checksummed file per chunk.

An entry holds, per layer, K before RoPE and V of one chunk, so it can be placed at any
position. A read that finds a torn, truncated or corrupt file treats it as a miss and
deletes it: the cost of a bad file is one recomputation, never a crash or a wrong answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

_MAGIC = b"AMKV1\n"
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


@dataclass
class ChunkKV:
    """KV of one chunk: k (before RoPE) and v, each [layers, tokens, kv_heads, head_dim].

    `context` is the context hash (see identity.next_context) of the segments it was
    computed after, when it was computed exactly (full prefill after an exact prefix);
    None when it is an approximation, which is then never taken for an exact prefix."""

    k: torch.Tensor
    v: torch.Tensor
    context: str | None = None

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def tokens(self) -> int:
        return self.k.shape[1]

    def to(self, device: torch.device | str) -> ChunkKV:
        return ChunkKV(self.k.to(device), self.v.to(device), self.context)


class MemoryTier:
    """An LRU of entries on one device, bounded in bytes."""

    def __init__(self, device: torch.device | str, budget: int):
        self.device = torch.device(device)
        self.budget = budget
        self.entries: OrderedDict[str, tuple[str, ChunkKV]] = OrderedDict()  # key -> (namespace, kv)
        self.bytes = 0

    def get(self, key: str) -> ChunkKV | None:
        item = self.entries.get(key)
        if item is None:
            return None
        self.entries.move_to_end(key)
        return item[1]

    def put(self, key: str, namespace: str, kv: ChunkKV) -> list[tuple[str, str, ChunkKV]]:
        """Insert as most recent; return the entries evicted to stay within the budget."""
        self.remove(key)
        kv = kv.to(self.device)
        self.entries[key] = (namespace, kv)
        self.bytes += kv.nbytes
        out = []
        while self.bytes > self.budget:
            old, (ns, old_kv) = self.entries.popitem(last=False)
            self.bytes -= old_kv.nbytes
            out.append((old, ns, old_kv))
        return out

    def remove(self, key: str) -> bool:
        item = self.entries.pop(key, None)
        if item is None:
            return False
        self.bytes -= item[1].nbytes
        return True

    def drop_namespace(self, namespace: str) -> int:
        keys = [k for k, (ns, _) in self.entries.items() if ns == namespace]
        for k in keys:
            self.remove(k)
        return len(keys)


class DiskTier:
    """One file per chunk under <dir>/<namespace hash>/<key>.kv, written to a temporary file
    and renamed into place (a reader sees the old file, the new one, or none); each file
    carries a digest of its payload. LRU by last use, bounded in bytes."""

    def __init__(self, root: Path, budget: int):
        self.root = Path(root)
        self.budget = budget
        self.root.mkdir(parents=True, exist_ok=True)
        self.files: OrderedDict[str, tuple[Path, int]] = OrderedDict()  # key -> (path, size)
        self.bytes = 0
        found = []
        for p in self.root.glob("*/*"):
            if p.suffix == ".kv":
                st = p.stat()
                found.append((st.st_mtime, p, st.st_size))
            elif p.name.endswith(".tmp"):  # a write that never finished
                p.unlink(missing_ok=True)
        for _, p, size in sorted(found):
            self.files[p.stem] = (p, size)
            self.bytes += size

    @staticmethod
    def namespace_dir(namespace: str) -> str:
        return hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()

    def path(self, key: str, namespace: str) -> Path:
        return self.root / self.namespace_dir(namespace) / f"{key}.kv"

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def write(self, key: str, namespace: str, kv: ChunkKV) -> list[str]:
        """Store the entry; return the keys evicted to stay within the budget."""
        path = self.path(key, namespace)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(pack(key, namespace, kv))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.remove(key)
        size = path.stat().st_size
        self.files[key] = (path, size)
        self.bytes += size
        evicted = []
        while self.bytes > self.budget and len(self.files) > 1:
            old = next(iter(self.files))
            self.remove(old)
            evicted.append(old)
        return evicted

    def read(self, key: str) -> tuple[str, ChunkKV] | None:
        """(namespace, entry), or None when it is absent or its file is not intact (then
        removed)."""
        item = self.files.get(key)
        if item is None:
            return None
        path = item[0]
        try:
            kv = _parse(path.read_bytes(), key)
        except (OSError, ValueError, KeyError, RuntimeError, TypeError):
            kv = None
        if kv is None:
            self.remove(key)
            return None
        self.files.move_to_end(key)
        return kv

    def remove(self, key: str) -> bool:
        item = self.files.pop(key, None)
        if item is None:
            return False
        self.bytes -= item[1]
        item[0].unlink(missing_ok=True)
        return True

    def drop_namespace(self, namespace: str) -> int:
        d = self.root / self.namespace_dir(namespace)
        keys = [k for k, (p, _) in self.files.items() if p.parent == d]
        for k in keys:
            self.remove(k)
        shutil.rmtree(d, ignore_errors=True)
        return len(keys)


def pack(key: str, namespace: str, kv: ChunkKV) -> bytes:
    """An entry as bytes: magic, header (key, namespace, shapes, digest of the payload), payload."""
    k = kv.k.detach().contiguous().cpu()
    v = kv.v.detach().contiguous().cpu()
    payload = k.view(torch.uint8).numpy().tobytes() + v.view(torch.uint8).numpy().tobytes()
    header = json.dumps({
        "key": key, "namespace": namespace, "context": kv.context, "dtype": str(k.dtype),
        "k_shape": list(k.shape), "v_shape": list(v.shape), "payload": len(payload),
        "digest": hashlib.blake2b(payload, digest_size=16).hexdigest(),
    }).encode()
    return _MAGIC + len(header).to_bytes(4, "little") + header + payload


def unpack(data: bytes, key: str) -> tuple[str, ChunkKV] | None:
    """`pack`'s inverse: None when the bytes are not an intact entry for `key`."""
    try:
        return _parse(data, key)
    except (ValueError, KeyError, RuntimeError, TypeError):
        return None


def _parse(data: bytes, key: str) -> tuple[str, ChunkKV] | None:
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 4:
        return None
    n = int.from_bytes(data[len(_MAGIC) : len(_MAGIC) + 4], "little")
    start = len(_MAGIC) + 4 + n
    head = json.loads(data[len(_MAGIC) + 4 : start])
    payload = data[start:]
    if head["key"] != key or len(payload) != head["payload"] or head["dtype"] not in _DTYPES:
        return None
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != head["digest"]:
        return None
    dtype = _DTYPES[head["dtype"]]
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    nk = torch.Size(head["k_shape"]).numel() * flat.new_empty(0, dtype=dtype).element_size()
    k = flat[:nk].view(dtype).view(head["k_shape"])
    v = flat[nk:].view(dtype).view(head["v_shape"])
    return head["namespace"], ChunkKV(k, v, head["context"])


class ChunkStore:
    """Memory tiers in order (fastest first), then an optional disk tier. An entry lives in
    one memory tier at a time: a hit moves it to the first, an eviction moves it one tier
    down, and out of the last memory tier onto disk (or away, without a disk tier)."""

    def __init__(self, tiers: list[tuple[torch.device | str, int]], disk_dir: Path | None = None,
                 disk_bytes: int = 8 << 30, shared=None):
        if not tiers:
            raise ValueError("a ChunkStore needs at least one memory tier")
        self.tiers = [MemoryTier(d, b) for d, b in tiers]
        self.disk = DiskTier(disk_dir, disk_bytes) if disk_dir is not None else None
        # below disk: a tier other replicas share (shared_tier.SharedTier), written through
        self.shared = shared
        self.hits = self.misses = self.evictions = 0
        self._lock = threading.RLock()

    def get(self, key: str, count: bool = True) -> ChunkKV | None:
        """The entry (on the first tier's device) or None. `count=False` probes without
        touching the hit/miss counters."""
        with self._lock:
            kv = self._find(key)
            if count:
                self.record(kv is not None)
            return kv

    def record(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def _find(self, key: str) -> ChunkKV | None:
        first = self.tiers[0]
        kv = first.get(key)
        if kv is not None:
            return kv
        for tier in self.tiers[1:]:
            kv = tier.get(key)
            if kv is not None:
                namespace = tier.entries[key][0]
                tier.remove(key)
                self._insert(key, namespace, kv)
                return kv.to(first.device)
        found = self.disk.read(key) if self.disk is not None else None
        if found is None and self.shared is not None:
            found = self.shared.read(key)
        if found is not None:
            namespace, kv = found
            self._insert(key, namespace, kv)
            return kv.to(first.device)
        return None

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return any(key in t.entries for t in self.tiers) or (self.disk is not None and key in self.disk)

    def put(self, key: str, namespace: str, kv: ChunkKV) -> None:
        with self._lock:
            for tier in self.tiers[1:]:
                tier.remove(key)
            if self.disk is not None:
                self.disk.remove(key)  # a stale copy must not come back after an eviction
            self._insert(key, namespace, kv)
            if self.shared is not None:
                self.shared.write(key, namespace, kv)

    def _insert(self, key: str, namespace: str, kv: ChunkKV) -> None:
        """Put into the first tier that can hold it; evictions cascade down, onto disk last
        (an entry already on disk is not written again)."""
        moving = [(key, namespace, kv)]
        for tier in self.tiers:
            spilled = []
            for k, ns, item in moving:
                if item.nbytes > tier.budget:
                    spilled.append((k, ns, item))
                    continue
                evicted = tier.put(k, ns, item)
                self.evictions += len(evicted)
                spilled += evicted
            moving = spilled
            if not moving:
                return
        if self.disk is not None:
            for k, ns, item in moving:
                if k not in self.disk:
                    self.evictions += len(self.disk.write(k, ns, item))

    def drop_namespace(self, namespace: str) -> int:
        """Remove every entry of `namespace` from every tier; how many were removed."""
        with self._lock:
            n = sum(t.drop_namespace(namespace) for t in self.tiers)
            if self.disk is not None:
                n += self.disk.drop_namespace(namespace)
            if self.shared is not None:
                n += self.shared.drop_namespace(namespace)
            return n

    def stats(self) -> dict:
        with self._lock:
            looked = self.hits + self.misses
            out = {
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "ram_bytes": sum(t.bytes for t in self.tiers if t.device.type == "cpu"),
                "disk_bytes": self.disk.bytes if self.disk is not None else 0,
                "hit_ratio": self.hits / looked if looked else 0.0,
                "entries": sum(len(t.entries) for t in self.tiers),
            }
            if self.shared is not None:
                out |= self.shared.stats()
            gpu = sum(t.bytes for t in self.tiers if t.device.type != "cpu")
            if gpu:
                out["gpu_bytes"] = gpu
            return out
