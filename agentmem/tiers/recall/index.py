"""The recall store's indexes: one FAISS index per tenant and user, its tables, its files,
and keeping it in step with the archive.

The index is a cache of the archive. On every use it is reconciled with the archive in one
indexed query (count and newest id): new rows are embedded then (lazily: writes never wait
for embeddings), deleted ones dropped; it is saved to disk every `FLUSH_VECTORS` new vectors
and on `close()`, so a lost or stale file costs re-embedding, never data. Each user has their
own lock, and new rows are embedded outside it (only adding the vectors is done under it);
the embedder is shared and taken per bounded batch in fair order, so one tenant's long
messages do not stall another tenant's search.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np

from ..archive import Archive
from ..byte_lru import ByteLRU
from ..keys import context_view, unprefixed, with_keys
from ..query import content_terms, information, words
from ..records import SENTENCE_BREAK, Message, only_asks
from ..specific import TermStats, topical
from .candidate import _MEMORY, _MESSAGE

CHUNK_CHARS = 1000  # all-MiniLM-L6-v2 reads 256 word pieces, about this many characters
MAX_CHUNKS = 2047  # pieces of one message
EMBED_BATCH = 512  # texts a sync embeds (outside the user's lock) before adding them under it
READ_BATCH = 2000  # rows a sync reads at a time
FLUSH_VECTORS = 4096  # save the index after this many new vectors (and on close)
IVF_MIN_VECTORS = 65_536  # from here a user's index is an IVF (an exact scan grows with the history)
IVF_NPROBE = 32  # lists an IVF search visits, of about 2 x sqrt(vectors)
FLUSH_SECONDS = 60.0
COUNT_SECONDS = 60.0  # the index is counted against the archive this often (and on load)
LOOKBACK_IDS = 1000 << 12  # a second of row ids (tiers/ids.py: a millisecond tick above 12 bits)
_VIEW_TEXT, _VIEW_CONTEXT, _VIEW_SENTENCE = 0, 1, 2
SENTENCE_MIN_WORDS = 16  # a turn this long with two sentences or more gets a vector per sentence too
_INDEX_VERSION = 10  # 6: a vector per sentence of long turns; 7: each turn's speaker; 8: word statistics;
# 9: no numerals among them (specific.topical); 10: captions in the text view and the priors (keys.with_keys)


def chunk_text(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Cut text into pieces of at most `size` characters at whitespace, so a message far over
    the context window is still found by the part that matches."""
    text = text.strip()
    out: list[str] = []
    while len(text) > size and len(out) < MAX_CHUNKS - 1:
        cut = text.rfind(" ", size // 2, size)
        cut = cut if cut > 0 else size
        out.append(text[:cut].strip())
        text = text[cut:].strip()
    out.append(text[: size * 4] if len(out) == MAX_CHUNKS - 1 else text)
    return [c for c in out if c] or [text]


def sentences(text: str) -> list[str]:
    """The sentences of a turn long enough to say several things ("Hi! sorry, crazy week.
    Oh and I finally bought a cello"), each of three words or more; [] for a shorter turn.
    A mean-pooled vector of the whole turn blurs each thing it says; one per sentence keeps
    them apart (the turn's `dense` rank is its best vector's)."""
    if len(text.split()) < SENTENCE_MIN_WORDS:
        return []
    parts = [p.strip() for p in SENTENCE_BREAK.split(text) if len(p.split()) >= 3]
    return parts if len(parts) > 1 else []


def _message_pieces(m: Message, previous: str | None) -> list[tuple[str, tuple[int, int, int, int]]]:
    """(text, piece) for each vector the dense index holds of a message; a piece is
    (kind, row id, chunk, view)."""
    chunks = chunk_text(unprefixed(m.text, m.name))
    out = [(with_keys(c, m.keys) if i == 0 else c, (_MESSAGE, m.id, i, _VIEW_TEXT)) for i, c in enumerate(chunks)]
    out += [(t, (_MESSAGE, m.id, i, _VIEW_SENTENCE)) for i, t in enumerate(sentences(chunks[0]))]
    out.append((context_view(chunks[0], previous, m.keys), (_MESSAGE, m.id, 0, _VIEW_CONTEXT)))
    return out


@dataclass
class UserIndex:
    """One user's vectors. FAISS ids are local and sequential (row ids are up to 53 bits and
    do not fit beside a chunk number in FAISS's int64); `pieces` maps them back."""

    index: faiss.IndexIDMap2
    messages: dict[int, int] = field(default_factory=dict)  # message id -> vectors it has
    memories: dict[int, str] = field(default_factory=dict)  # memory id -> updated_at it was embedded at
    top_id: int = 0  # the newest message id indexed
    low_id: int = 0  # the oldest
    recent: list[int] = field(default_factory=list)  # ids indexed above top_id - LOOKBACK_IDS, sorted
    counted_at: float = -math.inf  # when the index was last counted against the archive (monotonic)
    speakers: set[str] = field(default_factory=set)  # names the conversation gives its speakers
    newest: float = 0.0  # the conversation's 'now': its newest message time (unix seconds)
    times: dict[int, float] = field(default_factory=dict)  # message id -> its time, for time filters
    info: dict[int, float] = field(default_factory=dict)  # message id -> query.information of its text
    asks: set[int] = field(default_factory=set)  # messages that only ask (one sentence, a question)
    terms: TermStats = field(default_factory=TermStats)  # word statistics for the specificity prior
    who: dict[int, int] = field(default_factory=dict)  # message id -> its speaker's code (named speakers only)
    codes: dict[str, int] = field(default_factory=dict)  # speaker name -> code, in order of first appearance
    mtimes: dict[int, float] = field(default_factory=dict)  # memory id -> its time (unix s)
    vtime: np.ndarray = field(default_factory=lambda: np.zeros(0))  # FAISS id -> its message's time (unix s)
    vwho: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # FAISS id -> speaker code
    pieces: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)  # faiss id -> piece
    vids: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (kind, row id) -> faiss ids
    next_vid: int = 0
    ivf_trained_at: int = 0  # vectors when the IVF lists were trained (0: exact index)
    # per view group (context or not): (mean, top components [pcs, dim]) of the vectors, and
    # their count when estimated (not saved: estimated again at first use)
    white: dict[bool, tuple[np.ndarray, np.ndarray]] | None = None
    white_n: int = 0
    looped: set[int] = field(default_factory=set)  # replies the loop detector cut (not saved: re-read on load)
    turns_seen: int = 0  # the newest turn id `looped` has read
    dirty: int = 0  # vectors changed since the last save
    saved_at: float = field(default_factory=time.monotonic)

    def assign(self, pieces: list[tuple[int, int, int, int]]) -> np.ndarray:
        """FAISS ids for new pieces (their messages already `see`n)."""
        ids = np.arange(self.next_vid, self.next_vid + len(pieces), dtype=np.int64)
        self.next_vid += len(pieces)
        for vid, piece in zip(ids.tolist(), pieces, strict=True):
            self.pieces[vid] = piece
            self.vids.setdefault(piece[:2], []).append(vid)
        self._place(ids.tolist(), pieces)
        return ids

    def _place(self, vids: list[int], pieces: list[tuple[int, int, int, int]]) -> None:
        """Each vector's time (its message's or memory's) and speaker in arrays by FAISS id, from
        which a filtered search builds its selector without a Python loop (NaN: released)."""
        if self.next_vid > len(self.vtime):
            grow = max(self.next_vid, 2 * len(self.vtime), 1024)
            self.vtime = np.concatenate([self.vtime, np.full(grow - len(self.vtime), np.nan)])
            self.vwho = np.concatenate([self.vwho, np.full(grow - len(self.vwho), -1, dtype=np.int32)])
        for vid, (kind, row, _, _) in zip(vids, pieces, strict=True):
            if kind == _MESSAGE:
                self.vtime[vid] = self.times.get(row, np.nan)
                self.vwho[vid] = self.who.get(row, -1)
            else:
                self.vtime[vid] = self.mtimes.get(row, np.nan)

    def release(self, kind: int, row_id: int) -> list[int]:
        out = self.vids.pop((kind, row_id), [])
        for vid in out:
            self.pieces.pop(vid, None)
        if out:
            self.vtime[out] = np.nan
        return out

    def selector(self, lo: float, hi: float, who: frozenset[int] | None):
        """A FAISS selector of the message vectors with a time in [lo, hi] (and by one of the
        speakers `who`), and how many there are. Keep the selector's `bitmap` alive with it."""
        n = self.next_vid
        t = self.vtime[:n]
        with np.errstate(invalid="ignore"):
            keep = (t >= lo) & (t <= hi)
        if who is not None:
            keep &= np.isin(self.vwho[:n], np.fromiter(who, dtype=np.int32, count=len(who)))
        bitmap = np.packbits(keep, bitorder="little")
        sel = faiss.IDSelectorBitmap(n, faiss.swig_ptr(bitmap))
        sel.bitmap_ref = bitmap
        return sel, int(keep.sum())

    def vid_of(self, piece: tuple[int, int, int, int]) -> int | None:
        return next((v for v in self.vids.get(piece[:2], []) if self.pieces[v] == piece), None)

    def see(self, messages: list[Message]) -> None:
        for m in messages:
            t = m.time.timestamp()
            self.top_id = max(self.top_id, m.id)
            self.low_id = min(self.low_id, m.id) if self.low_id else m.id
            bisect.insort(self.recent, m.id)
            self.newest = max(self.newest, t)
            self.times[m.id] = t
            if m.name:
                self.speakers.add(m.name)
                self.who[m.id] = self.codes.setdefault(m.name, len(self.codes))
        self.recent = self.recent[bisect.bisect_right(self.recent, self.top_id - LOOKBACK_IDS):]
        names = {p for s in self.speakers for p in words(s)}
        for m in messages:
            said = with_keys(m.text, m.keys)
            self.info[m.id] = information(said, names)
            self.terms.add(m.id, topical(content_terms(said, names)))
            if only_asks(m.text) and not m.keys:  # a question with a photo shows something
                self.asks.add(m.id)


