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
6. give every memory lacking one its compressed text (messages too, as they are read: what
   recall shows and what chunk KV is keyed on), and precompute chunk KV for the memories the
   user's recent turns recalled most, as exactly the segments the assembler will emit.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

from ..assemble import memory_line
from ..compress import BudgetPolicy, Compressor, compress_memory
from ..engine import Segment
from ..tiers import Hit, Memory, MemoryStore, Message
from ..tiers.archive import DEFAULT_BLOCK_LIMIT
from ..tiers.recall import chunk_text, memory_hit, message_hit, neighbour_contexts
from .checkpoint import Checkpoints
from .facts import Fact, ModelExtractor, about_user, pattern_facts, same_value, sentences, slot_of

HUMAN_BLOCK = "human"
MENTION_BONUS = 0.05
DUPLICATE_SIMILARITY = 0.92  # cosine of MiniLM embeddings: same statement, other words
CLUSTER_SIMILARITY = 0.45

TRACE_TURNS = 200  # recent turns whose recalled memories count as "used"


class KVPrecompute(Protocol):
    """What `agentmem.kvreuse.get_reuse(engine)` returns: stores each segment's chunk KV."""

    def precompute(self, segments: list[Segment]) -> int: ...


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
    messages_compressed: int = 0
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
            self._vectors[m.id] = self.store.embedder_instance().embed([m.text], owner=self.tenant_id)[0]
        return self._vectors[m.id]

    def same_slot(self, slot: str) -> list[Memory]:
        return [m for m in self.active.values() if (s := slot_of(m.text)) and s[0] == slot]

    def near_duplicate(self, text: str) -> Memory | None:
        if not self.active:
            return None
        v = self.store.embedder_instance().embed([text], owner=self.tenant_id)[0]
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
    kv_reuse: KVPrecompute | None = None,
    hot_memories: int = 8,
    policy: BudgetPolicy | None = None,
    extractor=None,
) -> ReflectReport:
    """Reflect over the user's messages since the last run. `engine` may be None when
    `use_model` is False and no compressor is given (templates only). With a `compressor`,
    every message read and every memory written gets its compressed text; with an engine,
    chunk KV of the hottest memories is precomputed through `agentmem.kvreuse` when it is
    enabled (or through `kv_reuse`). `extractor` replaces the embedded model's (the remote
    engine's server: reflect/remote.py); one with `prefetch` gets the pass's sentences at
    once, to ask for them in batches."""
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
    if extractor is None and use_model and engine is not None:
        extractor = ModelExtractor(engine)
    if hasattr(extractor, "prefetch"):
        wanted = [(s, m.id, m.time) for m in messages if m.role == "user" for s in sentences(m.text)
                  if not pattern_facts(s, m.id, m.time) and about_user(s)]
        extractor.prefetch(wanted[:max_model_sentences] if max_model_sentences is not None else wanted)
    for msg in messages:
        report.messages_read += 1
        if msg.role == "user":
            for fact in _extract(msg, extractor, report, max_model_sentences):
                _integrate(fact, facts, report, compressor)
        if compressor is not None:
            report.messages_compressed += compress_messages(store, tenant_id, user_id, [msg], compressor, policy)
        checkpoints.set(tenant_id, user_id, msg.id)
        report.last_message_id = msg.id
    # always: a user may have deleted or corrected a fact since the last run
    report.insights = _write_insights(facts, compressor)
    _update_human_block(store, tenant_id, user_id, facts)
    report.compressed = _backfill_compressed(store, tenant_id, user_id, compressor)
    reuse = kv_reuse if kv_reuse is not None else _engine_reuse(engine)
    if reuse is not None:
        report.precomputed = reuse.precompute(hot_segments(store, tenant_id, user_id, hot_memories,
                                                            compressed=(policy or BudgetPolicy()).always_compress))
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
        create_user=False,
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
                t, u, text, importance, source_ids=sources, kind="insight", compressed_text=compressed,
                create_user=False,
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
    most important first. Only template facts: a model-extracted one ("The user's hobby:
    …") is a guess of the small model, fine to recall when relevant but too noisy to put in
    every prompt."""
    blocks = {b.label: b for b in store.core_blocks(tenant_id, user_id)}
    current = blocks.get(HUMAN_BLOCK)
    limit = current.limit if current else None
    kept = [
        ln for ln in (current.value.splitlines() if current else []) if ln and not ln.startswith("- The user")
    ]
    lines = list(kept)
    cap = limit if limit is not None else DEFAULT_BLOCK_LIMIT
    exact = [m for m in facts.active.values() if (slot := slot_of(m.text)) and not slot[0].startswith("topic:")]
    ranked = sorted(exact, key=lambda m: (-m.importance, -m.time.timestamp()))
    for m in ranked:
        line = f"- {m.text}"
        if len("\n".join([*lines, line])) <= cap:
            lines.append(line)
    value = "\n".join(lines)
    if current is None or current.value != value:
        store.set_core_block(tenant_id, user_id, HUMAN_BLOCK, value, limit, create_user=False)


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


def compress_messages(
    store: MemoryStore,
    tenant_id: str,
    user_id: str,
    messages: list[Message],
    compressor: Compressor,
    policy: BudgetPolicy | None = None,
) -> int:
    """Give each message lacking one its compressed text (the recall tier's rate), once.
    A message long enough to be recalled in pieces keeps its pieces verbatim: the prompt
    shows a piece, and a compressed whole would not match it."""
    todo = {
        m.id: compress_memory(compressor, m.text, "recall", policy)
        for m in messages
        if m.compressed_text is None and len(chunk_text(m.text)) == 1
    }
    if todo:
        store.archive.set_message_compressed(tenant_id, user_id, todo)
    return len(todo)


def _engine_reuse(engine) -> KVPrecompute | None:
    if engine is None:
        return None
    try:
        from ..kvreuse import get_reuse
    except ImportError:  # chunk KV reuse not built into this install
        return None
    return get_reuse(engine)


def _hit(item: Memory | Message, chunk: int = 0, context: str | None = None) -> Hit:
    """The recall hit a stored memory or message comes back as (what `memory_line` reads)."""
    if isinstance(item, Message):
        return message_hit(item, chunk_text(item.text), chunk, context=context)
    return memory_hit(item)


def hot_segments(store: MemoryStore, tenant_id: str, user_id: str, n: int, compressed: bool = False) -> list[Segment]:
    """The recall segments of the user's `n` most used memories: those recalled most often
    in the recent turns' traces, then the most important active facts. Each is built with
    the assembler's own `memory_line` and the tenant as namespace, so its chunk-KV key is
    the one a later prompt will look up."""
    if n <= 0:
        return []
    uses = Counter(
        m["ref"] for t in store.turns(tenant_id, user_id, limit=TRACE_TURNS) for m in t.trace.get("memories_used", [])
    )
    active = {f"memory:{m.id}": m for m in store.list_memories(tenant_id, user_id, status="active")}
    message_ids = {int(r.split(":")[1].split("#")[0]) for r in uses if r.startswith("message:")}
    messages = {m.id: m for m in store.archive.messages(tenant_id, user_id, ids=message_ids)} if message_ids else {}
    near = neighbour_contexts(store.archive, tenant_id, user_id, list(messages.values()))
    hits: list[Hit] = []
    for ref, _ in uses.most_common():
        kind, _, rest = ref.partition(":")
        row_id, _, chunk = rest.partition("#")
        if kind == "memory" and ref in active:
            hits.append(_hit(active[ref]))
        elif kind == "message" and int(row_id) in messages:
            msg = messages[int(row_id)]
            if int(chunk or 0) < len(chunk_text(msg.text)):
                hits.append(_hit(msg, int(chunk or 0), near.get(msg.id)))
    chosen = {h.ref for h in hits}
    for m in sorted(active.values(), key=lambda m: (-m.importance, -m.id)):
        if f"memory:{m.id}" not in chosen:
            hits.append(_hit(m))
    return [Segment(memory_line(h, compressed), cacheable=True, tier="recall", ref=h.ref, namespace=tenant_id) for h in hits[:n]]
