"""The recall store: one FAISS index per tenant and user over messages and memories.

The index is a cache of the archive. Each user's index is kept on disk next to the archive
with the list of rows it holds; on every use it is reconciled with the archive (rows added
by another process are embedded, deleted or edited rows are dropped or re-embedded), so a
missing, stale or corrupt index file costs only re-embedding, never data.

Scoring is hybrid: cosine similarity x a recency factor x an importance factor, so that among
equally similar memories the newer and the more important win, while similarity dominates.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import faiss
import numpy as np

from .archive import Archive
from .records import Hit, Memory, Message

CHUNK_CHARS = 1000  # all-MiniLM-L6-v2 reads 256 word pieces, about this many characters
MAX_CHUNKS = 2047  # per message: the vector id keeps 11 bits for the chunk
HALF_LIFE_DAYS = 30.0
RECENCY_WEIGHT = 0.2
IMPORTANCE_WEIGHT = 0.2
ASSISTANT_WEIGHT = 0.85  # the user's own words are the evidence; a small model's replies may be wrong
_MESSAGE, _MEMORY = 0, 1


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


def _vid(kind: int, row_id: int, chunk: int = 0) -> int:
    return (row_id << 12) | (chunk << 1) | kind


def _unvid(vid: int) -> tuple[int, int, int]:
    return vid & 1, vid >> 12, (vid >> 1) & 0x7FF


def hybrid_score(similarity: float, when: datetime, importance: float, now: datetime) -> float:
    age_days = max(0.0, (now - when).total_seconds() / 86400.0)
    recency = math.pow(0.5, age_days / HALF_LIFE_DAYS)
    return similarity * (1 - RECENCY_WEIGHT + RECENCY_WEIGHT * recency) * (1 - IMPORTANCE_WEIGHT + IMPORTANCE_WEIGHT * importance)


@dataclass
class UserIndex:
    index: faiss.IndexIDMap2
    messages: dict[int, int] = field(default_factory=dict)  # message id -> number of chunks
    memories: dict[int, str] = field(default_factory=dict)  # memory id -> updated_at it was embedded at
    dirty: bool = False


class Recall:
    def __init__(self, archive: Archive, embedder: Callable[[], object], directory: Path):
        self.archive = archive
        self._embedder = embedder
        self.directory = Path(directory)
        self._indexes: dict[tuple[str, str], UserIndex] = {}
        self._lock = threading.RLock()

    @property
    def embedder(self):
        return self._embedder()

    # --- files -------------------------------------------------------------------------------
    def _paths(self, tenant_id: str, user_id: str) -> tuple[Path, Path]:
        t = hashlib.sha256(tenant_id.encode()).hexdigest()[:24]
        u = hashlib.sha256(user_id.encode()).hexdigest()[:24]
        base = self.directory / t / u
        return base.with_suffix(".faiss"), base.with_suffix(".json")

    def _new_index(self) -> faiss.IndexIDMap2:
        return faiss.IndexIDMap2(faiss.IndexFlatIP(self.embedder.dim))

    def _load(self, tenant_id: str, user_id: str) -> UserIndex:
        index_path, meta_path = self._paths(tenant_id, user_id)
        try:
            meta = json.loads(meta_path.read_text())
            ui = UserIndex(faiss.read_index(str(index_path)), {int(k): v for k, v in meta["messages"].items()},
                           {int(k): v for k, v in meta["memories"].items()})
            if ui.index.ntotal != sum(ui.messages.values()) + len(ui.memories):
                raise ValueError("index and its row list disagree")
            return ui
        except (OSError, ValueError, KeyError, RuntimeError):
            return UserIndex(self._new_index(), dirty=True)

    def flush(self, tenant_id: str, user_id: str) -> None:
        with self._lock:
            ui = self._indexes.get((tenant_id, user_id))
            if ui is None or not ui.dirty:
                return
            index_path, meta_path = self._paths(tenant_id, user_id)
            index_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = index_path.with_suffix(f".faiss.{os.getpid()}.tmp")
            faiss.write_index(ui.index, str(tmp))
            os.replace(tmp, index_path)
            tmp = meta_path.with_suffix(f".json.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"messages": ui.messages, "memories": ui.memories}))
            os.replace(tmp, meta_path)
            ui.dirty = False

    # --- keeping in step with the archive ----------------------------------------------------
    def sync(self, tenant_id: str, user_id: str) -> UserIndex:
        """The user's index, reconciled with the archive."""
        with self._lock:
            key = (tenant_id, user_id)
            ui = self._indexes.get(key) or self._load(tenant_id, user_id)
            self._indexes[key] = ui
            want_msgs = set(self.archive.message_ids(tenant_id, user_id))
            want_mems = {i: t.isoformat() for i, t in self.archive.memory_versions(tenant_id, user_id).items()}
            gone = [(_MESSAGE, i) for i in ui.messages if i not in want_msgs]
            gone += [(_MEMORY, i) for i, v in ui.memories.items() if want_mems.get(i) != v]
            for kind, i in gone:
                self._remove(ui, kind, i)
            new_msgs = sorted(want_msgs - ui.messages.keys())
            if new_msgs:
                self._add_messages(ui, self.archive.messages(tenant_id, user_id, ids=new_msgs))
            new_mems = [i for i in want_mems if i not in ui.memories]
            if new_mems:
                self._add_memories(ui, self.archive.memories_by_id(tenant_id, user_id, new_mems).values())
            if ui.dirty:
                self.flush(tenant_id, user_id)
            return ui

    def add_messages(self, tenant_id: str, user_id: str, messages: list[Message]) -> None:
        with self._lock:
            ui = self.sync(tenant_id, user_id)
            self._add_messages(ui, [m for m in messages if m.id not in ui.messages])
            self.flush(tenant_id, user_id)

    def _add_messages(self, ui: UserIndex, messages: list[Message]) -> None:
        texts, ids = [], []
        for m in messages:
            chunks = chunk_text(m.text)
            texts += chunks
            ids += [_vid(_MESSAGE, m.id, c) for c in range(len(chunks))]
            ui.messages[m.id] = len(chunks)
        self._add(ui, texts, ids)

    def _add_memories(self, ui: UserIndex, memories) -> None:
        memories = list(memories)
        self._add(ui, [m.text for m in memories], [_vid(_MEMORY, m.id) for m in memories])
        for m in memories:
            ui.memories[m.id] = m.updated_at.replace(tzinfo=None).isoformat()

    def _add(self, ui: UserIndex, texts: list[str], ids: list[int]) -> None:
        if texts:
            ui.index.add_with_ids(self.embedder.embed(texts), np.asarray(ids, dtype=np.int64))
            ui.dirty = True

    def _remove(self, ui: UserIndex, kind: int, row_id: int) -> None:
        n = ui.messages.pop(row_id, 0) if kind == _MESSAGE else int(ui.memories.pop(row_id, None) is not None)
        if n:
            ui.index.remove_ids(np.asarray([_vid(kind, row_id, c) for c in range(n)], dtype=np.int64))
            ui.dirty = True

    def drop(self, tenant_id: str, user_id: str) -> None:
        with self._lock:
            self._indexes.pop((tenant_id, user_id), None)
            for p in self._paths(tenant_id, user_id):
                p.unlink(missing_ok=True)

    def drop_tenant(self, tenant_id: str) -> None:
        with self._lock:
            for key in [k for k in self._indexes if k[0] == tenant_id]:
                del self._indexes[key]
            shutil.rmtree(self._paths(tenant_id, "x")[0].parent, ignore_errors=True)

    # --- search ------------------------------------------------------------------------------
    def search(self, tenant_id: str, user_id: str, query: str, k: int = 10, since: datetime | None = None,
               until: datetime | None = None, exclude_messages: set[int] | frozenset = frozenset(),
               now: datetime | None = None) -> list[Hit]:
        with self._lock:
            ui = self.sync(tenant_id, user_id)
            n = ui.index.ntotal
            if n == 0 or k <= 0:
                return []
            filtered = since is not None or until is not None or bool(exclude_messages)
            fetch = n if filtered else min(n, max(4 * k, 64))
            sims, vids = ui.index.search(self.embedder.embed([query]), fetch)
        cands = [(float(s), *_unvid(int(v))) for s, v in zip(sims[0], vids[0], strict=True) if v >= 0]
        msg_ids = {r for _, kind, r, _ in cands if kind == _MESSAGE and r not in exclude_messages}
        mem_ids = {r for _, kind, r, _ in cands if kind == _MEMORY}
        msgs = {m.id: m for m in self.archive.messages(tenant_id, user_id, ids=msg_ids)} if msg_ids else {}
        mems = self.archive.memories_by_id(tenant_id, user_id, mem_ids) if mem_ids else {}
        now = now or datetime.now(UTC)
        since, until = _aware(since), _aware(until)
        hits = []
        for sim, kind, row_id, chunk in cands:
            row = msgs.get(row_id) if kind == _MESSAGE else mems.get(row_id)
            if row is None or (isinstance(row, Memory) and row.status != "active"):
                continue
            when = row.time
            if (since is not None and when < since) or (until is not None and when > until):
                continue
            if isinstance(row, Message):
                score = hybrid_score(sim, when, 0.5, now) * (ASSISTANT_WEIGHT if row.role == "assistant" else 1.0)
                pieces = chunk_text(row.text)
                hits.append(Hit(row.id, "message", pieces[chunk], score, sim, when, [row.id], row.role,
                                row.session_id, 0.5, chunk, row.compressed_text if len(pieces) == 1 else None))
            else:
                hits.append(Hit(row.id, row.kind, row.text, hybrid_score(sim, when, row.importance, now), sim, when,
                                list(row.source_ids), importance=row.importance, compressed_text=row.compressed_text))
        hits.sort(key=lambda h: -h.score)
        return hits[:k]


def _aware(t: datetime | None) -> datetime | None:
    if t is None or t.tzinfo is not None:
        return t
    return t.replace(tzinfo=UTC)