class Indexes:
    """The users' indexes: in memory up to a byte budget, on disk beside, each reconciled with
    the archive on use (`sync`). `ivf_min_vectors`: from here a user's index is an IVF."""

    def __init__(self, archive: Archive, embedder: Callable[[], object], directory: Path,
                 cache_bytes: int = 256 << 20, ivf_min_vectors: int = IVF_MIN_VECTORS):
        self.archive = archive
        self.ivf_min_vectors = ivf_min_vectors
        self._embedder = embedder
        self.directory = Path(directory)
        # the users' indexes in memory, bounded by bytes (AGENTMEM_RECALL_CACHE_MB): the least
        # recently used leave (saved first) and are loaded from disk on their next use
        self._indexes: ByteLRU[tuple[str, str], UserIndex] = ByteLRU(cache_bytes, _index_bytes, self._evict)
        self._cache_lock = threading.Lock()
        self._locks: dict[tuple[str, str], threading.RLock] = {}
        self._locks_guard = threading.Lock()
        self._sync_locks: dict[tuple[str, str], threading.Lock] = {}  # one sync of a user at a time
        self._epochs: dict[tuple[str, str | None], int] = {}  # drops of a user (tenant, user) or tenant (tenant, None)
        # tenants dropped in this process: their ids are never reused (DeletedTenantRow), so an
        # index a request still under way loads or touches after the drop is never written back
        self._dropped_tenants: set[str] = set()

    @property
    def embedder(self):
        return self._embedder()

    def _lock(self, tenant_id: str, user_id: str) -> threading.RLock:
        with self._locks_guard:
            return self._locks.setdefault((tenant_id, user_id), threading.RLock())

    # --- files -------------------------------------------------------------------------------
    def _paths(self, tenant_id: str, user_id: str) -> tuple[Path, Path]:
        t = hashlib.sha256(tenant_id.encode()).hexdigest()[:24]
        u = hashlib.sha256(user_id.encode()).hexdigest()[:24]
        base = self.directory / t / u
        return base.with_suffix(".faiss"), base.with_suffix(".json")

    def _new_index(self) -> faiss.IndexIDMap2:
        return faiss.IndexIDMap2(_flat16(self.embedder.dim))

    def _maybe_ivf(self, ui: UserIndex) -> None:
        """An exact scan costs time in proportion to the history; past `ivf_min_vectors` the
        user's vectors move to an inverted-file index (k-means lists, IVF_NPROBE of them
        searched), retrained when the history has grown 4x since. Ids and vectors are kept.

        The IVF holds its vectors in fp16 (`QT_fp16`), so a long history fits the default cache
        (`recall_cache_mb`) beside other users' and its scan is cheaper; a cosine moves by ~1e-4,
        far below the gaps that order a ranking. An IVF-flat written before is converted when
        it is loaded."""
        n = ui.index.ntotal
        if n < self.ivf_min_vectors or (isinstance(ui.index, faiss.IndexIVFScalarQuantizer)
                                   and n < 4 * ui.ivf_trained_at):
            return
        vectors, ids = _all_vectors(ui.index)
        dim = vectors.shape[1]
        nlist = int(2 * math.sqrt(n))
        ivf = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(dim), dim, nlist, faiss.ScalarQuantizer.QT_fp16,
                                            faiss.METRIC_INNER_PRODUCT)
        sample = np.random.default_rng(0).choice(n, size=min(n, 40 * nlist), replace=False)
        ivf.train(vectors[sample])
        ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
        ivf.add_with_ids(vectors, ids)
        ivf.nprobe = IVF_NPROBE
        ui.index, ui.ivf_trained_at, ui.dirty = ivf, n, ui.dirty + 1

    def _load(self, tenant_id: str, user_id: str) -> UserIndex:
        index_path, meta_path = self._paths(tenant_id, user_id)
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("version") != _INDEX_VERSION:
                raise ValueError("index written by another version")
            tables = np.load(meta_path.with_suffix(".npz"))
            ui = UserIndex(faiss.read_index(str(index_path)), memories={int(k): v for k, v in meta["memories"].items()},
                           top_id=int(meta["top_id"]), speakers=set(meta["speakers"]), newest=float(meta["newest"]),
                           next_vid=int(meta["next_vid"]), ivf_trained_at=int(meta["ivf_trained_at"]),
                           codes={n: i for i, n in enumerate(meta["speaker_codes"])})
            for vid, kind, row, chunk, view in tables["pieces"].tolist():
                ui.pieces[vid] = (kind, row, chunk, view)
                ui.vids.setdefault((kind, row), []).append(vid)
                if kind == _MESSAGE:
                    ui.messages[row] = ui.messages.get(row, 0) + 1
            ui.next_vid = max([ui.next_vid, *[v + 1 for v in ui.pieces]])
            for row, t, info, who, asks in tables["messages"].tolist():
                ui.times[int(row)], ui.info[int(row)] = t, info
                if who >= 0:
                    ui.who[int(row)] = int(who)
                if asks:
                    ui.asks.add(int(row))
            ui.mtimes = {int(i): t for i, t in tables["memory_times"].tolist()}
            ui.terms = TermStats.from_state(tables)
            ui.low_id = min(ui.messages, default=0)
            ui.recent = sorted(i for i in ui.messages if i > ui.top_id - LOOKBACK_IDS)
            ui._place(list(ui.pieces), list(ui.pieces.values()))
            if ui.index.ntotal != len(ui.pieces) or len(ui.memories) != sum(k == _MEMORY for k, *_ in ui.pieces.values()):
                raise ValueError("index and its piece table disagree")
            if isinstance(ui.index, faiss.IndexIVFFlat):  # written before the IVF kept fp16 vectors
                self._maybe_ivf(ui)
            elif isinstance(ui.index, faiss.IndexIDMap2) and isinstance(faiss.downcast_index(ui.index.index),
                                                                        faiss.IndexFlat):
                # written before the exact index kept fp16 vectors: the same vectors
                # and ids, narrowed, no text embedded again
                vectors, ids = _all_vectors(ui.index)
                ui.index = self._new_index()
                ui.index.add_with_ids(vectors, ids)
                ui.dirty += 1
            return ui
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, EOFError):
            return UserIndex(self._new_index(), dirty=1)

    def _save(self, tenant_id: str, user_id: str, ui: UserIndex) -> None:
        with self._locks_guard:
            if tenant_id in self._dropped_tenants:
                ui.dirty = 0
                return
        index_path, meta_path = self._paths(tenant_id, user_id)
        index_path.parent.mkdir(parents=True, exist_ok=True)
        tag = f"{os.getpid()}.{threading.get_ident()}.tmp"
        tmp = index_path.with_suffix(f".faiss.{tag}")
        faiss.write_index(ui.index, str(tmp))
        os.replace(tmp, index_path)
        pieces = np.asarray([(v, *p) for v, p in ui.pieces.items()], dtype=np.int64).reshape(-1, 5)
        rows = np.asarray([(i, ui.times.get(i, 0.0), ui.info.get(i, 1.0), ui.who.get(i, -1), i in ui.asks)
                           for i in ui.messages], dtype=np.float64).reshape(-1, 5)
        tmp = meta_path.with_suffix(f".npz.{tag}")
        with open(tmp, "wb") as f:
            np.savez(f, pieces=pieces, messages=rows, memory_times=np.asarray(
                [(i, ui.mtimes.get(i, np.nan)) for i in ui.memories], dtype=np.float64).reshape(-1, 2),
                **ui.terms.state())
        os.replace(tmp, meta_path.with_suffix(".npz"))
        tmp = meta_path.with_suffix(f".json.{tag}")
        tmp.write_text(json.dumps({"version": _INDEX_VERSION, "memories": ui.memories, "top_id": ui.top_id,
                                   "speakers": sorted(ui.speakers), "newest": ui.newest, "next_vid": ui.next_vid,
                                   "ivf_trained_at": ui.ivf_trained_at,
                                   "speaker_codes": sorted(ui.codes, key=ui.codes.get)}))
        os.replace(tmp, meta_path)  # written last: it validates the other two
        ui.dirty, ui.saved_at = 0, time.monotonic()

    def flush(self, tenant_id: str, user_id: str) -> None:
        """Save the user's index now if it changed since it was last saved."""
        with self._lock(tenant_id, user_id):
            with self._cache_lock:
                ui = self._indexes.get((tenant_id, user_id))
            if ui is not None and ui.dirty:
                self._save(tenant_id, user_id, ui)

    def close(self) -> None:
        for tenant_id, user_id in list(self._indexes):
            self.flush(tenant_id, user_id)

    def _maybe_save(self, tenant_id: str, user_id: str, ui: UserIndex) -> None:
        if ui.dirty >= FLUSH_VECTORS or (ui.dirty and time.monotonic() - ui.saved_at > FLUSH_SECONDS):
            self._save(tenant_id, user_id, ui)

    # --- keeping in step with the archive ----------------------------------------------------
    def sync(self, tenant_id: str, user_id: str) -> UserIndex:
        """The user's index, reconciled with the archive: new rows embedded, removed ones
        dropped. One indexed count query when nothing changed.

        New rows are read and embedded outside the user's lock (the one searches, eviction,
        `flush` and `forget` take), EMBED_BATCH texts at a time; only adding their vectors and
        table entries is done under it. Syncs of one user take turns (`_sync_turn`), so a row is
        embedded once, and a row another sync added meanwhile is skipped, never added twice. A
        user dropped meanwhile (`drop`, `drop_tenant`) gets nothing back."""
        key = (tenant_id, user_id)
        with self._sync_turn(key):
            epoch = self._epoch(key)
            with self._lock(tenant_id, user_id):
                ui = self._current(key, epoch)
                if ui is None:
                    return UserIndex(self._new_index())
                after, low_known = ui.top_id, ui.low_id
                mark = max(0, after - LOOKBACK_IDS)
                recent_known = len(ui.recent) - bisect.bisect_right(ui.recent, mark)
                count_due = time.monotonic() - ui.counted_at > COUNT_SECONDS
            low, top, recent = self.archive.message_bounds(tenant_id, user_id, mark)
            if top > after or recent != recent_known:
                # new rows, or one committed late just below the newest (another replica's
                # transaction that took its id first): read from a second of ids back
                for batch in self.archive.iter_messages(tenant_id, user_id, after_id=mark):
                    self._add_messages(tenant_id, user_id, epoch, batch)
            count = self.archive.message_stats(tenant_id, user_id)[0] if count_due else None
            missing: list[int] = []
            with self._lock(tenant_id, user_id):
                ui = self._current(key, epoch)
                # only a deleted user loses messages (its ids are never reused): the oldest id
                # changes or the newest goes back; the count, which costs a walk over the user's
                # rows, is checked on load and every COUNT_SECONDS (a stale or damaged file)
                stale = ui is not None and (low != low_known or top < after
                                            or (count is not None and count != len(ui.messages)))
                if ui is not None and count is not None:
                    ui.counted_at = time.monotonic()
            if stale:  # deleted rows (or a stale file): reconcile by id
                want = set(self.archive.message_ids(tenant_id, user_id))
                with self._lock(tenant_id, user_id):
                    ui = self._current(key, epoch)
                    if ui is not None:
                        for i in [i for i in ui.messages if i not in want]:
                            self._remove(ui, _MESSAGE, i)
                            ui.times.pop(i, None)
                            ui.info.pop(i, None)
                            ui.who.pop(i, None)
                            ui.asks.discard(i)
                            ui.terms.remove(i)
                        if not want:
                            ui.top_id, ui.newest, ui.speakers, ui.times, ui.info = 0, 0.0, set(), {}, {}
                            ui.who, ui.codes, ui.asks, ui.terms = {}, {}, set(), TermStats()
                        ui.low_id = min(want, default=0)
                        # the newest rows deleted: later syncs would take `top < after` for another
                        # deletion and reconcile on every search
                        ui.top_id = min(ui.top_id, max(want, default=0))
                        ui.recent = sorted(i for i in ui.messages if i > ui.top_id - LOOKBACK_IDS)
                        ui.counted_at = -math.inf  # count again next time: the reconcile may have raced
                        missing = sorted(want - ui.messages.keys())
            for i in range(0, len(missing), READ_BATCH):
                self._add_messages(tenant_id, user_id, epoch,
                                   self.archive.messages(tenant_id, user_id, ids=missing[i:i + READ_BATCH]))
            want_mems = {i: t.isoformat() for i, t in self.archive.memory_versions(tenant_id, user_id).items()}
            new_mems: list[int] = []
            with self._lock(tenant_id, user_id):
                ui = self._current(key, epoch)
                if ui is not None:
                    for i in [i for i, v in ui.memories.items() if want_mems.get(i) != v]:
                        self._remove(ui, _MEMORY, i)
                    new_mems = [i for i in want_mems if i not in ui.memories]
            for i in range(0, len(new_mems), READ_BATCH):
                got = self.archive.memories_by_id(tenant_id, user_id, new_mems[i:i + READ_BATCH]).values()
                self._add_memories(tenant_id, user_id, epoch, got)
            with self._lock(tenant_id, user_id):
                ui = self._current(key, epoch)
                if ui is None:  # dropped while it synced: an empty index, kept nowhere
                    return UserIndex(self._new_index())
                self._maybe_ivf(ui)
                self._maybe_save(tenant_id, user_id, ui)
                with self._cache_lock:
                    self._indexes.put(key, ui)  # measured again: it may have grown
                return ui

    def _sync_turn(self, key: tuple[str, str]) -> threading.Lock:
        with self._locks_guard:
            return self._sync_locks.setdefault(key, threading.Lock())

    def _epoch(self, key: tuple[str, str]) -> tuple[int, int]:
        """Bumped by `drop` (the user) and `drop_tenant` (the tenant): a sync that began before
        either adds nothing after it."""
        with self._locks_guard:
            return self._epochs.get((key[0], None), 0), self._epochs.get(key, 0)

    def _bump(self, key: tuple[str, str | None]) -> None:
        with self._locks_guard:
            self._epochs[key] = self._epochs.get(key, 0) + 1

    def _current(self, key: tuple[str, str], epoch: tuple[int, int]) -> UserIndex | None:
        """The user's index as it is now (loaded again if it left the cache since), or None if
        the user was dropped after `epoch`. The caller holds the user's lock."""
        if self._epoch(key) != epoch:
            return None
        with self._cache_lock:
            ui = self._indexes.get(key)
        if ui is None:
            ui = self._load(*key)
            with self._cache_lock:
                self._indexes.put(key, ui)
        return ui

    def _evict(self, key: tuple[str, str], ui: UserIndex) -> bool:
        """A user's index leaves memory: saved first if it changed. An index another thread
        is using (its lock is held) stays; the cache moves on to the next."""
        lock = self._lock(*key)
        if not lock.acquire(blocking=False):
            return False
        try:
            if ui.dirty:
                self._save(*key, ui)
            return True
        finally:
            lock.release()

    def cached_users(self) -> int:
        """How many users' indexes are in memory now."""
        with self._cache_lock:
            return len(self._indexes)

    def _add_messages(self, tenant_id: str, user_id: str, epoch: tuple[int, int], messages: list[Message]) -> None:
        """Embed these messages' pieces, EMBED_BATCH texts at a time, outside the user's lock,
        and add each message the index does not hold yet, whole, under it."""
        messages = sorted(messages, key=lambda m: m.id)
        first: dict[str, int] = {}
        for m in messages:
            first.setdefault(m.session_id, m.id)
        last = {sid: unprefixed(m.text, m.name) for sid, m in self.archive.turns_before(tenant_id, user_id, first).items()}
        with self._lock(tenant_id, user_id):
            ui = self._current((tenant_id, user_id), epoch)
            known = {m.id for m in messages if ui is None or m.id in ui.messages}
        run: list[tuple[Message, list[tuple[str, tuple[int, int, int, int]]]]] = []
        size = 0
        for n, m in enumerate(messages):
            got = _message_pieces(m, last.get(m.session_id))
            last[m.session_id] = unprefixed(m.text, m.name)
            if m.id not in known:
                run.append((m, got))
                size += len(got)
            if run and (size >= EMBED_BATCH or n == len(messages) - 1):
                vectors = self.embedder.embed([t for _, g in run for t, _ in g], owner=tenant_id)
                with self._lock(tenant_id, user_id):
                    ui = self._current((tenant_id, user_id), epoch)
                    if ui is None:
                        return
                    rows, pieces, new, at = [], [], [], 0
                    for msg, g in run:
                        if msg.id not in ui.messages:
                            rows += range(at, at + len(g))
                            pieces += [p for _, p in g]
                            new.append(msg)
                            ui.messages[msg.id] = len(g)
                        at += len(g)
                    ui.see(new)
                    self._add(ui, vectors[rows], pieces)
                run, size = [], 0

    def _add_memories(self, tenant_id: str, user_id: str, epoch: tuple[int, int], memories) -> None:
        memories = list(memories)
        vectors = self.embedder.embed([m.text for m in memories], owner=tenant_id)  # outside the user's lock
        with self._lock(tenant_id, user_id):
            ui = self._current((tenant_id, user_id), epoch)
            if ui is None:
                return
            keep = [i for i, m in enumerate(memories) if m.id not in ui.memories]
            ui.mtimes.update((memories[i].id, memories[i].time.timestamp()) for i in keep)
            self._add(ui, vectors[keep], [(_MEMORY, memories[i].id, 0, _VIEW_TEXT) for i in keep])
            for i in keep:
                ui.memories[memories[i].id] = memories[i].updated_at.replace(tzinfo=None).isoformat()

    @staticmethod
    def _add(ui: UserIndex, vectors: np.ndarray, pieces: list[tuple[int, int, int, int]]) -> None:
        if pieces:
            ui.index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), ui.assign(pieces))
            ui.dirty += len(pieces)

    def _remove(self, ui: UserIndex, kind: int, row_id: int) -> None:
        if kind == _MESSAGE:
            ui.messages.pop(row_id, None)
        else:
            ui.memories.pop(row_id, None)
            ui.mtimes.pop(row_id, None)
        vids = ui.release(kind, row_id)
        if vids:
            ui.index.remove_ids(np.asarray(vids, dtype=np.int64))
            ui.dirty += 1

    def drop(self, tenant_id: str, user_id: str) -> None:
        self._bump((tenant_id, user_id))  # a sync under way adds nothing after this
        with self._lock(tenant_id, user_id):
            with self._cache_lock:
                self._indexes.pop((tenant_id, user_id))
            index_path, meta_path = self._paths(tenant_id, user_id)
            for p in (index_path, meta_path, meta_path.with_suffix(".npz")):
                p.unlink(missing_ok=True)

    def drop_tenant(self, tenant_id: str) -> None:
        self._bump((tenant_id, None))  # a sync under way adds nothing after this
        with self._locks_guard:  # every user seen, cached or not: a sync may be about to cache one
            self._dropped_tenants.add(tenant_id)
            keys = [k for k in self._locks if k[0] == tenant_id]
        for key in keys:
            with self._lock(*key), self._cache_lock:
                self._indexes.pop(key)
        shutil.rmtree(self._paths(tenant_id, "x")[0].parent, ignore_errors=True)

    # --- search ------------------------------------------------------------------------------

    def _looped(self, tenant_id: str, user_id: str, ui: UserIndex) -> set[int]:
        """Replies the loop detector cut, kept per user and topped up from the turns recorded
        since (a second of ids back: another replica's turn may land just below the newest)."""
        with self._lock(tenant_id, user_id):
            got, top = self.archive.looped_since(tenant_id, user_id, max(0, ui.turns_seen - LOOKBACK_IDS))
            ui.looped |= got
            ui.turns_seen = max(ui.turns_seen, top)
            return set(ui.looped)


