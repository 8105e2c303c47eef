"""The retrievers: each ranks one view of a user's history for a question, and a candidate
keeps its rank in each (`candidate._Cand`).

- `dense`: all-MiniLM-L6-v2 cosine over each message's text (FAISS, one index per user);
- `context`: the same over each message read with the turn it answers (a second vector per
  message; "The cello!" is found by "what did she buy");
- `lexical`: the archive database's own full-text index (FTS5 bm25 / PostgreSQL ts_rank_cd);
- `facts`: reflected facts and insights (FAISS); a matching fact is a hit itself and also
  counts for the messages it rests on (`source_ids`, `fact_sources`);
- `time` / `person` (`Retrievers.vote`): the dense and full-text search restricted to the
  question's time window or to the turns of the people it names;
- `neighbour`: the turns beside the head of the ranking (rank.neighbour_lent), and the
  neighbour turn a recalled one is shown with (`neighbour_contexts`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from datetime import datetime, timedelta

import faiss
import numpy as np

from ..archive import Archive
from ..query import ParsedQuery
from ..records import Memory, Message, own_reply
from .candidate import _MEMORY, _MESSAGE, _Cand
from .index import _VIEW_CONTEXT, _VIEW_SENTENCE, _VIEW_TEXT, IVF_NPROBE, UserIndex

RETRIEVERS = ("dense", "context", "lexical", "facts")
_LABELS = (*RETRIEVERS, "time", "person", "neighbour")
DEPTH = 100  # candidates taken from each retriever
BRIEF_DEPTH = 25  # from each retriever by the search for the event a question is dated by: its best few are used
WINDOW_SLACK = timedelta(days=3)  # the time vote searches this far past the question's window
NEIGHBOUR_WORDS = 12  # a recalled turn this short comes with the turn it answers
NEIGHBOUR_CHARS = 200  # of that neighbour turn, at most
# The dense rankings may read MiniLM's vectors with the directions every turn of this user shares
# taken out (the mean and the top principal components: "all but the top"); the count of
# components is Config.recall_whiten_pcs, 0 (off) by default.
WHITEN_MIN_VECTORS = 256  # fewer vectors than this give noisy components: plain cosine
WHITEN_SAMPLE = 8192  # vectors the components are estimated from
WHITEN_REFIT = 0.25  # estimated again when the vectors have changed in number by this share
WHITEN_QUERY_MEAN = 0.5  # a question shares only part of what the turns share: it loses this much of their mean


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


def _project(x: np.ndarray, mean: np.ndarray, top: np.ndarray) -> np.ndarray:
    """Rows of x less the mean and their parts along `top` (orthonormal rows), unit length."""
    x = x - mean
    x -= (x @ top.T) @ top
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _one_query(index, qvec: np.ndarray, k: int, params=None) -> tuple[np.ndarray, np.ndarray]:
    """`index.search` for one query on one OpenMP thread (this thread's setting, restored after).
    FAISS splits a single query's exact scan over its OpenMP threads; with the full-text search
    running beside it on a pool thread, waking and joining the others costs more than it saves
    (docs/recall.md). Concurrent searches are the service's parallelism."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        return index.search(qvec, k, params=params) if params is not None else index.search(qvec, k)
    finally:
        faiss.omp_set_num_threads(before)


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


def fact_sources(cands: dict[tuple[int, int], _Cand], mems: dict[int, Memory]) -> None:
    """A fact that matches counts for the messages it rests on: each source turn gets the
    best `facts` rank of the active facts citing it, joining the candidates if need be."""
    for c in sorted((c for c in cands.values() if c.kind == _MEMORY), key=lambda c: c.ranks.get("facts", DEPTH)):
        m = mems.get(c.row_id)
        if m is None or m.status != "active" or "facts" not in c.ranks:
            continue
        for sid in m.source_ids:
            src = cands.setdefault((_MESSAGE, sid), _Cand(_MESSAGE, sid))
            src.ranks["facts"] = min(src.ranks.get("facts", DEPTH), c.ranks["facts"])


class Retrievers:
    """The retrievers over one archive. `lock(tenant, user)`: the user's lock, held while
    their FAISS index is read."""

    def __init__(self, archive: Archive, lock: Callable[[str, str], threading.RLock], whiten_pcs: int = 0):
        self.archive = archive
        self._lock = lock
        self.whiten_pcs = whiten_pcs

    def lexical(self, tenant_id: str, user_id: str, ui: UserIndex, terms: list[str], exclude: frozenset,
                 since: datetime | None, until: datetime | None, depth: int = DEPTH) -> tuple[list, list]:
        """The full-text ranking's messages and memories (the latter only where the user has any)."""
        messages = self.archive.lexical_search(tenant_id, user_id, terms, depth, exclude, since, until,
                                               rows=len(ui.messages))
        memories = self.archive.lexical_search(tenant_id, user_id, terms, depth, since=since, until=until,
                                               rows=len(ui.memories),
                                               what="memories") if ui.memories else []
        return messages, memories

    def dense(self, ui: UserIndex, qvec: np.ndarray, use: set[str], exclude: frozenset, cands: dict,
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

    def vote(self, label: str, tenant_id: str, user_id: str, ui: UserIndex, qvec, pq: ParsedQuery,
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
                self.dense(ui, qvec, views, exclude, got, since, until, who=codes, depth=depth)
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
        what a hit reports. Only the over-fetched head (3 x DEPTH and more) is re-ranked: it
        ranks as well as re-ranking every vector would."""
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
        one estimate over both costs the context ranking.
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

