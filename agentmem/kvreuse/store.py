"""The chunk KV store: memory tiers (GPU on CUDA, then RAM), then a disk tier of one
checksummed file per chunk, then optionally a Redis tier shared by replicas.

An entry holds, per layer, K before RoPE and V of one chunk, so it can be placed at any
position. Every tier is bounded in bytes and keeps what its `policy` (policy.py) values most
per byte: by default value per byte (expected reuse x prefill seconds saved / bytes), with
`LRUPolicy` as the baseline. Disk and Redis hold entries encoded by the store's codec
(codec.py: raw, int8 or int4), and so does RAM with `ram_codec`, which fits ~3x more chunks
into the same memory at the cost of a decode on every hit.

A read that finds a torn, truncated or corrupt blob treats it as a miss and deletes it: the
cost of a bad file is one recomputation, never a crash or a wrong answer. A read from disk or
Redis happens only where its measured cost is below the prefill it saves (`Rates`).

Write-behind (`write_behind`, on in a configured store): an entry pushed out of the last
memory tier waits in memory for its disk write, which a background thread does (encode,
fsync, then the rename and the eviction of what it pushes out), so no request waits on an
encode or a disk. A lookup finds a waiting entry as a memory hit and takes it back; a newer
`put` or a dropped namespace cancels its write (`drop_namespace` waits for a write of that
namespace under way, so nothing of it is on disk once it returns). With more than
`max_pending` waiting, the write is done at once, on the caller's thread.

Pins: a turn that ends in a tool call keeps its chunks in memory for a while (`pin`), since
the call's continuation sends them again. Pinned entries are not evicted for unpinned ones;
only other pinned entries may push them out (memory pressure), and the store remembers which
pins it broke, so that the continuation's trace says so.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import math
import os
import shutil
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from .codec import check_codec, codec_of, decode, encode
from .entry import ChunkKV
from .policy import LRUPolicy, victims

__all__ = ["ChunkKV", "ChunkStore", "DiskTier", "MemoryTier", "pack", "unpack"]

log = logging.getLogger(__name__)
EXIT_FLUSH_S = 10.0  # at exit, how long the stores' waiting disk writes are given, in all
_writing_stores: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """A process that exits normally writes what waits for the disk first (bounded: it is a
    cache; what is left is recomputed later, and a torn temporary file is removed at start)."""
    deadline = time.monotonic() + EXIT_FLUSH_S
    for store in list(_writing_stores):
        store.flush(max(0.0, deadline - time.monotonic()))


def pack(key: str, namespace: str, kv: ChunkKV, codec: str = "raw") -> bytes:
    """An entry as bytes (codec.encode)."""
    return encode(key, namespace, kv, codec)


def unpack(data: bytes, key: str) -> tuple[str, ChunkKV] | None:
    """`pack`'s inverse: None when the bytes are not an intact entry for `key`."""
    return decode(data, key)


@dataclass
class _Held:
    namespace: str
    kv: ChunkKV | None  # decoded, or None when held as `blob`
    blob: bytes | None
    nbytes: int
    tokens: int


class MemoryTier:
    """Entries on one device, bounded in bytes; raw tensors, or blobs of `codec` (CPU only)."""

    def __init__(self, device: torch.device | str, budget: int, codec: str = "raw"):
        self.device = torch.device(device)
        self.budget = budget
        self.codec = codec if self.device.type == "cpu" else "raw"
        self.entries: OrderedDict[str, _Held] = OrderedDict()
        self.bytes = 0
        self.name = "ram" if self.device.type == "cpu" else self.device.type

    def hold(self, key: str, namespace: str, kv: ChunkKV) -> _Held:
        if self.codec != "raw":
            blob = encode(key, namespace, kv, self.codec, entropy=False)
            return _Held(namespace, None, blob, len(blob), kv.tokens)
        kv = kv.to(self.device)
        return _Held(namespace, kv, None, kv.nbytes, kv.tokens)

    def get(self, key: str) -> ChunkKV | None:
        held = self.entries.get(key)
        if held is None:
            return None
        self.entries.move_to_end(key)
        if held.kv is not None:
            return held.kv
        found = decode(held.blob, key)
        if found is None:  # cannot happen short of memory corruption; a miss all the same
            self.remove(key)
            return None
        return found[1]

    def namespace(self, key: str) -> str:
        return self.entries[key].namespace

    def insert(self, key: str, held: _Held) -> None:
        self.remove(key)
        self.entries[key] = held
        self.bytes += held.nbytes

    def remove(self, key: str) -> _Held | None:
        held = self.entries.pop(key, None)
        if held is not None:
            self.bytes -= held.nbytes
        return held

    def drop_namespace(self, namespace: str) -> int:
        keys = [k for k, h in self.entries.items() if h.namespace == namespace]
        for k in keys:
            self.remove(k)
        return len(keys)


