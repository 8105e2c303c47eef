"""The reflection and compression conditions of `agentmem bench memory`.

Each condition imports the same workload into its own tenant (so no condition sees the
questions another one asked) and asks every question through `AgentSession.chat`:
- plain: memory as is (the memory benchmark's own condition, re-run here to get the
  prompt's memory tokens per question);
- reflect: `reflect()` for every user first (templates; `use_model` adds constrained
  decoding), then the questions;
- compressed: every message gets its LLMLingua-compressed text stored once, by the same
  function reflection uses (`compress_messages`), then the questions: recall shows the
  stored compressed text, exactly as in production. Evidence counts only when the recalled
  line still holds the answer: a compressed line that lost the value is not evidence.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from dataclasses import dataclass

from ..compress import BudgetPolicy, Compressor
from ..reflect.job import compress_messages, reflect
from .memory import QUESTION_SEED


@dataclass
class Asked:
    correct: bool
    evidence: bool
    changed: bool
    memory_tokens: int  # recalled-memory lines in the prompt (the header excluded)
    content_tokens: int  # the memory texts alone, without the date and speaker each line adds



# the neighbour turn a recalled message line may end with (assemble.memory_line, Hit.context):
# ` (in reply to NAME: "...")` or ` (NAME answered: "...")`
_NEIGHBOUR = re.compile(r'" \((?:in reply to\b|[^()"]*\banswered: ).*\)$')


def _content(line: str) -> str:
    """The memory text of an assembler recall line (`- DATE WHO: "TEXT"` or `- DATE KIND: TEXT`),
    without the neighbour turn a message line may carry (quoted from that turn as it was said,
    never compressed: counted in the prompt-line ratio, not in the memory text's)."""
    return _NEIGHBOUR.sub('"', line.strip()).split(": ", 1)[-1].strip().strip('"')


def ask_all(store, engine, config, workload, tenant_id: str, max_tokens: int, label: str) -> list[Asked]:
    from ..session import AgentSession

    out = []
    for h in workload:
        s = AgentSession(h.user, tenant_id=tenant_id, config=config, engine=engine, store=store)
        for q in h.questions:
            reply = s.chat(q.text, max_tokens=max_tokens, seed=QUESTION_SEED + len(out))
            tr = s.last_turn
            lines = {seg["ref"]: seg["text"] for seg in tr.segments}
            said = lines.get(f"message:{q.evidence_id}")
            evidence = (said is not None and q.answer.lower() in said.lower()) or any(
                q.evidence_id in m["source_ids"] and q.answer.lower() in lines.get(m["ref"], "").lower()
                for m in tr.memories_used
            )
            recall = [seg for seg in tr.segments if seg["tier"] == "recall" and seg["ref"] != "recall:header"]
            mem = sum(seg["tokens"] for seg in recall)
            content = sum(engine.count_tokens(_content(seg["text"])) for seg in recall)
            out.append(Asked(q.answered_by(reply), evidence, q.old_answer is not None, mem, content))
            print(f"  {label} {h.user} {q.key}: {'ok ' if out[-1].correct else 'bad'} ev={evidence} mem={mem} "
                  f"{reply[:50]!r}", file=sys.stderr)
    return out


def _rate(xs: list[Asked], attr: str, changed_only: bool = False) -> float | None:
    xs = [x for x in xs if x.changed or not changed_only]
    return sum(getattr(x, attr) for x in xs) / len(xs) if xs else None


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


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
    policy = BudgetPolicy(rates={"recall": rate})
    compressor = Compressor(engine)
    t0 = time.perf_counter()
    for h in workload:
        msgs = store.archive.messages("bench-compressed", h.user)
        n = compress_messages(store, "bench-compressed", h.user, msgs, compressor, policy)
        print(f"  compressed {h.user}: {n} messages", file=sys.stderr)
    compress_s = time.perf_counter() - t0
    # the stored compressed texts in every prompt (the assembler's default uses them only
    # when the originals do not fit, which on this workload they do)
    always = config.model_copy(update={"compress_always": True})
    compressed = ask_all(store, engine, always, workload, "bench-compressed", max_tokens, "compressed")

    mem_plain = statistics.mean(x.memory_tokens for x in plain)
    mem_comp = statistics.mean(x.memory_tokens for x in compressed)
    text_plain = statistics.mean(x.content_tokens for x in plain)
    text_comp = statistics.mean(x.content_tokens for x in compressed)
    ev_plain, ev_comp = _rate(plain, "evidence"), _rate(compressed, "evidence")
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
        "compression_ratio": _ratio(text_plain, text_comp),
        "compression_ratio_prompt_lines": _ratio(mem_plain, mem_comp),
        "memory_tokens_mean": mem_plain,
        "memory_tokens_compressed_mean": mem_comp,
        "memory_text_tokens_mean": text_plain,
        "memory_text_tokens_compressed_mean": text_comp,
        "accuracy_compressed": _rate(compressed, "correct"),
        "evidence_recall_plain": ev_plain,
        "evidence_recall_at_10_compressed": ev_comp,
        "evidence_kept_compressed": _ratio(ev_comp, ev_plain) if ev_plain else None,
        "compress_s_per_100_turns": 100 * compress_s / turns,
    }
