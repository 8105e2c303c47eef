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
        rate: float | None = None, compress: bool = True, remote: bool = False) -> dict:
    """The benchmark keys of reflection and compression. `prepare(store, engine, config,
    workload, tenant)` imports the workload (the memory benchmark's function). `remote`: the
    reflection on the remote engine's server too (`run_remote`), beside the embedded one;
    without `compress` the compression condition is left out."""
    prepare(store, engine, config, workload, "bench-plain")
    plain = ask_all(store, engine, config, workload, "bench-plain", max_tokens, "plain")

    prepare(store, engine, config, workload, "bench-reflect")
    turns = sum(len(m) for h in workload for m in h.sessions)
    t0 = time.perf_counter()
    facts = 0
    # the embedded reflection: the templates, and with `use_model` the embedded model's constrained
    # decoding (loaded beside a remote engine: it reads the model's tensors)
    local = None
    if use_model:
        from ..engine import local_engine

        local = local_engine(engine, config)
    for h in workload:
        r = reflect(store, local or engine, "bench-reflect", h.user, use_model=use_model)
        facts += len(r.facts_added)
        print(f"  reflect {h.user}: {r.messages_read} messages, {len(r.facts_added)} facts, "
              f"{len(r.superseded)} superseded, {r.seconds:.1f}s", file=sys.stderr)
    reflect_s = time.perf_counter() - t0
    reflected = ask_all(store, engine, config, workload, "bench-reflect", max_tokens, "reflect")
    out = {
        "accuracy_no_reflect": _rate(plain, "correct"),
        "accuracy_reflect": _rate(reflected, "correct"),
        "accuracy_no_reflect_changed": _rate(plain, "correct", True),
        "accuracy_reflect_changed": _rate(reflected, "correct", True),
        "evidence_recall_reflect": _rate(reflected, "evidence"),
        "reflect_s_per_100_turns": 100 * reflect_s / turns,
        "reflect_facts": facts,
        "reflect_facts_per_100_turns": 100 * facts / turns,
        "reflect_model": use_model,
        "memory_tokens_mean": statistics.mean(x.memory_tokens for x in plain),
        "memory_text_tokens_mean": statistics.mean(x.content_tokens for x in plain),
        "evidence_recall_plain": _rate(plain, "evidence"),
    }
    if remote:
        out |= run_remote(store, engine, config, workload, prepare, max_tokens)
    if compress:
        out |= run_compressed(store, engine, config, workload, prepare, max_tokens, rate, plain)
    return out


def run_remote(store, engine, config, workload, prepare, max_tokens: int) -> dict:
    """Reflection with the configured model (reflect/remote.py) on the remote engine's server,
    then the questions on the same engine: the facts it wrote, its calls and tokens per 100
    turns (messages of history), and the accuracy beside the embedded reflection's."""
    from ..reflect.remote import RemoteExtractor

    prepare(store, engine, config, workload, "bench-reflect-remote")
    turns = sum(len(m) for h in workload for m in h.sessions)
    extractor = RemoteExtractor(engine)
    t0 = time.perf_counter()
    facts = superseded = 0
    for h in workload:
        r = reflect(store, None, "bench-reflect-remote", h.user, use_model=False, extractor=extractor)
        facts += len(r.facts_added)
        superseded += len(r.superseded)
        print(f"  reflect-remote {h.user}: {r.messages_read} messages, {len(r.facts_added)} facts, "
              f"{len(r.superseded)} superseded, {r.seconds:.1f}s, {extractor.stats}", file=sys.stderr)
    spent = time.perf_counter() - t0
    asked = ask_all(store, engine, config, workload, "bench-reflect-remote", max_tokens, "reflect-remote")
    st = extractor.stats
    tokens = st["prompt_tokens"] + st["completion_tokens"]
    return {
        "accuracy_reflect_remote": _rate(asked, "correct"),
        "accuracy_reflect_remote_changed": _rate(asked, "correct", True),
        "evidence_recall_reflect_remote": _rate(asked, "evidence"),
        "reflect_remote_facts": facts,
        "reflect_remote_superseded": superseded,
        "reflect_remote_facts_per_100_turns": 100 * facts / turns,
        "reflect_remote_calls_per_100_turns": 100 * st["llm_calls"] / turns,
        "reflect_remote_tokens_per_100_turns": 100 * tokens / turns,
        "reflect_remote_prompt_tokens_per_100_turns": 100 * st["prompt_tokens"] / turns,
        "reflect_remote_completion_tokens_per_100_turns": 100 * st["completion_tokens"] / turns,
        "reflect_remote_s_per_100_turns": 100 * spent / turns,
        "reflect_remote_stats": dict(st),
        "reflect_remote_batch": extractor.batch,
        "reflect_turns": turns,
    }


def run_compressed(store, engine, config, workload, prepare, max_tokens: int, rate: float | None,
                   plain: list[Asked]) -> dict:
    """The compression condition, against the plain one's prompts."""
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
    turns = sum(len(m) for h in workload for m in h.sessions)
    return {
        "compression_rate_setting": rate,
        "compression_ratio": _ratio(text_plain, text_comp),
        "compression_ratio_prompt_lines": _ratio(mem_plain, mem_comp),
        "memory_tokens_compressed_mean": mem_comp,
        "memory_text_tokens_compressed_mean": text_comp,
        "accuracy_compressed": _rate(compressed, "correct"),
        "evidence_recall_at_10_compressed": ev_comp,
        "evidence_kept_compressed": _ratio(ev_comp, ev_plain) if ev_plain else None,
        "compress_s_per_100_turns": 100 * compress_s / turns,
    }
