"""The recall store: hybrid retrieval over one tenant and user's messages and memories.

`Recall` is the facade `MemoryStore` uses. Its parts:
- `index`: one FAISS index per user, its files, and keeping it in step with the archive;
- `retrievers`: the rankings candidates come from (dense, context, lexical, facts, and the
  time, person and neighbour votes);
- `rank`: the scoring functions that fuse and weigh them, over a frozen `RankWeights`.

A question that names a time or a speaker gets one more ranking in the fusion: the same dense
and full-text search restricted to that window (`time`) or to that speaker's turns (`person`:
what Priya said, ranked among Priya's turns only, rather than among everything two people
said). The ranking's weights are this package's upper-case names, read at each search.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from ..archive import Archive
from ..query import ParsedQuery, parse_query
from ..records import Hit, Memory, Message, MessageMeta
from ..timeparse import warm_up
from .candidate import _MEMORY, _MESSAGE, _Cand
from .hits import memory_hit, message_hit
from .index import (
    _VIEW_TEXT,
    COUNT_SECONDS,
    IVF_MIN_VECTORS,
    Indexes,
    UserIndex,
    _all_vectors,
    chunk_text,
    sentences,
)
from .rank import (
    DEFAULT_WEIGHTS,
    RankWeights,
    _diverse,
    _letter_words,
    _pre_scores,
    _repeats,
    admitted,
    event_time,
    lent_score,
    neighbour_lent,
    recency,
    score,
    text_boosted,
)
from .retrievers import (
    _LABELS,
    BRIEF_DEPTH,
    DEPTH,
    RETRIEVERS,
    WINDOW_SLACK,
    Retrievers,
    _one_query,
    _project,
    _tied_ranks,
    fact_sources,
    neighbour_contexts,
)

__all__ = ["COUNT_SECONDS", "RETRIEVERS", "RankWeights", "Recall", "UserIndex", "chunk_text", "event_time",
           "memory_hit", "message_hit", "neighbour_contexts", "recency", "sentences",
           # the parts the tests check on their own
           "_all_vectors", "_one_query", "_project", "_repeats"]

# The ranking's weights under the names a search reads them by (`_weights`): setting one on this
# package (an experiment, a test) changes the next search.
HALF_LIFE_DAYS = DEFAULT_WEIGHTS.half_life_days
RECENCY_WEIGHT = DEFAULT_WEIGHTS.recency_weight
IMPORTANCE_WEIGHT = DEFAULT_WEIGHTS.importance_weight
ASSISTANT_WEIGHT = DEFAULT_WEIGHTS.assistant_weight
LOOPED_WEIGHT = DEFAULT_WEIGHTS.looped_weight
WEIGHTS = DEFAULT_WEIGHTS.weights
RRF_K = DEFAULT_WEIGHTS.rrf_k
QUESTION_WEIGHT = DEFAULT_WEIGHTS.question_weight
WINDOW_BOOST = DEFAULT_WEIGHTS.window_boost
NEAR_WINDOW_BOOST = DEFAULT_WEIGHTS.near_window_boost
NEAR_WINDOW_S = DEFAULT_WEIGHTS.near_window_s
SPEAKER_BOOST = DEFAULT_WEIGHTS.speaker_boost
MENTION_BOOST = DEFAULT_WEIGHTS.mention_boost
WHEN_BOOST = DEFAULT_WEIGHTS.when_boost
NEIGHBOUR_SUPPORT = DEFAULT_WEIGHTS.neighbour_support
NEIGHBOUR_HEAD = DEFAULT_WEIGHTS.neighbour_head
SESSION_DECAY = DEFAULT_WEIGHTS.session_decay
DUPLICATE_OVERLAP = DEFAULT_WEIGHTS.duplicate_overlap
DUPLICATE_DECAY = DEFAULT_WEIGHTS.duplicate_decay
ANCHOR_CANDIDATES = DEFAULT_WEIGHTS.anchor_candidates
ANCHOR_SHARE = DEFAULT_WEIGHTS.anchor_share
META_CANDIDATES = DEFAULT_WEIGHTS.meta_candidates


def _weights() -> RankWeights:
    return RankWeights(**{f.name: globals()[f.name.upper()] for f in fields(RankWeights)})


# the searches for the events dated questions name ("the week after her trip"): a few threads,
# shared by every user (each search waits for its own event, so none waits on another's)
_EVENTS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="recall-event")


class Recall(Indexes):
    """The users' indexes (`Indexes`: sync, flush, drop), searched by the retrievers and
    ranked by `rank`."""

    def __init__(self, archive: Archive, embedder: Callable[[], object], directory: Path,
                 cache_bytes: int = 256 << 20, whiten_pcs: int = 0):
        super().__init__(archive, embedder, directory, cache_bytes, ivf_min_vectors=IVF_MIN_VECTORS)
        self.retrievers = Retrievers(archive, self._lock, whiten_pcs)
        warm_up()

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
        w = _weights()
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
            lexical = _EVENTS.submit(self.retrievers.lexical, tenant_id, user_id, ui, pq.terms, exclude, since,
                                     until)
        # the question and the event it is dated by, in one embedder call, outside the user's lock
        texts = [q.dense_text for q in (pq, event_pq) if q is not None] if dense else []
        try:
            vecs = self.embedder.embed(texts, owner=tenant_id) if texts else None
        except BaseException:
            if lexical is not None:
                lexical.cancel()
            raise
        # the question's own archive reads (its votes, the candidates' metadata and texts, their
        # neighbours) share one transaction: on PostgreSQL each transaction costs a pool checkout
        # with its liveness ping, BEGIN and COMMIT. The pool threads' searches open their own.
        with self.archive.tx():
            event = None
            if event_pq is not None:
                # the event's own search runs beside the question's retrievers, which do not need
                # its date; only the question's time vote waits for it
                event = _EVENTS.submit(_released_pool, self._fused, tenant_id, user_id, ui, event_pq,
                                       None if vecs is None else vecs[1:2], use, exclude, w.anchor_candidates,
                                       None, None, conv_now, w, brief=True)
            return self._fused(tenant_id, user_id, ui, pq, None if vecs is None else vecs[:1], use, exclude, k,
                               since, until, now or conv_now, w, event=event, own_replies=own_replies,
                               lexical=lexical)

    def _fused(self, tenant_id: str, user_id: str, ui: UserIndex, pq: ParsedQuery, qvec: np.ndarray | None,
               use: set[str], exclude: frozenset, k: int, since: datetime | None, until: datetime | None,
               now: datetime, w: RankWeights, brief: bool = False, event: Future | None = None,
               own_replies: bool = True, lexical: Future | None = None) -> list[Hit]:
        """Candidates from every retriever in `use` and the votes, fused and ranked (`search`).
        `brief`: the hits only, without their neighbour turns (a question's dating event).
        `event`: the search for the event the question is dated by (`pq.anchor`); its best
        hit sets the time window, reckoned from there. `lexical`: the full-text results
        (`Retrievers.lexical`), already asked for."""
        cands: dict[tuple[int, int], _Cand] = {}
        depth = BRIEF_DEPTH if brief else DEPTH
        with self._lock(tenant_id, user_id):
            if qvec is not None and ui.index.ntotal:
                self.retrievers.dense(ui, qvec, use, exclude, cands, since, until, depth=depth)
        # the votes belong to the fusion: a single retriever asked for alone is that ranking only
        fused = len(use) > 1
        if fused and pq.people:
            self.retrievers.vote("person", tenant_id, user_id, ui, qvec, pq, use, exclude, cands, since, until,
                                 pq.people, depth=depth)
        if event is not None and (dated := event.result()):
            pq = replace(pq, window=pq.anchor.window(event_time(dated, w)))
        if fused and pq.window is not None and since is None and until is None:
            self.retrievers.vote("time", tenant_id, user_id, ui, qvec, pq, use, exclude, cands,
                                 pq.window.since - WINDOW_SLACK, pq.window.until + WINDOW_SLACK, depth=depth)
        if "lexical" in use:
            messages, memories = lexical.result() if lexical is not None else \
                self.retrievers.lexical(tenant_id, user_id, ui, pq.terms, exclude, since, until, depth)
            for kind, found in ((_MESSAGE, messages), (_MEMORY, memories)):
                for rank, mid, share in _tied_ranks(found):
                    c = cands.setdefault((kind, mid), _Cand(kind, mid))
                    c.ranks["lexical"], c.lexical_share = rank, share
        if not cands:
            return []
        return self._rank(tenant_id, user_id, ui, qvec, pq, cands, k, since, until, now, w, brief, own_replies,
                          exclude if fused and not brief else None)

    def _rank(self, tenant_id: str, user_id: str, ui: UserIndex, qvec, pq: ParsedQuery, cands: dict,
              k: int, since, until, now: datetime, w: RankWeights, brief: bool = False, own_replies: bool = True,
              lend: frozenset | None = None) -> list[Hit]:
        """The candidates scored (`rank.score`), the head of them boosted by their texts and
        picked over sessions (`rank._diverse`). `lend`: the messages that may not be hits
        (search's `exclude`) where the head of the ranking lends its neighbours support
        (`_neighbour_support`); None: no support (a single retriever asked for alone, or the
        search for a question's dating event)."""
        mem_ids = [c.row_id for c in cands.values() if c.kind == _MEMORY]
        mems = self.archive.memories_by_id(tenant_id, user_id, mem_ids) if mem_ids else {}
        fact_sources(cands, mems)
        # the archive's metadata (time, speaker, session) only for the head of the fused
        # ranking: the factors applied below multiply a score by at most a few times, and a
        # long question's candidate set holds several hundred turns (a query each way)
        specific = ui.terms.weights([c.row_id for c in cands.values() if c.kind == _MESSAGE])
        msg_cands = [c for c in cands.values() if c.kind == _MESSAGE]
        pre = _pre_scores(ui, msg_cands, pq, specific, w)
        msg_cands = [c for _, c in sorted(zip(pre, msg_cands, strict=True), key=lambda sc: sc[0], reverse=True)]
        if len(msg_cands) > w.meta_candidates:
            for c in msg_cands[w.meta_candidates:]:
                del cands[(c.kind, c.row_id)]
            msg_cands = msg_cands[:w.meta_candidates]
        meta = self.archive.message_meta(tenant_id, user_id, [c.row_id for c in msg_cands])
        mention = [p.lower() for p in pq.people]
        looped = functools.cache(lambda: self._looped(tenant_id, user_id, ui))  # read at the first own reply met
        scored = []
        for c in cands.values():
            row = meta.get(c.row_id) if c.kind == _MESSAGE else mems.get(c.row_id)
            if row is None or (isinstance(row, Memory) and row.status != "active"):
                continue
            if not admitted(row, since, until, own_replies):
                continue
            if mention and isinstance(row, Memory) and "facts" in c.ranks and any(p in row.text.lower() for p in mention):
                c.ranks["person"] = c.ranks["facts"]  # a fact about the person asked about: their vote too
            c.score = score(c, row, ui, pq, mention, specific, now, looped, w)
            scored.append((c, row))
        scored.sort(key=lambda cr: -cr[0].score)
        if lend is not None and w.neighbour_support:
            def allowed(row: MessageMeta) -> bool:
                return row.id not in lend and admitted(row, since, until, own_replies)

            scored = self._neighbour_support(tenant_id, user_id, ui, cands, scored, k, specific, allowed, looped, w)
        # texts only for the head of the ranking (the per-session decay and the text boosts
        # below can reorder it, never lift something from far down)
        head = scored[: 4 * k]
        texts = {m.id: m for m in self.archive.messages(tenant_id, user_id,
                                                        ids=[c.row_id for c, _ in head if c.kind == _MESSAGE])}
        for c, _ in head:
            msg = texts.get(c.row_id) if c.kind == _MESSAGE else None
            if msg is not None:
                c.score = text_boosted(c.score, msg, mention, pq, w)
        words = {id(c): _letter_words(texts[c.row_id].text if c.row_id in texts else "")
                 if c.kind == _MESSAGE else _letter_words(row.text) for c, row in head}
        picked = _diverse(head, k, lambda cr: cr[1].session_id if isinstance(cr[1], MessageMeta) else None,
                          lambda cr: words[id(cr[0])], w)
        near = {} if brief else neighbour_contexts(
            self.archive, tenant_id, user_id,
            [texts[c.row_id] for c, _ in picked if c.kind == _MESSAGE and c.row_id in texts])
        # a row deleted while this search ran (its user or tenant deleted meanwhile) is left out
        return [self._hit(ui, c, row, texts, mems, qvec, near) for c, row in picked
                if c.row_id in (texts if c.kind == _MESSAGE else mems)]

    def _neighbour_support(self, tenant_id: str, user_id: str, ui: UserIndex, cands: dict, scored: list,
                           k: int, specific: dict[int, float], allowed: Callable[[MessageMeta], bool],
                           looped: Callable[[], set[int]], w: RankWeights) -> list:
        """Each turn at the head of the ranking lends neighbour_support of its score to the turns
        just before and after it in its session, weighed by their own text prior; a neighbour not
        among the candidates joins them. Evidence people mark in a conversation runs over
        adjacent turns ("did my present arrive?" / "it did!!! the tile coasters!", one thought
        split over two messages), and the second turn often shares no word with the question."""
        head = [(c, row) for c, row in scored[: w.neighbour_head * k] if c.kind == _MESSAGE]
        near = self.archive.neighbour_ids(tenant_id, user_id, [(row.id, row.session_id, step)
                                                               for _c, row in head for step in (-1, 1)])
        lent = neighbour_lent(head, near, w)
        if not lent:
            return scored
        by_id = {c.row_id: (c, row) for c, row in scored if c.kind == _MESSAGE}
        new = [n for n in lent if n not in by_id]
        meta = self.archive.message_meta(tenant_id, user_id, new) if new else {}
        specific = specific | (ui.terms.weights(list(meta)) if meta else {})
        out = list(scored)
        for n, support in lent.items():
            if n in by_id:
                c, row = by_id[n]
                c.score += lent_score(support, ui, row, specific, looped, w)
            elif (row := meta.get(n)) is not None and allowed(row):
                c = cands.setdefault((_MESSAGE, n), _Cand(_MESSAGE, n))
                c.ranks.setdefault("neighbour", 0)
                c.score = lent_score(support, ui, row, specific, looped, w)
                out.append((c, row))
        out.sort(key=lambda cr: -cr[0].score)
        return out

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


def _released_pool(fn: Callable, *args, **kwargs):
    """`fn` on a pool thread that frees its OpenMP workers afterwards (engine/threads.py: idle
    pools on other threads slow the engine's decode)."""
    from ...engine.threads import release_omp_pool  # the engine package imports torch: not at import

    try:
        return fn(*args, **kwargs)
    finally:
        release_omp_pool()


def _aware(t: datetime | None) -> datetime | None:
    if t is None or t.tzinfo is not None:
        return t
    return t.replace(tzinfo=UTC)
