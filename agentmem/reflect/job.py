"""One reflection pass over one user's new messages.

Order of work, and why:
1. read the user's messages after the checkpoint (only what the user said: an assistant's
   reply is not evidence about the user);
2. extract facts (templates, then constrained decoding for what they miss);
3. for each fact: skip it if the same message already produced it (reruns and resumed
   crashes add nothing), merge it into an equal active fact (one more mention: more
   important), or add it; a new value in a single-valued slot supersedes the old fact,
   which stays in the archive linked to its successor; the checkpoint advances per message;
4. write insights over clusters of related active facts (embedding clustering);
5. rewrite the "human" core block from the most important active facts, within its limit;
6. give every memory lacking one its compressed text, and precompute chunk KV for the
   hottest memories.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from ..compress import Compressor, compress_memory
from ..tiers import Memory, MemoryStore
from ..tiers.archive import DEFAULT_BLOCK_LIMIT
from .checkpoint import Checkpoints
from .facts import Fact, ModelExtractor, about_user, pattern_facts, same_value, sentences, slot_of

HUMAN_BLOCK = "human"
MENTION_BONUS = 0.05
DUPLICATE_SIMILARITY = 0.92  # cosine of MiniLM embeddings: same statement, other words
CLUSTER_SIMILARITY = 0.45

# precompute(memories) -> how many chunks were stored; the session wires kvreuse in
KVPrecompute = Callable[[list[Memory]], int]


@dataclass
class ReflectReport:
    tenant_id: str
    user_id: str
    messages_read: int = 0
    facts_added: list[int] = field(default_factory=list)
    merged: int = 0
    superseded: list[tuple[int, int]] = field(default_factory=list)  # (old, new)
    insights: list[int] = field(default_factory=list)
    compressed: int = 0
    precomputed: int = 0
    model_sentences: int = 0
    last_message_id: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class _UserFacts:
    """The user's memories, indexed the ways reflection looks them up."""

    def __init__(self, store: MemoryStore, tenant_id: str, user_id: str):
        self.store, self.tenant_id, self.user_id = store, tenant_id, user_id
        self.all = store.list_memories(tenant_id, user_id)
        self.seen = {(s, m.text) for m in self.all for s in m.source_ids}
        self.active = {m.id: m for m in self.all if m.status == "active" and m.kind == "fact"}
        self._vectors: dict[int, np.ndarray] = {}

    def vector(self, m: Memory) -> np.ndarray:
        if m.id not in self._vectors:
            self._vectors[m.id] = self.store.embedder_instance().embed([m.text])[0]
        return self._vectors[m.id]

    def same_slot(self, slot: str) -> list[Memory]:
        return [m for m in self.active.values() if (s := slot_of(m.text)) and s[0] == slot]

    def near_duplicate(self, text: str) -> Memory | None:
        if not self.active:
            return None
        v = self.store.embedder_instance().embed([text])[0]
        best = max(self.active.values(), key=lambda m: float(self.vector(m) @ v))
        return best if float(self.vector(best) @ v) >= DUPLICATE_SIMILARITY else None


def reflect(
    store: MemoryStore,
    engine,
    tenant_id: str,
    user_id: str,
    *,
    compressor: Compressor | None = None,
    use_model: bool = True,
    max_model_sentences: int | None = None,
    kv_precompute: KVPrecompute | None = None,
    hot_memories: int = 8,
) -> ReflectReport:
    """Reflect over the user's messages since the last run. `engine` may be None when
    `use_model` is False and no compressor is given (templates only)."""
    t0 = time.perf_counter()
    report = ReflectReport(tenant_id, user_id)
    checkpoints = Checkpoints(store.archive.engine)
    after = checkpoints.get(tenant_id, user_id)
    ids = store.archive.message_ids(tenant_id, user_id)
    if ids and after > max(ids):
        after = 0  # the user was deleted and recreated: its old checkpoint means nothing
    messages = store.archive.messages(tenant_id, user_id, after_id=after)
    report.last_message_id = after
    facts = _UserFacts(store, tenant_id, user_id)
    extractor = ModelExtractor(engine) if use_model and engine is not None else None
    for msg in messages:
        report.messages_read += 1
        if msg.role == "user":
            for fact in _extract(msg, extractor, report, max_model_sentences):
                _integrate(fact, facts, report, compressor)
        checkpoints.set(tenant_id, user_id, msg.id)
        report.last_message_id = msg.id
    # always: a user may have deleted or corrected a fact since the last run
    report.insights = _write_insights(facts, compressor)
    _update_human_block(store, tenant_id, user_id, facts)
    report.compressed = _backfill_compressed(store, tenant_id, user_id, compressor)
    if kv_precompute is not None:
        hot = sorted(store.list_memories(tenant_id, user_id, status="active"), key=lambda m: -m.importance)
        report.precomputed = kv_precompute(hot[:hot_memories])
    report.seconds = time.perf_counter() - t0
    return report


def _extract(msg, extractor: ModelExtractor | None, report: ReflectReport, budget: int | None) -> list[Fact]:
    out: list[Fact] = []
    for s in sentences(msg.text):
        found = pattern_facts(s, msg.id, msg.time)
        if not found and extractor is not None and about_user(s):
            if budget is not None and report.model_sentences >= budget:
                continue
            report.model_sentences += 1
            fact = extractor.extract(s, msg.id, msg.time)
            found = [fact] if fact else []
        out += found
    return out


