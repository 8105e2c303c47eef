"""The reflection and compression conditions of `agentmem bench memory`.

Each condition imports the same workload into its own tenant (so no condition sees the
questions another one asked) and asks every question through `AgentSession.chat`:
- plain: memory as is (the memory benchmark's own condition, re-run here to get the
  prompt's memory tokens per question);
- reflect: `reflect()` for every user first, then the questions;
- compressed: every recalled message shows its LLMLingua-compressed text. The archive has
  no compressed column for messages yet, so the compressed text is computed the first
  time a message is recalled and cached for the run: it depends on the message alone (never
  on the question), so this is the same text a write-time compression would have stored.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, replace

from ..compress import BudgetPolicy, Compressor
from .job import reflect


@dataclass
class Asked:
    correct: bool
    evidence: bool
    changed: bool
    memory_tokens: int  # recalled-memory lines in the prompt (the header excluded)


def ask_all(store, engine, config, workload, tenant_id: str, max_tokens: int, label: str) -> list[Asked]:
    from ..session import AgentSession

    out = []
    for h in workload:
        s = AgentSession(h.user, tenant_id=tenant_id, config=config, engine=engine, store=store)
        for q in h.questions:
            reply = s.chat(q.text, max_tokens=max_tokens)
            tr = s.last_turn
            refs = {seg["ref"] for seg in tr.segments}
            evidence = f"message:{q.evidence_id}" in refs or any(
                q.evidence_id in m["source_ids"] and q.answer.lower() in m["text"].lower() for m in tr.memories_used
            )
            mem = sum(seg["tokens"] for seg in tr.segments if seg["tier"] == "recall" and seg["ref"] != "recall:header")
            out.append(Asked(q.answer.lower() in reply.lower(), evidence, q.old_answer is not None, mem))
            print(f"  {label} {h.user} {q.key}: {'ok ' if out[-1].correct else 'bad'} ev={evidence} mem={mem} "
                  f"{reply[:50]!r}", file=sys.stderr)
    return out


def _rate(xs: list[Asked], attr: str, changed_only: bool = False) -> float | None:
    xs = [x for x in xs if x.changed or not changed_only]
    return sum(getattr(x, attr) for x in xs) / len(xs) if xs else None


class CompressedRecall:
    """Wraps `store.search` so message hits carry their (cached) compressed text."""

    def __init__(self, store, compressor: Compressor, rate: float):
        self.search = store.search
        self.compressor, self.rate = compressor, rate
        self.cache: dict[str, str] = {}
        self.original_tokens = self.compressed_tokens = 0

    def __call__(self, *args, **kw):
        return [self._compressed(h) for h in self.search(*args, **kw)]

    def _compressed(self, hit):
        if hit.kind != "message" or hit.compressed_text:
            return hit
        if hit.text not in self.cache:
            text, stats = self.compressor.compress(hit.text, self.rate)
            self.cache[hit.text] = text
            self.original_tokens += stats.original_tokens
            self.compressed_tokens += stats.compressed_tokens
        return replace(hit, compressed_text=self.cache[hit.text])


def run(store, engine, config, workload, prepare, max_tokens: int, use_model: bool = False,
        rate: float | None = None) -> dict:
    """The benchmark keys of reflection and compression. `prepare(store, engine, config,
    workload, tenant)` imports the workload (the memory benchmark's function)."""
    prepare(store, engine, config, workload, "bench-plain")
    plain = ask_all(store, engine, config, workload, "bench-plain", max_tokens, "plain")

    prepare(store, engine, config, workload, "bench-reflect")
    turns = sum(len(m) for h in workload for m in h.sessions)
    t0 = time.perf_counter()
    facts = 0
    for h in workload:
        r = reflect(store, engine, "bench-reflect", h.user, use_model=use_model)
        facts += len(r.facts_added)
        print(f"  reflect {h.user}: {r.messages_read} messages, {len(r.facts_added)} facts, "
              f"{len(r.superseded)} superseded, {r.seconds:.1f}s", file=sys.stderr)
    reflect_s = time.perf_counter() - t0
    reflected = ask_all(store, engine, config, workload, "bench-reflect", max_tokens, "reflect")

    prepare(store, engine, config, workload, "bench-compressed")
    rate = rate if rate is not None else BudgetPolicy().rate_for("recall")
    wrapper = CompressedRecall(store, Compressor(engine), rate)
    store.search = wrapper
    try:
        compressed = ask_all(store, engine, config, workload, "bench-compressed", max_tokens, "compressed")
    finally:
        del store.search
    mem_plain = statistics.mean(x.memory_tokens for x in plain)
    mem_comp = statistics.mean(x.memory_tokens for x in compressed)
    ev_plain = _rate(plain, "evidence")
    return {
        "accuracy_no_reflect": _rate(plain, "correct"),
        "accuracy_reflect": _rate(reflected, "correct"),
        "accuracy_no_reflect_changed": _rate(plain, "correct", True),
        "accuracy_reflect_changed": _rate(reflected, "correct", True),
        "evidence_recall_reflect": _rate(reflected, "evidence"),
        "reflect_s_per_100_turns": 100 * reflect_s / turns,
        "reflect_facts": facts,
        "reflect_model": use_model,
        "compression_rate_setting": rate,
        "compression_ratio": mem_plain / mem_comp if mem_comp else None,
        "compression_ratio_text": wrapper.original_tokens / wrapper.compressed_tokens if wrapper.compressed_tokens else None,
        "memory_tokens_mean": mem_plain,
        "memory_tokens_compressed_mean": mem_comp,
        "accuracy_compressed": _rate(compressed, "correct"),
        "evidence_recall_plain": ev_plain,
        "evidence_recall_compressed": _rate(compressed, "evidence"),
        "evidence_kept_compressed": _rate(compressed, "evidence") / ev_plain if ev_plain else None,
    }