class DiskTier:
    """One file per chunk under <dir>/<namespace hash>/<key>.kv, written to a temporary file
    and renamed into place (a reader sees the old file, the new one, or none); each file
    carries a digest of its payload. Bounded in bytes."""

    def __init__(self, root: Path, budget: int, codec: str = "raw"):
        self.root = Path(root)
        self.budget = budget
        self.codec = codec
        self.root.mkdir(parents=True, exist_ok=True)
        self.files: OrderedDict[str, tuple[Path, int]] = OrderedDict()  # key -> (path, size)
        self.bytes = 0
        self.found: list[tuple[str, float]] = []  # (key, mtime) of files already there at start
        found = []
        for p in self.root.glob("*/*"):
            if p.suffix == ".kv":
                st = p.stat()
                found.append((st.st_mtime, p, st.st_size))
            elif p.name.endswith(".tmp"):  # a write that never finished
                p.unlink(missing_ok=True)
        for mtime, p, size in sorted(found):
            self.files[p.stem] = (p, size)
            self.bytes += size
            self.found.append((p.stem, mtime))

    @staticmethod
    def namespace_dir(namespace: str) -> str:
        return hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()

    def path(self, key: str, namespace: str) -> Path:
        return self.root / self.namespace_dir(namespace) / f"{key}.kv"

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def size(self, key: str) -> int:
        return self.files[key][1]

    def write_blob(self, key: str, namespace: str, blob: bytes) -> None:
        self.install(key, namespace, self.write_tmp(key, namespace, blob), len(blob))

    def write_tmp(self, key: str, namespace: str, blob: bytes) -> Path:
        """`blob` in a temporary file beside its place, fsynced; `install` renames it in."""
        path = self.path(key, namespace)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def install(self, key: str, namespace: str, tmp: Path, size: int) -> None:
        self.remove(key)
        path = self.path(key, namespace)
        os.replace(tmp, path)
        self.files[key] = (path, size)
        self.bytes += size

    def discard_tmp(self, tmp: Path) -> None:
        """A cancelled write's file, and its folder if nothing else is left in it."""
        tmp.unlink(missing_ok=True)
        try:
            tmp.parent.rmdir()
        except OSError:
            pass

    def read(self, key: str) -> tuple[str, ChunkKV] | None:
        """(namespace, entry), or None when it is absent or its file is not intact (then
        removed)."""
        item = self.files.get(key)
        if item is None:
            return None
        try:
            found = decode(item[0].read_bytes(), key)
        except OSError:
            found = None
        if found is None:
            self.remove(key)
            return None
        self.files.move_to_end(key)
        return found

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


