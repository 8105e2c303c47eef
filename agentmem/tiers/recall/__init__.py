"""The recall store: hybrid retrieval over one tenant and user's messages and memories.

Retrievers, each a ranking of candidates:
- `dense`: all-MiniLM-L6-v2 cosine over each message's text (FAISS, one index per user);
- `context`: the same over each message read with the turn it answers (a second vector per
  message; "The cello!" is found by "what did she buy");
- `lexical`: the archive database's own full-text index (FTS5 bm25 / PostgreSQL ts_rank_cd);
- `facts`: reflected facts and insights (FAISS); a matching fact is a hit itself and also
  counts for the messages it rests on (`source_ids`).

Fusion is reciprocal rank fusion, sum of w / (RRF_K + rank), with a small constant (10): measured on
real multi-session conversations it beat the dense or lexical ranking alone and a
calibrated-score sum, because bm25 and cosine scores are not on one scale. A question that
names a time or a speaker gets one more ranking in the fusion: the same dense and full-text
search restricted to that window (`time`) or to that speaker's turns (`person`: what Priya
said, ranked among Priya's turns only, rather than among everything two people said;
measured on generated conversations, +0.04 recall@10 over a speaker boost alone). Fused
scores are then weighed by what the question says: time ("last week", "in May 2023": turns
inside the window, relative to the conversation's own newest message), people (turns by a
speaker the question names), "when" questions (turns that date something), turns that only
ask (down), and mildly by recency and importance. A per-session decay spreads the top hits over sessions, so a question whose
evidence lies in two sessions gets both.

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
import re
import shutil
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import faiss
import numpy as np

from ..archive import Archive
from ..byte_lru import ByteLRU
from ..keys import context_view, unprefixed, with_keys
from ..query import ParsedQuery, content_terms, information, parse_query, words
from ..records import SENTENCE_BREAK, Hit, Memory, Message, MessageMeta, only_asks, own_reply
from ..specific import TermStats, topical
from ..timeparse import warm_up

CHUNK_CHARS = 1000  # all-MiniLM-L6-v2 reads 256 word pieces, about this many characters
MAX_CHUNKS = 2047  # pieces of one message
HALF_LIFE_DAYS = 30.0
RECENCY_WEIGHT = 0.2
IMPORTANCE_WEIGHT = 0.2
ASSISTANT_WEIGHT = 0.85  # an unnamed assistant turn is the model's own reply: maybe wrong
LOOPED_WEIGHT = 0.5  # a reply the loop detector cut (archive.looped_replies) is weaker evidence still
RETRIEVERS = ("dense", "context", "lexical", "facts")
# "time" / "person": the dense and full-text search inside the question's time window / over
# the turns of the people it names
_LABELS = (*RETRIEVERS, "time", "person", "neighbour")
RRF_K = 10
# a fact is distilled and checked by reflection: its one dense vote weighs more than a turn's
# (the context view weighs as much as the text view since the `person` vote: measured on
# generated seeds 1 and 2, 276 questions, 0.8 -> 1.0 gave +0.01 recall@10)
WEIGHTS = {"dense": 1.0, "context": 1.0, "lexical": 1.0, "facts": 1.5, "time": 1.0, "person": 1.0,
           "neighbour": 0.0}  # a turn found only through its neighbour's rank: no vote of its own
# a turn that only asks ("Read anything good lately?") answers nothing itself; its answer is found
# by the answer's own context view. It weighed 0.75 before; dev seeds 1 / 2 (recall@10, bf16
# MiniLM): 0.75 0.817 / 0.763, 0.5 0.823 / 0.763, 0.3 0.823 / 0.770, 0.15 and 0.05 0.823 / 0.768
QUESTION_WEIGHT = 0.3
WINDOW_SLACK = timedelta(days=3)
DEPTH = 100  # candidates taken from each retriever
# candidates taken from each retriever by the search for the event a question is dated by
# ("the week after her trip to Lisbon"): only its best few hits are used, and its Python work ran
# beside the question's own search, the two taking turns at the GIL (the p95 at 100,000)
BRIEF_DEPTH = 25
# A question dated by another event ("the week after her trip to Lisbon") dates it by the latest of
# the event's best ANCHOR_CANDIDATES hits that scores at least ANCHOR_SHARE of the best one
# (`event_time`). People announce an event before it and tell of it after ("off to Madeira on
# Friday!", then "I'm back, I miss Madeira already"; "under 4 weeks until the defence", then
# "defended yesterday!!"), and the announcement often matches the question best: the window then
# began weeks early. Zen 4 VM, 2026-11-29, recall@10 on generator seeds 1 / 2, hand-written sets 1 / 2, the
# best hit alone 0.826 / 0.768 / 0.874 / 0.803; the latest of 3 at a share of 0.3 / 0.5 / 0.6 /
# 0.7 / 0.8 / 0.9: 0.823 / 0.826 / 0.826 / 0.826 / 0.826 / 0.826 on seed 1, 0.770 on seed 2 (0.768
# at 0.9), 0.878 / 0.879 / 0.879 / 0.885 / 0.885 / 0.880 on the first hand-written set (temporal
# 0.878 -> 0.928 at 0.7), 0.803 throughout on the second; "after" events only, at 0.5: 0.877 there;
# the latest of 5 at 0.5: 0.876.
ANCHOR_CANDIDATES = 3
ANCHOR_SHARE = 0.7
META_CANDIDATES = 100  # message candidates, best fused first, whose metadata the ranking reads
WINDOW_BOOST = 1.6  # a turn inside the question's time window
NEAR_WINDOW_BOOST = 1.2  # within a week of it
NEAR_WINDOW_S = 7 * 86400.0
SPEAKER_BOOST = 1.6  # a turn by a person the question names (real questions name whom they ask about)
MENTION_BOOST = 1.1  # a turn that names them
WHEN_BOOST = 1.15  # a "when" question, and a turn that dates something
NEIGHBOUR_WORDS = 12  # a recalled turn this short comes with the turn it answers
NEIGHBOUR_CHARS = 200  # of that neighbour turn, at most
# A turn at the head of the ranking (the first NEIGHBOUR_HEAD x k) lends this share of its score
# to the turns just before and after it in its session (`_neighbour_support`). Hand-written set
# (6 conversations, 174 questions, recall@10): 0 0.863, 0.1 0.874, 0.15 0.877, 0.2 0.874, 0.3
# 0.867, 0.5 0.853; with 0.2, a head of 1 x k 0.871, 2 x 0.874, 4 x 0.874. Generator dev seeds
# 1 / 2 (2026-11-27): 0.823 / 0.770 -> 0.823 / 0.765 at 0.15 (one which-person question).
NEIGHBOUR_SUPPORT = 0.15
NEIGHBOUR_HEAD = 2
SESSION_DECAY = 0.85  # each further hit from one session counts this much less
# A hit whose words (letters only: repeats differ in their numbers) mostly repeat those of a
# hit already taken ("Working from home today, still in pyjamas at 7pm" / "... at 5pm") adds
# little that the first did not: it counts this much less, so one piece of small talk said
# again and again cannot fill the top k (Jaccard of the two word sets at least
# DUPLICATE_OVERLAP). Dev seeds 1 / 2 of `bench recall` (2026-11-26): 0.792 / 0.745 without;
# overlap 0.6, decay 0.5: 0.817 / 0.753; 0.6, 0.3: 0.823 / 0.758; 0.5, 0.3 (kept): 0.823 /
# 0.778; 0.4, 0.3: 0.823 / 0.783, with seed 2's which-person questions lower. No category fell.
DUPLICATE_OVERLAP = 0.5
DUPLICATE_DECAY = 0.3
# The dense rankings read MiniLM's vectors with the directions every turn of this user shares
# taken out (the mean and the top principal components of their own vectors: "all but the
# top"): a chat's register and recurring small talk make every turn's vector lean the same
# way, and cosine in that direction says "this is a turn of this chat", not "this answers".
# The count of components is Config.recall_whiten_pcs: 0 (off) by default, 8 measured best.
WHITEN_MIN_VECTORS = 256  # fewer vectors than this give noisy components: plain cosine
WHITEN_SAMPLE = 8192  # vectors the components are estimated from
WHITEN_REFIT = 0.25  # estimated again when the vectors have changed in number by this share
# A question is not a turn of the chat: it shares only part of what the turns share, so it
# loses half the turns' mean, not all of it. Measured on bench memory's workload (short
# first-person facts among an assistant's talk; 48 questions, seeds 0 / 1): the evidence ranked
# first for 30 / 27 questions with plain cosine, 24 / 24 with the whole mean taken from the
# question, 30 / 25 with half (mean rank 0.58 / 0.77, 0.73 / 0.73, 0.54 / 0.67); on the recall
# benchmark's dev seeds 1 / 2, search recall@10 0.786 / 0.742 plain, 0.814 / 0.773 whole,
# 0.807 / 0.773 half, 0.786 / 0.758 none.
WHITEN_QUERY_MEAN = 0.5
EMBED_BATCH = 512  # texts a sync embeds (outside the user's lock) before adding them under it
READ_BATCH = 2000  # rows a sync reads at a time
FLUSH_VECTORS = 4096  # save the index after this many new vectors (and on close)
IVF_MIN_VECTORS = 65_536  # from here a user's index is an IVF (an exact scan grows with the history)
IVF_NPROBE = 32  # lists an IVF search visits, of about 2 x sqrt(vectors)
FLUSH_SECONDS = 60.0
COUNT_SECONDS = 60.0  # the index is counted against the archive this often (and on load)
LOOKBACK_IDS = 1000 << 12  # a second of row ids (tiers/ids.py: a millisecond tick above 12 bits)
_MESSAGE, _MEMORY = 0, 1
_VIEW_TEXT, _VIEW_CONTEXT, _VIEW_SENTENCE = 0, 1, 2
SENTENCE_MIN_WORDS = 16  # a turn this long with two sentences or more gets a vector per sentence too
_INDEX_VERSION = 10  # 6: a vector per sentence of long turns; 7: each turn's speaker; 8: word statistics;
# 9: no numerals among them (specific.topical); 10: captions in the text view and the priors (keys.with_keys)
_DATES = re.compile(r"\b(?:yesterday|today|tonight|last|ago|weekend|monday|tuesday|wednesday|thursday|friday|"
                    r"saturday|sunday|january|february|march|april|june|july|august|september|october|november|"
                    r"december|\d{4}|\d{1,2}(?:st|nd|rd|th))\b", re.I)


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


def recency(when: datetime, now: datetime) -> float:
    age_days = max(0.0, (now - when).total_seconds() / 86400.0)
    return math.pow(0.5, age_days / HALF_LIFE_DAYS)


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


@dataclass
class _Cand:
    kind: int
    row_id: int
    ranks: dict[str, int] = field(default_factory=dict)
    chunk: int = 0
    similarity: float = 0.0
    score: float = 0.0
    text_seen: bool = False  # similarity is the best text view's (not the context view's)
    lexical_share: float = 1.0  # its full-text score / the best one's


class _DenseRanks:
    """Per-view ranks from one FAISS result list; tied keys share a rank."""

    def __init__(self, depth: int = DEPTH):
        self.depth = depth
        self.cands: dict[tuple[int, int], _Cand] = {}
        self._next = {"dense": 0, "context": 0, "facts": 0}
        self._last: dict[str, tuple[float, int]] = {}

    def add(self, name: str, kind: int, row_id: int, chunk: int, view: int, sim: float, key: float) -> None:
        """A result, in rank order: `sim` its cosine, `key` what it was ranked by (ties share a rank)."""
        c = self.cands.get((kind, row_id))
        if c is None:
            c = self.cands[(kind, row_id)] = _Cand(kind, row_id, chunk=chunk if view == _VIEW_TEXT else 0,
                                                   similarity=sim)
        if view == _VIEW_TEXT and not c.text_seen:  # results come best first
            c.chunk, c.similarity, c.text_seen = chunk, sim, True
        elif view == _VIEW_SENTENCE and not c.text_seen:  # one of its sentences: the turn is the hit
            c.chunk, c.similarity, c.text_seen = 0, sim, True
        if name in c.ranks or self._next[name] >= self.depth:
            return
        last = self._last.get(name)
        rank = last[1] if last is not None and last[0] == key else self._next[name]
        c.ranks[name] = rank
        self._last[name] = (key, rank)
        self._next[name] += 1

    def short(self, use: set[str]) -> bool:
        """Some message view in use has fewer than `depth` candidates."""
        return any(self._next[v] < self.depth for v in ("dense", "context") if v in use)


def _tied_ranks(found: list[tuple[int, float]]):
    """(rank, id, score / best score) with equal scores sharing a rank."""
    last, rank = None, 0
    top = found[0][1] if found and found[0][1] > 0 else 1.0
    for i, (mid, score) in enumerate(found):
        if score != last:
            rank, last = i, score
        yield rank, mid, max(0.0, score / top)


class Recall:
    def __init__(self, archive: Archive, embedder: Callable[[], object], directory: Path,
                 cache_bytes: int = 256 << 20, whiten_pcs: int = 0):
        self.archive = archive
        self.whiten_pcs = whiten_pcs
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
        warm_up()

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
        """An exact scan costs time in proportion to the history; past IVF_MIN_VECTORS the
        user's vectors move to an inverted-file index (k-means lists, IVF_NPROBE of them
        searched), retrained when the history has grown 4x since. Ids and vectors are kept.

        The IVF holds its vectors in fp16 (`QT_fp16`): a 100,000-message user
        (~220,000 vectors) took ~430 MB in memory as fp32, more than the default cache
        (`recall_cache_mb`) holds, so every other user's search evicted it and its next search
        read it back from disk (~1.1 s). fp16 halves the vectors and their scan (300 of 200,000
        vectors: 0.32 against 0.51 ms); a cosine moves by ~1e-4, far below the gaps that order
        a ranking. An IVF-flat written before is converted when it is loaded."""
        n = ui.index.ntotal
        if n < IVF_MIN_VECTORS or (isinstance(ui.index, faiss.IndexIVFScalarQuantizer)
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
            keys = [k for k in self._locks if k[0] == tenant_id]
        for key in keys:
            with self._lock(*key), self._cache_lock:
                self._indexes.pop(key)
        shutil.rmtree(self._paths(tenant_id, "x")[0].parent, ignore_errors=True)

    # --- search ------------------------------------------------------------------------------
    def search(self, tenant_id: str, user_id: str, query: str, k: int = 10, since: datetime | None = None,
               until: datetime | None = None, exclude_messages: Collection[int] = frozenset(),
               now: datetime | None = None, retrievers: Collection[str] | None = None,
               own_replies: bool = True) -> list[Hit]:
        """The k best messages and memories for `query`, fused from `retrievers` (all by
        default). `since`/`until` are hard filters; time the query itself names is a boost.
        `own_replies=False`: no unnamed assistant turns among the hits (the prompt's notes)."""
        use = set(RETRIEVERS if retrievers is None else retrievers)
        if unknown := use - set(RETRIEVERS):
            raise ValueError(f"unknown retrievers {sorted(unknown)}; known: {list(RETRIEVERS)}")
        if k <= 0 or not use:
            return []
        exclude = frozenset(exclude_messages)
        since, until = _aware(since), _aware(until)
        ui = self.sync(tenant_id, user_id)
        conv_now = datetime.fromtimestamp(ui.newest, UTC) if ui.newest else datetime.now(UTC)
        pq = parse_query(query, sorted(ui.speakers), conv_now)
        dense = bool(use - {"lexical"})
        event_pq = None
        if pq.anchor is not None and since is None and until is None:
            event_pq = parse_query(" ".join([pq.anchor.phrase, *pq.people]), sorted(ui.speakers), conv_now)
        # the question's full-text search needs no vector: it runs on a pool thread while the
        # question is embedded here (both leave the GIL: SQLite's query, torch's forward)
        lexical = None
        if "lexical" in use and dense:
            lexical = _EVENTS.submit(self._lexical, tenant_id, user_id, ui, pq.terms, exclude, since, until)
        # the question and the event it is dated by, in one embedder call, outside the user's lock
        texts = [q.dense_text for q in (pq, event_pq) if q is not None] if dense else []
        try:
            vecs = self.embedder.embed(texts, owner=tenant_id) if texts else None
        except BaseException:
            if lexical is not None:
                lexical.cancel()
            raise
        # the question's own archive reads (its votes, the candidates' metadata and texts, their
        # neighbours) share one transaction: on PostgreSQL each transaction cost a pool checkout
        # with its liveness ping, BEGIN and COMMIT, ~12 of them a search (Zen 5 VM, 2026-11-29, 10,000
        # messages, analysed tables: 63 -> 32 server round trips a search, p50 39-41 -> 32-34 ms;
        # SQLite 16.3 -> 15.3 ms). The pool threads' searches open their own.
        with self.archive.tx():
            event = None
            if event_pq is not None:
                # the event's own search runs beside the question's retrievers, which do not need
                # its date; only the question's time vote waits for it (a dated question cost two
                # searches in a row: the p95 of search at 100,000 messages)
                event = _EVENTS.submit(_released_pool, self._fused, tenant_id, user_id, ui, event_pq,
                                       None if vecs is None else vecs[1:2], use, exclude, ANCHOR_CANDIDATES, None, None, conv_now,
                                       brief=True)
            return self._fused(tenant_id, user_id, ui, pq, None if vecs is None else vecs[:1], use, exclude, k,
                               since, until, now or conv_now, event=event, own_replies=own_replies,
                               lexical=lexical)

    def _fused(self, tenant_id: str, user_id: str, ui: UserIndex, pq: ParsedQuery, qvec: np.ndarray | None,
               use: set[str], exclude: frozenset, k: int, since: datetime | None, until: datetime | None,
               now: datetime, brief: bool = False, event: Future | None = None,
               own_replies: bool = True, lexical: Future | None = None) -> list[Hit]:
        """Candidates from every retriever in `use` and the votes, fused and ranked (`search`).
        `brief`: the hits only, without their neighbour turns (a question's dating event).
        `event`: the search for the event the question is dated by (`pq.anchor`); its best
        hit sets the time window, reckoned from there. `lexical`: the full-text results
        (`_lexical`), already asked for."""
        cands: dict[tuple[int, int], _Cand] = {}
        depth = BRIEF_DEPTH if brief else DEPTH
        with self._lock(tenant_id, user_id):
            if qvec is not None and ui.index.ntotal:
                self._dense(ui, qvec, use, exclude, cands, since, until, depth=depth)
        # the votes belong to the fusion: a single retriever asked for alone is that ranking only
        fused = len(use) > 1
        if fused and pq.people:
            self._vote("person", tenant_id, user_id, ui, qvec, pq, use, exclude, cands, since, until, pq.people,
                       depth=depth)
        if event is not None and (dated := event.result()):
            pq = replace(pq, window=pq.anchor.window(event_time(dated)))
        if fused and pq.window is not None and since is None and until is None:
            self._vote("time", tenant_id, user_id, ui, qvec, pq, use, exclude, cands,
                       pq.window.since - WINDOW_SLACK, pq.window.until + WINDOW_SLACK, depth=depth)
        if "lexical" in use:
            messages, memories = lexical.result() if lexical is not None else \
                self._lexical(tenant_id, user_id, ui, pq.terms, exclude, since, until, depth)
            for kind, found in ((_MESSAGE, messages), (_MEMORY, memories)):
                for rank, mid, share in _tied_ranks(found):
                    c = cands.setdefault((kind, mid), _Cand(kind, mid))
                    c.ranks["lexical"], c.lexical_share = rank, share
        if not cands:
            return []
        return self._rank(tenant_id, user_id, ui, qvec, pq, cands, k, since, until, now, brief, own_replies,
                          exclude if fused and not brief else None)

    def _lexical(self, tenant_id: str, user_id: str, ui: UserIndex, terms: list[str], exclude: frozenset,
                 since: datetime | None, until: datetime | None, depth: int = DEPTH) -> tuple[list, list]:
        """The full-text ranking's messages and memories (the latter only where the user has any)."""
        messages = self.archive.lexical_search(tenant_id, user_id, terms, depth, exclude, since, until,
                                               rows=len(ui.messages))
        memories = self.archive.lexical_search(tenant_id, user_id, terms, depth, since=since, until=until,
                                               rows=len(ui.memories),
                                               what="memories") if ui.memories else []
        return messages, memories

    def _dense(self, ui: UserIndex, qvec: np.ndarray, use: set[str], exclude: frozenset, cands: dict,
               since: datetime | None, until: datetime | None, who: frozenset[int] | None = None,
               depth: int = DEPTH) -> None:
        """Rank messages by each dense view and memories by similarity (equal similarity, equal
        rank). A time or speaker filter (`who`: speaker codes) is a FAISS selector, so the scan
        skips what it excludes instead of fetching past it; over-fetch so the excluded
        messages (the working context) and several vectors per message leave DEPTH per view.
        Over an IVF, a selective filter may find too few vectors in the nearest lists: then
        more lists are visited."""
        lo = since.timestamp() if since is not None else -math.inf
        hi = until.timestamp() if until is not None else math.inf
        filtered = since is not None or until is not None or who is not None
        sel, n = ui.selector(lo, hi, who) if filtered else (None, ui.index.ntotal)
        if n == 0:
            return
        fetch = min(n, 3 * depth + 4 * len(exclude))
        ivf = isinstance(ui.index, faiss.IndexIVF)
        probe = IVF_NPROBE
        while True:
            if ivf:
                params = faiss.SearchParametersIVF(sel=sel, nprobe=probe) if sel is not None else \
                    faiss.SearchParametersIVF(nprobe=probe)
            else:
                params = faiss.SearchParameters(sel=sel) if sel is not None else None
            sims, vids = _one_query(ui.index, qvec, fetch, params)
            got = self._take_dense(ui, *self._whitened(ui, qvec, sims[0], vids[0]), use, exclude, depth)
            if not got.short(use):
                break
            found = int((vids[0] >= 0).sum())
            if found < fetch and ivf and probe < ui.index.nlist:  # the lists searched hold too few
                probe = min(ui.index.nlist, probe * 4)
            elif fetch < n:
                fetch = min(n, fetch * 4)
            else:
                break
        for key, c in got.cands.items():
            have = cands.get(key)
            if have is None:
                cands[key] = c
            else:
                have.ranks.update(c.ranks)

    def _vote(self, label: str, tenant_id: str, user_id: str, ui: UserIndex, qvec, pq: ParsedQuery,
              use: set[str], exclude: frozenset, cands: dict, since: datetime | None = None,
              until: datetime | None = None, speakers: list[str] | None = None, depth: int = DEPTH) -> None:
        """One more ranking: the same dense and full-text search restricted to a part of the
        history, the question's time window (`time`) or the turns of the people it names
        (`person`). Its evidence may rank far down the whole history (cooking in March among
        a year of cooking; what Priya said among everything Tom said) yet first inside that
        part; a boost alone cannot lift what never made the candidates."""
        codes = None if speakers is None else frozenset(ui.codes[n] for n in speakers if n in ui.codes)
        ranks: dict[tuple[int, int], int] = {}
        if qvec is not None and "dense" in use and ui.index.ntotal:
            got: dict[tuple[int, int], _Cand] = {}
            views = {"dense", "context"}  # a turn's best view: "Pachinko!" is found with the question it answers
            with self._lock(tenant_id, user_id):
                self._dense(ui, qvec, views, exclude, got, since, until, who=codes, depth=depth)
            for key, c in got.items():
                if views & c.ranks.keys():
                    ranks[key] = min(c.ranks[v] for v in views & c.ranks.keys())
                    cands.setdefault(key, _Cand(c.kind, c.row_id, chunk=c.chunk, similarity=c.similarity,
                                                text_seen=c.text_seen))
        if "lexical" in use:
            found = self.archive.lexical_search(tenant_id, user_id, pq.terms, depth, exclude, since, until,
                                                rows=len(ui.messages),
                                                speakers=speakers)
            for rank, mid, _ in _tied_ranks(found):
                key = (_MESSAGE, mid)
                ranks[key] = min(rank, ranks.get(key, rank))
                cands.setdefault(key, _Cand(_MESSAGE, mid))
        for key, rank in ranks.items():
            cands[key].ranks[label] = rank

    def _whitened(self, ui: UserIndex, qvec: np.ndarray, sims: np.ndarray, vids: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FAISS's results (best cosine first) in the order of their cosine with the user's
        shared directions taken out (`_whitening`): (order key, cosine, ids). The cosine stays
        what a hit reports. Re-ranking the over-fetched head (3 x DEPTH and more) loses nothing
        against ranking every vector so (dev seeds 1 and 2, plain cosine over the turns: the
        head of 100 re-ranked 0.398 / 0.301 recall@10, all of them 0.398 / 0.301)."""
        keep = vids >= 0
        white = self._whitening(ui)
        if not white or not keep.any():
            return sims, sims, vids
        sims, vids = sims[keep], vids[keep]
        key = sims.copy()
        group = np.fromiter((ui.pieces.get(int(v), (0, 0, 0, -1))[3] == _VIEW_CONTEXT for v in vids), dtype=bool,
                            count=len(vids))
        for context, (mean, top) in white.items():
            sel = group if context else ~group
            if sel.any():
                query = _project(qvec[:1], WHITEN_QUERY_MEAN * mean, top)[0]
                key[sel] = _project(ui.index.reconstruct_batch(vids[sel]), mean, top) @ query
        order = np.argsort(-key, kind="stable")
        return key[order], sims[order], vids[order]

    def _whitening(self, ui: UserIndex) -> dict[bool, tuple[np.ndarray, np.ndarray]]:
        """The mean vector and the top `whiten_pcs` principal components of the user's own
        vectors, for the text views (turns, their sentences, memories) and the context views
        (a turn read after the one it answers) apart: the two are spread differently, and
        one estimate over both cost the context ranking (dev seeds 1 and 2, recall@10 of
        `search`: plain 0.786 / 0.742; one estimate, context views left plain 0.795 / 0.758;
        text views alone, context plain 0.820 / 0.763; each its own 0.814 / 0.773).
        Estimated from a sample once a view has WHITEN_MIN_VECTORS // 2 vectors and the user
        WHITEN_MIN_VECTORS, again when the count has moved by WHITEN_REFIT (called under the
        user's lock); {} below that or with whiten_pcs 0 (plain cosine)."""
        n = ui.index.ntotal
        if n < WHITEN_MIN_VECTORS or self.whiten_pcs == 0:
            return {}
        if ui.white is not None and abs(n - ui.white_n) < WHITEN_REFIT * ui.white_n:
            return ui.white
        groups: dict[bool, list[int]] = {False: [], True: []}
        for vid, piece in ui.pieces.items():
            groups[piece[3] == _VIEW_CONTEXT].append(vid)
        out = {}
        rng = np.random.default_rng(n)
        for context, vids in groups.items():
            if len(vids) < WHITEN_MIN_VECTORS // 2:
                continue
            live = np.asarray(vids, dtype=np.int64)
            if len(live) > WHITEN_SAMPLE:
                live = rng.choice(live, size=WHITEN_SAMPLE, replace=False)
            x = ui.index.reconstruct_batch(live).astype(np.float64)
            mean = x.mean(axis=0)
            centred = x - mean
            _, vecs = np.linalg.eigh(centred.T @ centred)  # ascending eigenvalues
            top = vecs[:, ::-1][:, : self.whiten_pcs].T
            out[context] = (mean.astype(np.float32), np.ascontiguousarray(top, dtype=np.float32))
        ui.white, ui.white_n = out, n
        return out

    def _take_dense(self, ui: UserIndex, keys, sims, vids, use: set[str], exclude: frozenset, depth: int = DEPTH):
        """Per-view ranks from one result list in rank order: `keys` decide ties, `sims` are
        the cosines the candidates report."""
        out = _DenseRanks(depth)
        pieces = ui.pieces
        # as Python numbers once: a few hundred results, each read as a numpy scalar cost more
        for key, sim, vid in zip(np.asarray(keys).tolist(), np.asarray(sims).tolist(), np.asarray(vids).tolist(),
                                 strict=True):
            if vid < 0:
                continue
            piece = pieces.get(vid)
            if piece is None:
                continue
            kind, row_id, chunk, view = piece
            if kind == _MESSAGE and row_id in exclude:
                continue
            name = "facts" if kind == _MEMORY else ("context" if view == _VIEW_CONTEXT else "dense")
            if name in use:
                out.add(name, kind, row_id, chunk, view, sim, key)
        return out

    def _rank(self, tenant_id: str, user_id: str, ui: UserIndex, qvec, pq: ParsedQuery, cands: dict,
              k: int, since, until, now: datetime, brief: bool = False, own_replies: bool = True,
              lend: frozenset | None = None) -> list[Hit]:
        """`lend`: the messages that may not be hits (search's `exclude`) where the head of the
        ranking lends its neighbours support (`_neighbour_support`); None: no support (a single
        retriever asked for alone, or the search for a question's dating event)."""
        mem_ids = [c.row_id for c in cands.values() if c.kind == _MEMORY]
        mems = self.archive.memories_by_id(tenant_id, user_id, mem_ids) if mem_ids else {}
        # a fact that matches counts for the messages it rests on
        for c in sorted((c for c in cands.values() if c.kind == _MEMORY), key=lambda c: c.ranks.get("facts", DEPTH)):
            m = mems.get(c.row_id)
            if m is None or m.status != "active" or "facts" not in c.ranks:
                continue
            for sid in m.source_ids:
                src = cands.setdefault((_MESSAGE, sid), _Cand(_MESSAGE, sid))
                src.ranks["facts"] = min(src.ranks.get("facts", DEPTH), c.ranks["facts"])
        # the archive's metadata (time, speaker, session) only for the head of the fused
        # ranking: the factors applied below multiply a score by at most a few times, and a
        # long question's candidate set holds several hundred turns (a query each way)
        specific = ui.terms.weights([c.row_id for c in cands.values() if c.kind == _MESSAGE])
        msg_cands = [c for c in cands.values() if c.kind == _MESSAGE]
        pre = _pre_scores(ui, msg_cands, pq, specific)
        msg_cands = [c for _, c in sorted(zip(pre, msg_cands, strict=True), key=lambda sc: sc[0], reverse=True)]
        if len(msg_cands) > META_CANDIDATES:
            for c in msg_cands[META_CANDIDATES:]:
                del cands[(c.kind, c.row_id)]
            msg_cands = msg_cands[:META_CANDIDATES]
        meta = self.archive.message_meta(tenant_id, user_id, [c.row_id for c in msg_cands])
        mention = [p.lower() for p in pq.people]
        looped: set[int] | None = None  # read at the first own reply met

        def reply_weight(row: MessageMeta) -> float:
            """The model's own reply is weaker evidence, one the loop detector cut weaker still."""
            nonlocal looped
            if not own_reply(row.role, row.name):
                return 1.0
            if looped is None:
                looped = self._looped(tenant_id, user_id, ui)
            return ASSISTANT_WEIGHT * (LOOPED_WEIGHT if row.id in looped else 1.0)

        def admitted(row: MessageMeta | Memory) -> bool:
            """Inside the search's hard time filters, and not the model's own reply where those are left out."""
            return ((since is None or row.time >= since) and (until is None or row.time <= until)
                    and (own_replies or not isinstance(row, MessageMeta) or not own_reply(row.role, row.name)))

        scored = []
        for c in cands.values():
            row = meta.get(c.row_id) if c.kind == _MESSAGE else mems.get(c.row_id)
            if row is None or (isinstance(row, Memory) and row.status != "active"):
                continue
            if not admitted(row):
                continue
            when = row.time
            if mention and isinstance(row, Memory) and "facts" in c.ranks and any(p in row.text.lower() for p in mention):
                c.ranks["person"] = c.ranks["facts"]  # a fact about the person asked about: their vote too
            score = _fused_score(c)
            score *= 1 - RECENCY_WEIGHT / 2 + RECENCY_WEIGHT / 2 * recency(when, now)
            if isinstance(row, Memory):
                score *= 1 - IMPORTANCE_WEIGHT + IMPORTANCE_WEIGHT * row.importance
            else:
                score *= _text_prior(ui, row.id, specific)
                score *= reply_weight(row)
            if pq.window is not None:
                score *= _window_factor(pq.window, when.timestamp())
            if mention and isinstance(row, MessageMeta) and row.name and row.name.lower() in mention:
                score *= SPEAKER_BOOST
            elif mention and isinstance(row, Memory) and any(p in row.text.lower() for p in mention):
                score *= SPEAKER_BOOST  # a fact about the person asked about: it speaks for them
            c.score = score
            scored.append((c, row))
        scored.sort(key=lambda cr: -cr[0].score)
        if lend is not None and NEIGHBOUR_SUPPORT:
            def allowed(row: MessageMeta) -> bool:
                return row.id not in lend and admitted(row)

            scored = self._neighbour_support(tenant_id, user_id, ui, cands, scored, k, specific, allowed,
                                             reply_weight)
        # texts only for the head of the ranking (the per-session decay and the text boosts
        # below can reorder it, never lift something from far down)
        head = scored[: 4 * k]
        texts = {m.id: m for m in self.archive.messages(tenant_id, user_id,
                                                        ids=[c.row_id for c, _ in head if c.kind == _MESSAGE])}
        for c, _ in head:
            msg = texts.get(c.row_id) if c.kind == _MESSAGE else None
            if msg is None:
                continue
            low = msg.text.lower()
            if mention and not (msg.name and msg.name.lower() in mention) and any(p in low for p in mention):
                c.score *= MENTION_BOOST
            if pq.asks_when and _DATES.search(msg.text):
                c.score *= WHEN_BOOST
        words = {id(c): _letter_words(texts[c.row_id].text if c.row_id in texts else "")
                 if c.kind == _MESSAGE else _letter_words(row.text) for c, row in head}
        picked = _diverse(head, k, lambda cr: cr[1].session_id if isinstance(cr[1], MessageMeta) else None,
                          lambda cr: words[id(cr[0])])
        near = {} if brief else neighbour_contexts(
            self.archive, tenant_id, user_id,
            [texts[c.row_id] for c, _ in picked if c.kind == _MESSAGE and c.row_id in texts])
        return [self._hit(ui, c, row, texts, mems, qvec, near) for c, row in picked]

    def _neighbour_support(self, tenant_id: str, user_id: str, ui: UserIndex, cands: dict, scored: list,
                           k: int, specific: dict[int, float], allowed: Callable[[MessageMeta], bool],
                           reply_weight: Callable[[MessageMeta], float]) -> list:
        """Each turn at the head of the ranking lends NEIGHBOUR_SUPPORT of its score to the turns
        just before and after it in its session, weighed by their own text prior; a neighbour not
        among the candidates joins them. Evidence people mark in a conversation runs over
        adjacent turns ("did my present arrive?" / "it did!!! the tile coasters!", one thought
        split over two messages), and the second turn often shares no word with the question."""
        head = [(c, row) for c, row in scored[: NEIGHBOUR_HEAD * k] if c.kind == _MESSAGE]
        near = self.archive.neighbour_ids(tenant_id, user_id, [(row.id, row.session_id, step)
                                                               for _c, row in head for step in (-1, 1)])
        lent: dict[int, float] = {}
        for c, row in head:
            for step in (-1, 1):
                if (n := near.get((row.id, step))) is not None:
                    lent[n] = max(lent.get(n, 0.0), NEIGHBOUR_SUPPORT * c.score)
        if not lent:
            return scored
        by_id = {c.row_id: (c, row) for c, row in scored if c.kind == _MESSAGE}
        new = [n for n in lent if n not in by_id]
        meta = self.archive.message_meta(tenant_id, user_id, new) if new else {}
        specific = specific | (ui.terms.weights(list(meta)) if meta else {})
        out = list(scored)
        for n, support in lent.items():
            # weighed as the turn's own evidence is: its text, and whether it is the model's own reply
            if n in by_id:
                c, row = by_id[n]
                c.score += support * _text_prior(ui, n, specific) * reply_weight(row)
            elif (row := meta.get(n)) is not None and allowed(row):
                c = cands.setdefault((_MESSAGE, n), _Cand(_MESSAGE, n))
                c.ranks.setdefault("neighbour", 0)
                c.score = support * _text_prior(ui, n, specific) * reply_weight(row)
                out.append((c, row))
        out.sort(key=lambda cr: -cr[0].score)
        return out

    def _looped(self, tenant_id: str, user_id: str, ui: UserIndex) -> set[int]:
        """Replies the loop detector cut, kept per user and topped up from the turns recorded
        since (a second of ids back: another replica's turn may land just below the newest)."""
        with self._lock(tenant_id, user_id):
            got, top = self.archive.looped_since(tenant_id, user_id, max(0, ui.turns_seen - LOOKBACK_IDS))
            ui.looped |= got
            ui.turns_seen = max(ui.turns_seen, top)
            return set(ui.looped)

    def _hit(self, ui: UserIndex, c: _Cand, row, texts: dict[int, Message], mems: dict[int, Memory], qvec,
             near: dict[int, str]) -> Hit:
        found = sorted(c.ranks, key=_LABELS.index)
        if c.kind == _MEMORY:
            return memory_hit(mems[c.row_id], score=c.score, similarity=c.similarity, retrievers=found)
        msg = texts[c.row_id]
        pieces = chunk_text(msg.text)
        chunk = min(c.chunk, len(pieces) - 1)
        sim = c.similarity
        if "dense" not in c.ranks and qvec is not None:  # found otherwise: its cosine, for the record
            vid = ui.vid_of((_MESSAGE, msg.id, chunk, _VIEW_TEXT))
            sim = float(ui.index.reconstruct(vid) @ qvec[0]) if vid is not None else 0.0
        return message_hit(msg, pieces, chunk, score=c.score, similarity=sim, retrievers=found,
                           context=near.get(msg.id))


def message_hit(msg: Message, pieces: list[str], chunk: int = 0, *, score: float = 0.0, similarity: float = 0.0,
                retrievers: list[str] | None = None, context: str | None = None) -> Hit:
    """The hit a stored message's piece `chunk` comes back as (`pieces`: `chunk_text(msg.text)`):
    its compressed form only where it is one piece, its captions (`keys`) with its first piece.
    Recall and reflection's replays build message hits with this one function."""
    return Hit(id=msg.id, kind="message", text=pieces[chunk], score=score, similarity=similarity, time=msg.time,
               source_ids=[msg.id], role=msg.role, session_id=msg.session_id, importance=0.5, chunk=chunk,
               compressed_text=msg.compressed_text if len(pieces) == 1 else None, retrievers=list(retrievers or []),
               name=msg.name, context=context, keys=msg.keys if chunk == 0 else None)


def memory_hit(m: Memory, *, score: float = 0.0, similarity: float = 0.0, retrievers: list[str] | None = None) -> Hit:
    """The hit a stored memory (fact, insight) comes back as."""
    return Hit(id=m.id, kind=m.kind, text=m.text, score=score, similarity=similarity, time=m.time,
               source_ids=list(m.source_ids), importance=m.importance, compressed_text=m.compressed_text,
               retrievers=list(retrievers or []))


def _pre_scores(ui: UserIndex, cands: list[_Cand], pq: ParsedQuery, specific: dict[int, float]) -> list[float]:
    """Each candidate's fused score (`_fused_score`) times the factors of `_rank` that the index's
    own tables can tell for a message: its text prior (`_text_prior`), its time against the
    question's window, its speaker against the people named. The metadata cut keeps the best
    META_CANDIDATES by this: a turn inside the window, by the person asked about, ranked far down
    the whole history ("Which dish did Tom make in July 2022?" among a year of both people
    cooking) must not be cut before its boosts. The people's speaker codes are read once for all
    candidates (~900 at 100,000 messages; timed, ~0.3 ms of a search on the Zen 4 VM, 2026-11-29)."""
    codes = {ui.codes.get(p) for p in pq.people} if pq.people else None
    out = []
    for c in cands:
        r = c.row_id
        f = _text_prior(ui, r, specific)
        if pq.window is not None and (t := ui.times.get(r)) is not None:
            f *= _window_factor(pq.window, t)
        if codes is not None and r in ui.who:
            f *= SPEAKER_BOOST if ui.who[r] in codes else 1.0
        out.append(_fused_score(c) * f)
    return out


def _text_prior(ui: UserIndex, row_id: int, specific: dict[int, float]) -> float:
    """What a message's text says of it as evidence: its information, its specificity (`specific`,
    TermStats.weights), and QUESTION_WEIGHT if it only asks."""
    return ui.info.get(row_id, 1.0) * specific.get(row_id, 1.0) * (QUESTION_WEIGHT if row_id in ui.asks else 1.0)


def event_time(hits: list[Hit]) -> datetime:
    """When the event a question is dated by took place, from its search's hits (best first):
    the latest of those scoring at least ANCHOR_SHARE of the best. An event is announced before
    it happens and told of after; the telling is the later of two strong matches."""
    strong = [h for h in hits[:ANCHOR_CANDIDATES] if h.score >= ANCHOR_SHARE * hits[0].score]
    return max(strong, key=lambda h: h.time).time


def _window_factor(window, t: float) -> float:
    """The boost of a turn or fact at time `t` (unix seconds) for the question's time window:
    WINDOW_BOOST inside, NEAR_WINDOW_BOOST within a week of it, else 1."""
    lo, hi = window.since.timestamp(), window.until.timestamp()
    if lo <= t < hi:
        return WINDOW_BOOST
    return NEAR_WINDOW_BOOST if lo - NEAR_WINDOW_S <= t < hi + NEAR_WINDOW_S else 1.0


def _fused_score(c: _Cand) -> float:
    """Reciprocal-rank fusion of a candidate's votes (the weighted sum of 1 / (RRF_K + rank)),
    a full-text vote weighed down when it matched few of the question's words."""
    score = sum(WEIGHTS[r] / (RRF_K + rank) for r, rank in c.ranks.items())
    if "lexical" in c.ranks:  # a full-text match on one common word of five is a weak vote
        score -= WEIGHTS["lexical"] / (RRF_K + c.ranks["lexical"]) * (1 - math.sqrt(c.lexical_share))
    return score


def _neighbour_step(text: str) -> int:
    """Which neighbour a recalled turn needs to be understood: a question, the turn that
    answers it (+1); a short reply, the turn it answers (-1); a turn that stands alone, none."""
    text = text.strip()
    if text.endswith("?"):
        return 1
    return -1 if len(text.split()) <= NEIGHBOUR_WORDS else 0


def neighbour_contexts(archive: Archive, tenant_id: str, user_id: str, messages: list[Message]) -> dict[int, str]:
    """`Hit.context` for each of these messages that needs one: the neighbour turn, as the
    text the prompt shows beside it. Recall and the hot-segment precompute (reflect) both
    call this, so a message's prompt line, and so its chunk-KV key, is the same in both."""
    wanted = [(m.id, m.session_id, step) for m in messages if (step := _neighbour_step(m.text))]
    near = archive.neighbours(tenant_id, user_id, wanted) if wanted else {}
    out = {}
    for mid, other in near.items():
        if own_reply(other.role, other.name) and (other.id > mid or "?" not in other.text):
            # The model's own words are context only where they asked what a short reply answers
            # ("Blue." in reply to "Which colour would you like?"). A question's answer that is
            # the model's own reply is no evidence, and as a note the small model copies it,
            # wrong answers included (the demo answered "What am I allergic to?" with its earlier
            # answer about the dog, shown as "(answered: ...)" beside that question); its
            # greeting before "I am allergic to peanuts." is noise the model copied as well. The
            # prompt never shows own replies as notes (assemble.note_hits).
            continue
        said = " ".join(other.text.split())
        said = said if len(said) <= NEIGHBOUR_CHARS else said[:NEIGHBOUR_CHARS].rsplit(" ", 1)[0] + " ..."
        if other.id < mid:
            out[mid] = f'in reply to {other.name}: "{said}"' if other.name else f'in reply to: "{said}"'
        else:
            out[mid] = f'{other.name} answered: "{said}"' if other.name else f'answered: "{said}"'
    return out


# the searches for the events dated questions name ("the week after her trip"): a few threads,
# shared by every user (each search waits for its own event, so none waits on another's)
_EVENTS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="recall-event")


def _released_pool(fn: Callable, *args, **kwargs):
    """`fn` on a pool thread that frees its OpenMP workers afterwards (engine/threads.py: idle
    pools on other threads slow the engine's decode)."""
    from ...engine.threads import release_omp_pool  # the engine package imports torch: not at import

    try:
        return fn(*args, **kwargs)
    finally:
        release_omp_pool()


def _project(x: np.ndarray, mean: np.ndarray, top: np.ndarray) -> np.ndarray:
    """Rows of x less the mean and their parts along `top` (orthonormal rows), unit length."""
    x = x - mean
    x -= (x @ top.T) @ top
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


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


_LETTERS = re.compile(r"[^\W\d_]+")


def _letter_words(text: str) -> frozenset[str]:
    return frozenset(_LETTERS.findall(text.lower()))


def _repeats(words: frozenset[str], seen: list[frozenset[str]]) -> bool:
    """Whether `words` mostly repeat one of the word sets `seen` (DUPLICATE_OVERLAP)."""
    return bool(words) and any(len(words & w) >= DUPLICATE_OVERLAP * len(words | w) for w in seen)


def _diverse(ranked: list, k: int, session_of: Callable, words_of: Callable | None = None) -> list:
    """Greedy: each further hit from a session counts SESSION_DECAY less, so the top k spread
    over sessions when their scores are close, and stay together when they are not; a hit that
    repeats the words of one already taken (`words_of`) counts DUPLICATE_DECAY less. The
    order changes, the scores do not (a hit's score is its relevance).
    Each item's session, words and whether it repeats a taken one are read once and updated
    per pick against that pick alone (k x n set overlaps, not k x n x k)."""
    left = list(ranked)
    sessions = [session_of(item) for item in left]
    words = [words_of(item) for item in left] if words_of is not None else None
    repeats = [False] * len(left)
    taken: dict[str, int] = {}
    out = []
    while left and len(out) < k:
        best, best_w = 0, -math.inf
        for i, item in enumerate(left):  # the first of equal weights, as max() takes it
            w = item[0].score * SESSION_DECAY ** taken.get(sessions[i], 0)
            if repeats[i]:
                w *= DUPLICATE_DECAY
            if w > best_w:
                best, best_w = i, w
        out.append(left.pop(best))
        s = sessions.pop(best)
        repeats.pop(best)
        if s is not None:
            taken[s] = taken.get(s, 0) + 1
        if words is not None:
            got = words.pop(best)
            repeats = [r or _repeats(w, [got]) for r, w in zip(repeats, words, strict=True)]
    return out


def _flat16(dim: int) -> faiss.IndexScalarQuantizer:
    """The exact index's storage: every vector scanned, held as fp16 (as the IVF holds them).
    Zen 4 VM, 2026-11-29, 25,000 vectors of 384 dimensions, one query on one thread:
    0.64 ms against 1.45 for fp32 (IndexFlatIP), half the memory, the same top 100; a cosine
    moves by ~1e-4, far below the gaps that order a ranking."""
    return faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)


def _one_query(index, qvec: np.ndarray, k: int, params=None) -> tuple[np.ndarray, np.ndarray]:
    """`index.search` for one query on one OpenMP thread (this thread's setting, restored after).
    FAISS splits a single query's exact scan over its OpenMP threads; on the 2-core VM, with the
    full-text search running beside it on a pool thread, waking and joining the second thread
    cost more than it saved: 25,000 vectors scanned in 4.0 ms on two threads, 1.45 ms on one
    (Zen 4 VM, 2026-11-29; the same top k). Concurrent searches are the service's parallelism."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        return index.search(qvec, k, params=params) if params is not None else index.search(qvec, k)
    finally:
        faiss.omp_set_num_threads(before)


def _index_bytes(ui: UserIndex) -> int:
    """An estimate of a user's index in memory: its vectors (with FAISS's id map; fp16 codes in
    an IVF), and the Python tables beside them, a few hundred bytes per vector and per message."""
    n = ui.index.ntotal
    index = ui.index if isinstance(ui.index, faiss.IndexIVF) else faiss.downcast_index(ui.index.index)
    code = index.code_size  # fp16: 2 bytes a dimension, exact or IVF
    return n * (code + 16) + 250 * (len(ui.pieces) + len(ui.memories)) + 300 * len(ui.messages) + 4096 \
        + ui.terms.nbytes()


def _aware(t: datetime | None) -> datetime | None:
    if t is None or t.tzinfo is not None:
        return t
    return t.replace(tzinfo=UTC)
