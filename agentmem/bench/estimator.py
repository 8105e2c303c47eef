"""The chat-mode token estimator's error on the bench conversations (engine/remote_budget.py).

Where the served model's tokenizer is not known (no AGENTMEM_ENGINE_TOKENIZER, no tokenize
endpoint that counts as the local files do), chat mode counts each segment of a prompt with
the default model's files, its own chat wraps included, and `TokenBudget` bounds what the
server will count: the count times a factor (the prior PRIOR_FACTOR, then the largest ratio
the server's `usage.prompt_tokens` showed) plus MARGIN. Here that is set against the real
count: the default model's tokenizer applying its own chat template (add_generation_prompt)
to the messages the server would get (`to_messages`), which is what llama.cpp's server on
the default GGUF counts (`bench memory --engine-api chat` checks it against the server's
usage on a few prompts).

"before": the prior on every prompt; "after": the factor calibrated on the first
CALIBRATION_PROBES prompts, as the engine does with its probes, measured on the rest. The
relative error is (estimate - real) / real; an under-count is a prompt whose bound (with the
margin) is below the real count, the only error that could make a server refuse a turn.

What this cannot show: another model's tokenizer. No other chat model's tokenizer files are
on these machines, so the prior's own error (byte-level BPEs of 32k-256k vocabularies) is
argued in remote_budget.py, not measured here.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ..assemble import QUESTION_HEADER, RECALL_HEADER
from ..engine.engine import Segment
from ..engine.remote import CALIBRATION_PROBES
from ..engine.remote_budget import MARGIN, TokenBudget
from ..engine.remote_chat import to_messages
from ..engine.tokenizer import ChatFormat, chat_format

PERSONA = "You are a helpful assistant."  # tiers/working.py's default persona block
RECENT_TURNS = (0, 2, 6)  # user/assistant pairs of the session before the question, cycled
NOTES = (3, 6, 10)  # recalled lines in the last user message, cycled


def workload_prompts(workload, fmt: ChatFormat) -> list[list[Segment]]:
    """Prompts in the assembler's shape (assemble.py) made of the bench conversations: the
    persona as the system message, a few recent turns of the user's last session, then the
    recalled notes (earlier messages of the user, as `memory_line` writes them) and the
    question, then the generation prefix; one per question, the turns and notes cycling."""
    sys_open, sys_close = fmt.wraps["system"]
    user_open, user_close = fmt.wraps["user"]
    out = []
    for h in workload:
        flat = [m for msgs in h.sessions for m in msgs]
        last = h.sessions[-1]
        for j, q in enumerate(h.questions):
            k = len(out)
            segs = [Segment(f"{sys_open}{PERSONA}\n", tier="system", ref="core:persona"),
                    Segment(sys_close, tier="system", ref="core:end")]
            pairs = RECENT_TURNS[k % len(RECENT_TURNS)]
            for m in last[len(last) - 2 * pairs:] if pairs else []:
                segs.append(Segment(fmt.message(m["role"], m["content"]), tier="recent", ref="turn"))
            segs.append(Segment(user_open + RECALL_HEADER, tier="recall", ref="recall:header"))
            n = NOTES[k % len(NOTES)]
            picks = [q.evidence] + [(q.evidence + 7 * i + j) % len(flat) for i in range(1, n)]
            for i in sorted(set(picks)):
                m = flat[i]
                who = "I said" if m["role"] == "user" else "you said"
                segs.append(Segment(f'- {m["created_at"]:%Y-%m-%d} {who}: "{m["content"]}"\n', tier="recall",
                                    ref=f"message:{i}"))
            segs.append(Segment(QUESTION_HEADER + q.text + user_close, tier="user", ref="user"))
            segs.append(Segment(fmt.generation_prefix, tier="generation", ref="generation"))
            out.append(segs)
    return out


def trace_prompts(traces: Sequence[dict]) -> list[list[Segment]]:
    """The prompts of turns as their traces keep them (`trace["segments"]`)."""
    return [[Segment(s["text"], tier=s.get("tier", ""), ref=s.get("ref")) for s in t["segments"]] for t in traces]


def real_count(tokenizer, messages: list[dict]) -> int:
    """The tokens the model's own template and tokenizer make of `messages`, a reply to follow."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = out["input_ids"] if not isinstance(out, list) else out
    return len(ids)


def counts(tokenizer, prompts: list[list[Segment]], fmt: ChatFormat | None = None) -> list[tuple[int, int]]:
    """(counted as chat mode counts it: each segment with the local files, real) per prompt."""
    fmt = fmt or chat_format(tokenizer)
    out = []
    for segs in prompts:
        counted = sum(len(tokenizer.encode(s.text, add_special_tokens=False)) for s in segs)
        out.append((counted, real_count(tokenizer, to_messages(segs, fmt))))
    return out


def measure(pairs: list[tuple[int, int]], calibrate_on: int = CALIBRATION_PROBES) -> dict:
    """The estimator's error on (counted, real) pairs, before and after calibration."""
    if len(pairs) <= calibrate_on:
        raise ValueError(f"need more than {calibrate_on} prompts (the first calibrate, the rest are measured)")
    before = TokenBudget(False)
    after = TokenBudget(False)
    for counted, real in pairs[:calibrate_on]:
        after.observe(counted, real)
    held = pairs[calibrate_on:]

    def errors(b: TokenBudget, xs) -> dict:
        rel = [(b.estimate(c) - r) / r for c, r in xs]
        room = [(b.upper(c) - r) / r for c, r in xs]
        return {"rel_error_mean": statistics.mean(abs(e) for e in rel), "rel_error_max": max(abs(e) for e in rel),
                "rel_error_signed_mean": statistics.mean(rel), "undercounts": sum(x < 0 for x in room),
                "bound_headroom_min": min(room)}

    b, a = errors(before, pairs), errors(after, held)
    return {"estimator_prompts": len(pairs), "estimator_calibrated_on": calibrate_on,
            "estimator_prior_factor": before.factor, "estimator_calibrated_factor": after.factor,
            "estimator_margin": MARGIN,
            "estimator_real_tokens_mean": statistics.mean(r for _, r in pairs),
            "estimator_counted_to_real_mean": statistics.mean(c / r for c, r in pairs),
            **{f"estimator_{k}_before": v for k, v in b.items()},
            **{f"estimator_{k}_after": v for k, v in a.items()},
            "estimator_reference": "the default model's tokenizer and chat template (tokenizer.apply_chat_template)"}


def workload_error(workload, tokenizer) -> dict:
    """`measure` on `workload_prompts` of `workload`."""
    return measure(counts(tokenizer, workload_prompts(workload, chat_format(tokenizer))))