class ChunkStore:
    """Memory tiers in order (fastest first), then an optional disk tier, then an optional
    shared (Redis) tier. An entry lives in one memory tier at a time: a hit moves it to the
    first (where that tier admits it), an eviction moves it one tier down, and out of the last
    memory tier onto disk (or away, without a disk tier). Redis is written through."""

    def __init__(self, tiers: list[tuple[torch.device | str, int]], disk_dir: Path | None = None,
                 disk_bytes: int = 8 << 30, shared=None, policy: LRUPolicy | None = None,
                 codec: str = "raw", ram_codec: bool = False, choose_loads: bool = True,
                 write_behind: bool = False, max_pending: int = 64):
        if not tiers:
            raise ValueError("a ChunkStore needs at least one memory tier")
        check_codec(codec)
        self.codec = codec
        self.tiers = [MemoryTier(d, b, codec if ram_codec else "raw") for d, b in tiers]
        self.disk = DiskTier(disk_dir, disk_bytes, codec) if disk_dir is not None else None
        self.policy = policy if policy is not None else LRUPolicy()
        self.rates = self.policy.rates
        if self.disk is not None:
            for key, mtime in self.disk.found:
                self.policy.seen.setdefault(key, _restored(mtime))
        # below disk: a tier other replicas share (shared_tier.SharedTier), written through
        self.shared = shared
        if shared is not None:
            shared.attach(self.policy, codec)
        self.pins: dict[str, float] = {}  # key -> pinned until (policy clock)
        self.pins_broken: OrderedDict[str, float] = OrderedDict()  # key -> when pressure evicted it while pinned
        self.hits = self.misses = self.evictions = self.rejected = 0
        self.hit_tokens = self.looked_tokens = 0
        self.read_bytes = {"disk": 0, "redis": 0}
        self.recompute_chosen = 0
        self.choose_loads = choose_loads  # False: always load what a tier has (the baseline)
        self.bytes_per_token: float | None = None  # of blobs in this codec, for Redis's choice
        self._lock = threading.RLock()
        # write-behind: key -> (namespace, entry, ticket) waiting for the disk, oldest first
        self.write_behind = write_behind and self.disk is not None
        self.max_pending = max_pending
        self._pending: OrderedDict[str, tuple[str, ChunkKV | _Held, int]] = OrderedDict()
        self._tickets = 0
        self._writing: str | None = None  # the namespace of the write under way
        self._changed = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self.disk_write_s = 0.0  # encoding and writing to disk, on whichever thread

    # --- lookups ---------------------------------------------------------------------------
    def get(self, key: str, count: bool = True, tokens: int | None = None, kind: str = "",
            user: str | None = None) -> ChunkKV | None:
        """The entry (on the first tier's device) or None. `count=False` probes without
        touching the counters or the policy; `tokens` (the chunk's length, known from its
        ids) lets the store choose to recompute rather than load from a slow tier."""
        return self.lookup(key, count, tokens, kind, user)[0]

    def lookup(self, key: str, count: bool = True, tokens: int | None = None, kind: str = "",
               user: str | None = None) -> tuple[ChunkKV | None, dict]:
        """`get`, and where it came from: {"tier": ram|gpu|disk|redis|None, and "pin": held
        (a pin kept it) or evicted (memory pressure broke its pin), "choice": "recompute"
        where a slow tier had it but loading would cost more than recomputing}."""
        with self._lock:
            info: dict = {}
            if count:
                self.policy.used(key, tokens or 0, kind, user)
            kv = self._find(key, tokens, info)
            if count:
                self.record(kv is not None)
                if tokens is not None:
                    self.looked_tokens += tokens
                    self.hit_tokens += tokens if kv is not None else 0
            now = self.policy.clock()
            if key in self.pins and kv is not None:
                info["pin"] = "held"
            elif key in self.pins_broken:
                info["pin"] = "evicted"
                if count:
                    self.pins_broken.pop(key)
            if key in self.pins and self.pins[key] <= now:
                self.pins.pop(key)
            return kv, info

    def record(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def _find(self, key: str, tokens: int | None, info: dict) -> ChunkKV | None:
        first = self.tiers[0]
        kv = self._timed(first.name, lambda: first.get(key), first.entries.get(key))
        if kv is not None:
            info["tier"] = first.name
            return kv
        for tier in self.tiers[1:]:
            kv = tier.get(key)
            if kv is not None:
                info["tier"] = tier.name
                namespace = tier.namespace(key)
                tier.remove(key)
                self._insert(key, namespace, kv)
                return kv.to(first.device)
        waiting = self._cancel_write(key)
        if waiting is not None:  # pushed out of memory, its disk write not done: back it comes
            kv = _as_kv(key, waiting[1])
            info["tier"] = first.name
            self._insert(key, waiting[0], kv)
            return kv.to(first.device)
        found, on_disk = None, False
        if self.disk is not None and key in self.disk:
            size = self.disk.size(key)
            if self._recompute_instead("disk", tokens, size, info):
                return None
            t0 = time.perf_counter()
            found = self.disk.read(key)
            if found is not None:
                self._count_read("disk", size, t0, info)
                on_disk = True
        if found is None and self.shared is not None:
            est = int(tokens * self.bytes_per_token) if tokens is not None and self.bytes_per_token else 0
            if self._recompute_instead("redis", tokens, est or None, info):  # no estimate yet: read
                return None
            t0 = time.perf_counter()
            got = self.shared.read(key)
            if got is not None:
                found = got[:2]
                self._count_read("redis", got[2], t0, info)
        if found is not None:
            namespace, kv = found
            # a Redis hit is offered to the disk tier too: were it not (taken for a disk copy),
            # every turn whose RAM tier has no room for it would read it from Redis again
            self._insert(key, namespace, kv, on_disk=on_disk)
            return kv.to(first.device)
        return None

    def _recompute_instead(self, tier: str, tokens: int | None, nbytes: int | None, info: dict) -> bool:
        """Whether the measured rates say a prefill of `tokens` costs less than reading `nbytes`
        from `tier` (counted, and noted in the trace's `info`)."""
        if (not self.choose_loads or tokens is None or nbytes is None
                or self.rates.worth_loading(tier, tokens, nbytes)):
            return False
        self.recompute_chosen += 1
        info["choice"] = "recompute"
        return True

    def _count_read(self, tier: str, nbytes: int, t0: float, info: dict) -> None:
        """A read from `tier` of `nbytes` that began at `t0`: into the tier's rate and the totals."""
        self.rates.read(tier, nbytes, time.perf_counter() - t0)
        self.read_bytes[tier] += nbytes
        info["tier"] = tier

    def _timed(self, tier: str, get, held: _Held | None) -> ChunkKV | None:
        if held is None or held.blob is None:
            return get()
        t0 = time.perf_counter()
        kv = get()
        self.rates.read(tier, held.nbytes, time.perf_counter() - t0)
        return kv

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return (any(key in t.entries for t in self.tiers) or key in self._pending
                    or (self.disk is not None and key in self.disk))

    # --- writes ----------------------------------------------------------------------------
    def put(self, key: str, namespace: str, kv: ChunkKV, kind: str = "") -> bool:
        """Offer a chunk's KV; whether any tier took it (chunks shorter than the policy's
        minimum, or worth less per byte than everything they would push out, are not kept)."""
        with self._lock:
            self.policy.stored(key, kv.tokens, kind)
            for tier in self.tiers[1:]:
                tier.remove(key)
            if self.disk is not None:
                self.disk.remove(key)  # a stale copy must not come back after an eviction
                self._cancel_write(key)
            # a short entry computed exactly in its context is kept all the same: without it,
            # everything after it in the prompt could no longer be an exact prefix
            if not self.policy.admits(kv.tokens) and key not in self.pins and kv.context is None:
                self.rejected += 1
                return False
            kept = self._insert(key, namespace, kv)
            if self.shared is not None:
                self.shared.write(key, namespace, kv)
                kept = True
            return kept

    def _pinned(self, key: str) -> bool:
        until = self.pins.get(key)
        return until is not None and until > self.policy.clock()

    def _make_room(self, tier, key: str, nbytes: int, sizes) -> list[str] | None:
        """Keys `tier` evicts so that an entry of `nbytes` fits, or None: not admitted."""
        over = tier.bytes + nbytes - tier.budget
        if over <= 0:
            return []
        pinned = self._pinned(key)
        new_prio = self.policy.priority(key, nbytes) if getattr(self.policy, "admission", False) else math.inf
        entries = ((k, n, self.policy.priority(k, n), self._pinned(k)) for k, n in sizes())
        return victims(entries, over, new_prio, pinned)

    def _insert(self, key: str, namespace: str, kv: ChunkKV, on_disk: bool = False) -> bool:
        """Put into the first tier that admits it; evictions cascade down, onto disk last
        (an entry already on disk is not written again). Whether some tier holds it."""
        moving: list[tuple[str, str, ChunkKV | _Held]] = [(key, namespace, kv)]
        kept = False
        for tier in self.tiers:
            spilled = []
            for k, ns, item in moving:
                held = item if isinstance(item, _Held) and item.blob is not None and tier.codec != "raw" \
                    else tier.hold(k, ns, _as_kv(k, item))
                out = None if held.nbytes > tier.budget else self._make_room(
                    tier, k, held.nbytes, lambda t=tier: ((x, h.nbytes) for x, h in t.entries.items()))
                if out is None:
                    spilled.append((k, ns, item))
                    continue
                for old in out:
                    spilled.append((old, *self._leave(tier, old)))
                tier.insert(k, held)
                kept = kept or k == key
            moving = spilled
            if not moving:
                return kept
        for k, ns, item in moving:
            if self.disk is None or (k == key and on_disk):
                continue
            if k in self.disk:
                kept = kept or k == key
                continue
            if self.write_behind and len(self._pending) < self.max_pending:
                if not self._refused(k, item):
                    self._queue_write(k, ns, item)
                    kept = kept or k == key
            elif self._write_now(k, ns, item):
                kept = kept or k == key
        if not kept and not (on_disk and self.disk is not None and key in self.disk):
            self.rejected += 1
        return kept

    # --- the disk writes ----------------------------------------------------------------
    def _cancel_write(self, key: str) -> tuple[str, ChunkKV | _Held, int] | None:
        """Take `key`'s waiting disk write back (a write under way is then discarded when it
        ends); (namespace, entry, ticket), or None when none waits."""
        waiting = self._pending.pop(key, None)
        if waiting is not None:
            self._changed.notify_all()
        return waiting

    def _room_on_disk(self, key: str, nbytes: int) -> bool:
        """Evict what the disk's policy gives up for an entry of `nbytes`; whether it fits."""
        out = self._make_room(self.disk, key, nbytes, self._disk_sizes)
        for old in out or ():
            self.disk.remove(old)
            self.evictions += 1
        return out is not None

    def _coded(self, item: ChunkKV | _Held) -> bytes | None:
        """The entry's blob where it is held in the disk's codec already."""
        if isinstance(item, _Held) and item.blob is not None and codec_of(item.blob) == self.codec:
            return item.blob
        return None

    def _disk_sizes(self):
        return ((x, n) for x, (_, n) in self.disk.files.items())

    def _refused(self, key: str, item: ChunkKV | _Held) -> bool:
        """Whether the disk would refuse the entry at its expected size (not worth an encode)."""
        tokens = item.tokens
        if self._coded(item) is not None or not tokens or not self.bytes_per_token:
            return False
        return self._make_room(self.disk, key, int(tokens * self.bytes_per_token), self._disk_sizes) is None

    def _blob_written(self, blob: bytes, tokens: int) -> None:
        if tokens:
            per = len(blob) / tokens
            self.bytes_per_token = per if self.bytes_per_token is None else 0.8 * self.bytes_per_token + 0.2 * per

    def _write_now(self, key: str, namespace: str, item: ChunkKV | _Held) -> bool:
        """Encode and write on this thread (lock held); whether the disk took it."""
        if self._refused(key, item):
            return False
        t0 = time.perf_counter()
        blob = self._coded(item) or encode(key, namespace, _as_kv(key, item), self.codec)
        self._blob_written(blob, item.tokens)
        fits = self._room_on_disk(key, len(blob))
        if fits:
            self.disk.write_blob(key, namespace, blob)
        self.disk_write_s += time.perf_counter() - t0
        return fits

    def _queue_write(self, key: str, namespace: str, item: ChunkKV | _Held) -> None:
        self._tickets += 1
        self._pending[key] = (namespace, item, self._tickets)
        self._pending.move_to_end(key)
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_behind, name="agentmem-kv-disk", daemon=True)
            self._writer.start()
            _writing_stores.add(self)
        self._changed.notify_all()

    def _write_behind(self) -> None:
        """The writer thread: the oldest waiting entry is encoded and written to a temporary
        file without the lock; under it, the write is installed (evicting what it pushes out)
        unless it was cancelled meanwhile (taken back, replaced, or its namespace dropped)."""
        while True:
            try:
                self._write_one()
            except Exception:  # never the thread's end: what waits would never be written
                log.exception("agentmem: the chunk KV disk writer failed on one entry")
                with self._lock:  # that entry (the oldest) is dropped, not tried again forever
                    if self._pending:
                        self._pending.popitem(last=False)
                    self._writing = None
                    self._changed.notify_all()

    def _write_one(self) -> None:
        """One waiting entry to disk (see `_write_behind`)."""
        with self._lock:
            while not self._pending:
                self._changed.wait()
            key, (namespace, item, ticket) = next(iter(self._pending.items()))
            if self._refused(key, item):
                self._pending.pop(key)
                self._changed.notify_all()
                return
            self._writing = namespace
        t0 = time.perf_counter()
        tmp, blob = None, b""
        try:
            with torch.inference_mode():  # the engine's KV are inference tensors
                blob = self._coded(item) or encode(key, namespace, _as_kv(key, item), self.codec)
            tmp = self.disk.write_tmp(key, namespace, blob)
        except Exception as exc:  # a full or failing disk: the entry is dropped (a cache)
            log.warning("agentmem: chunk KV not written to disk: %s: %s", type(exc).__name__, exc)
        with self._lock:
            self._writing = None
            live = self._pending.get(key, (None, None, None))[2] == ticket
            if live:
                self._pending.pop(key)
            if tmp is not None and live:
                self._blob_written(blob, item.tokens)
                if self._room_on_disk(key, len(blob)):
                    self.disk.install(key, namespace, tmp, len(blob))
                else:
                    self.disk.discard_tmp(tmp)
            elif tmp is not None:
                self.disk.discard_tmp(tmp)
            self.disk_write_s += time.perf_counter() - t0
            self._changed.notify_all()

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every entry waiting for the disk is written (benchmarks, tests, a
        shutdown); whether none is left waiting."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (self._pending or self._writing is not None) and time.monotonic() < deadline:
                self._changed.wait(min(0.5, max(deadline - time.monotonic(), 0.001)))
            return not self._pending

    def _leave(self, tier: MemoryTier, key: str) -> tuple[str, _Held]:
        gone = tier.remove(key)
        self._evicted(key)
        return gone.namespace, gone

    def _evicted(self, key: str) -> None:
        self.evictions += 1
        if self._pinned(key):
            self.pins.pop(key, None)
            self.pins_broken[key] = self.policy.clock()
            while len(self.pins_broken) > 4096:
                self.pins_broken.popitem(last=False)

    # --- pins ------------------------------------------------------------------------------
    def pin(self, key: str, seconds: float, kv: ChunkKV | None = None, namespace: str = "") -> bool:
        """Keep `key` in the first memory tier for `seconds` (a tool call's wait). An entry
        held lower down moves up; `kv` is inserted when no tier holds it (it was not
        admitted). Whether it is now pinned in memory."""
        with self._lock:
            self.pins[key] = self.policy.clock() + seconds
            self.pins_broken.pop(key, None)
            if key in self.tiers[0].entries:
                return True
            found = None
            for tier in self.tiers[1:]:
                if key in tier.entries:
                    namespace, found = tier.namespace(key), tier.get(key)
                    tier.remove(key)
                    break
            waiting = self._cancel_write(key) if found is None else None
            if waiting is not None:
                namespace, found = waiting[0], _as_kv(key, waiting[1])
            if found is None and self.disk is not None and key in self.disk:
                got = self.disk.read(key)
                if got is not None:
                    namespace, found = got
            found = found if found is not None else kv
            if found is None:
                self.pins.pop(key)
                return False
            self._insert(key, namespace, found, on_disk=self.disk is not None and key in self.disk)
            ok = key in self.tiers[0].entries
            if not ok:
                self.pins.pop(key)
            return ok

    def unpin(self, key: str) -> None:
        with self._lock:
            self.pins.pop(key, None)

    # --- the rest --------------------------------------------------------------------------
    def drop_namespace(self, namespace: str) -> int:
        """Remove every entry of `namespace` from every tier; how many were removed."""
        with self._lock:
            n = sum(t.drop_namespace(namespace) for t in self.tiers)
            waiting = [k for k, (ns, _, _) in self._pending.items() if ns == namespace]
            for k in waiting:
                self._cancel_write(k)
            n += len(waiting)
            while self._writing == namespace:  # its file is discarded before this goes on
                self._changed.wait()
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
                "rejected": self.rejected,
                "ram_bytes": sum(t.bytes for t in self.tiers if t.device.type == "cpu"),
                "disk_bytes": self.disk.bytes if self.disk is not None else 0,
                "hit_ratio": self.hits / looked if looked else 0.0,
                "token_hit_ratio": self.hit_tokens / self.looked_tokens if self.looked_tokens else 0.0,
                "entries": sum(len(t.entries) for t in self.tiers),
                "disk_read_bytes": self.read_bytes["disk"],
                "redis_read_bytes": self.read_bytes["redis"],
                "recompute_chosen": self.recompute_chosen,
                "pinned": sum(1 for k in self.pins if self._pinned(k)),
                "codec": self.codec,
                "disk_pending": len(self._pending),
                "disk_write_s": self.disk_write_s,
            } | self.policy.stats()
            if self.shared is not None:
                out |= self.shared.stats()
            gpu = sum(t.bytes for t in self.tiers if t.device.type != "cpu")
            if gpu:
                out["gpu_bytes"] = gpu
            return out


def _as_kv(key: str, item: ChunkKV | _Held) -> ChunkKV:
    if isinstance(item, ChunkKV):
        return item
    if item.kv is not None:
        return item.kv
    return decode(item.blob, key)[1]


def _restored(mtime: float):
    """What the policy knows of a file found on disk at start: its last write, nothing else."""
    from .policy import Seen

    return Seen(tokens=0, last=mtime)