def _all_vectors(index) -> tuple[np.ndarray, np.ndarray]:
    """Every vector of an index and its id (an exact IDMap2 over a flat index, or an IVF, whose
    vectors are read back through its id map: fp32 as they are, fp16 widened)."""
    if isinstance(index, faiss.IndexIVF):
        if index.direct_map.type == faiss.DirectMap.NoMap:
            index.set_direct_map_type(faiss.DirectMap.Hashtable)
        inv = index.invlists
        ids = [faiss.rev_swig_ptr(inv.get_ids(lst), n).copy()
               for lst in range(index.nlist) if (n := inv.list_size(lst))]
        ids = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, dtype=np.int64)
        return index.reconstruct_batch(ids), ids
    vecs = index.index.reconstruct_n(0, index.ntotal) if index.ntotal else np.zeros((0, index.d), np.float32)
    return vecs, faiss.vector_to_array(index.id_map).astype(np.int64)


def _flat16(dim: int) -> faiss.IndexScalarQuantizer:
    """The exact index's storage: every vector scanned, held as fp16 (as the IVF holds them):
    half the memory and a faster scan than fp32, with the same hits (docs/recall.md)."""
    return faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)


def _index_bytes(ui: UserIndex) -> int:
    """An estimate of a user's index in memory: its vectors (with FAISS's id map; fp16 codes in
    an IVF), and the Python tables beside them, a few hundred bytes per vector and per message."""
    n = ui.index.ntotal
    index = ui.index if isinstance(ui.index, faiss.IndexIVF) else faiss.downcast_index(ui.index.index)
    code = index.code_size  # fp16: 2 bytes a dimension, exact or IVF
    return n * (code + 16) + 250 * (len(ui.pieces) + len(ui.memories)) + 300 * len(ui.messages) + 4096 \
        + ui.terms.nbytes()