def _integrate(fact: Fact, facts: _UserFacts, report: ReflectReport, compressor: Compressor | None) -> None:
    store, t, u = facts.store, facts.tenant_id, facts.user_id
    if (fact.source_id, fact.text) in facts.seen:
        return
    same = [m for m in facts.same_slot(fact.slot) if same_value(slot_of(m.text)[1], fact.value)]
    if not same and fact.how == "model":
        near = facts.near_duplicate(fact.text)
        same = [near] if near else []
    if same:
        m = same[0]
        facts.active[m.id] = store.update_memory(
            t, u, m.id, importance=min(1.0, m.importance + MENTION_BONUS)
        )
        report.merged += 1
        return
    compressed = compress_memory(compressor, fact.text, "fact") if compressor else None
    new = store.add_memory(
        t,
        u,
        fact.text,
        fact.importance,
        source_ids=[fact.source_id],
        kind="fact",
        event_time=fact.event_time,
        compressed_text=compressed,
    )
    facts.seen.add((fact.source_id, fact.text))
    report.facts_added.append(new.id)
    if fact.single or fact.replaces:
        for old in facts.same_slot(fact.slot):
            if fact.event_time is not None and old.time > fact.event_time:
                # told out of order: the stored fact is the newer one
                store.supersede(t, u, new.id, old.id)
                report.superseded.append((new.id, old.id))
                return
            store.supersede(t, u, old.id, new.id)
            del facts.active[old.id]
            report.superseded.append((old.id, new.id))
    facts.active[new.id] = new


def _clusters(facts: _UserFacts) -> list[list[Memory]]:
    """Greedy single-link clustering of active facts by embedding similarity."""
    items = sorted(facts.active.values(), key=lambda m: m.id)
    groups: list[list[Memory]] = []
    for m in items:
        v = facts.vector(m)
        home = next(
            (g for g in groups if max(float(facts.vector(o) @ v) for o in g) >= CLUSTER_SIMILARITY), None
        )
        if home is None:
            groups.append([m])
        else:
            home.append(m)
    return [g for g in groups if len(g) >= 2]


def _insight_text(group: list[Memory]) -> str:
    parts = []
    for m in sorted(group, key=lambda m: (-m.importance, m.id)):
        s = m.text.rstrip(".")
        parts.append(s[len("The user ") :] if s.startswith("The user ") else s[0].lower() + s[1:])
    return "The user " + "; ".join(parts) + "."


def _write_insights(facts: _UserFacts, compressor: Compressor | None) -> list[int]:
    """Insights are recomputed from the active facts; an insight that no longer holds is
    superseded by the new insight sharing most of its sources (or just retired)."""
    store, t, u = facts.store, facts.tenant_id, facts.user_id
    old = [m for m in store.list_memories(t, u, status="active", kind="insight")]
    by_text = {m.text: m for m in old}
    written: list[Memory] = []
    for group in _clusters(facts):
        text = _insight_text(group)
        if text in by_text:
            written.append(by_text.pop(text))
            continue
        sources = sorted({s for m in group for s in m.source_ids})
        importance = max(m.importance for m in group)
        compressed = compress_memory(compressor, text, "insight") if compressor else None
        written.append(
            store.add_memory(
                t, u, text, importance, source_ids=sources, kind="insight", compressed_text=compressed
            )
        )
    for stale in by_text.values():
        heir = max(written, key=lambda w: len(set(w.source_ids) & set(stale.source_ids)), default=None)
        if heir is not None and set(heir.source_ids) & set(stale.source_ids):
            store.supersede(t, u, stale.id, heir.id)
        else:
            store.update_memory(t, u, stale.id, status="superseded")
    return [m.id for m in written]


def _update_human_block(store: MemoryStore, tenant_id: str, user_id: str, facts: _UserFacts) -> None:
    """Lines someone else wrote stay first; reflected facts fill the rest of the limit,
    most important first."""
    blocks = {b.label: b for b in store.core_blocks(tenant_id, user_id)}
    current = blocks.get(HUMAN_BLOCK)
    limit = current.limit if current else None
    kept = [
        ln for ln in (current.value.splitlines() if current else []) if ln and not ln.startswith("- The user")
    ]
    lines = list(kept)
    cap = limit if limit is not None else DEFAULT_BLOCK_LIMIT
    ranked = sorted(facts.active.values(), key=lambda m: (-m.importance, -m.time.timestamp()))
    for m in ranked:
        line = f"- {m.text}"
        if len("\n".join([*lines, line])) <= cap:
            lines.append(line)
    value = "\n".join(lines)
    if current is None or current.value != value:
        store.set_core_block(tenant_id, user_id, HUMAN_BLOCK, value, limit)


def _backfill_compressed(
    store: MemoryStore, tenant_id: str, user_id: str, compressor: Compressor | None
) -> int:
    if compressor is None:
        return 0
    n = 0
    for m in store.list_memories(tenant_id, user_id, status="active"):
        if m.compressed_text is None:
            store.update_memory(
                tenant_id, user_id, m.id, compressed_text=compress_memory(compressor, m.text, m.kind)
            )
            n += 1
    return n
