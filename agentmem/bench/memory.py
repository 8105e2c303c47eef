"""`agentmem bench memory`: multi-session memory QA on a seeded synthetic workload.

Each user states personal facts early, changes some of them in a later session, and talks
about unrelated things for hundreds of turns; a new session then asks about every fact.
History is imported with `add_messages` (no generation), so only the questions run the model.

Conditions, all on the same engine and workload:
- memory: `AgentSession.chat` (recall + working context + summary), the system under test;
- full context: the same model given as much of the raw history as fits the window
  (newest kept), the usual baseline.
Each condition is a function (`run_memory`, `run_full_context`) taking a prepared workload,
so other conditions (reflection, compression) can be added next to them.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

# (key, statement, change statement or None, question, values). The questions share no content
# word with their statements (tests/tiers/test_recall.py checks it): a question that repeats its
# evidence's words measures nothing, and real users ask "what do I do for a living?".
FACTS = [
    ("dog", "My dog is called {v}.", "We renamed our dog, he is called {v} now.", "What name did I give my four-legged friend?",
     ["Biscuit", "Pepper", "Mango", "Ziggy", "Noodle", "Waffles"]),
    ("city", "I live in {v}.", "I moved last month, I live in {v} now.", "Which town is home for me these days?",
     ["Lisbon", "Denver", "Osaka", "Nairobi", "Krakow", "Tampere"]),
    ("job", "I work as a {v}.", "I changed careers, I now work as a {v}.", "What do I do for a living?",
     ["nurse", "carpenter", "pilot", "librarian", "chemist", "baker"]),
    ("color", "My favorite color is {v}.", "My favorite color changed, it is {v} now.", "Which shade do I like best?",
     ["teal", "maroon", "amber", "violet", "olive", "crimson"]),
    ("sister", "My sister's name is {v}.", None, "What is my female sibling called?",
     ["Greta", "Ingrid", "Priya", "Marisol", "Yuki", "Esther"]),
    ("car", "I drive a {v}.", "I sold my old car and now drive a {v}.", "Which vehicle do I own?",
     ["Volvo", "Subaru", "Tesla", "Fiat", "Skoda", "Mazda"]),
    ("instrument", "I play the {v}.", "I gave up my old instrument, now I play the {v}.", "What do I make music with?",
     ["cello", "banjo", "trumpet", "harp", "oboe", "ukulele"]),
    ("allergy", "I am allergic to {v}.", None, "Which substance gives me a bad reaction?",
     ["peanuts", "shellfish", "penicillin", "pollen", "latex", "sesame"]),
]
TOPICS = ["medieval castles", "tide pools", "board games", "the history of clocks", "mountain weather",
          "origami", "space probes", "coral reefs", "jazz records", "old maps", "bird migration", "chess openings",
          "volcanoes", "street photography", "lighthouses", "tea ceremonies", "desert plants", "train timetables",
          "glass blowing", "Roman roads", "crossword puzzles", "northern lights", "beekeeping", "sailing knots"]
ACTIVITIES = ["read an article", "watched a documentary", "listened to a podcast", "had a long walk",
              "visited a museum", "talked with a neighbour", "cleaned the garage", "tried a new recipe"]
FILLERS = ["It was more interesting than I expected.", "I keep coming back to it in my head.",
           "Some of the details were surprising.", "It took most of the afternoon.",
           "I should probably write some notes about it.", "A friend recommended it to me weeks ago."]
REPLIES = ["{t} is a rich subject; people often find the small details the most rewarding.",
           "That sounds like a good way to spend the day. {t} has a long and curious history.",
           "Many people enjoy {t}; it rewards patience and a bit of curiosity.",
           "Thanks for sharing. If you want, we can look at {t} in more depth next time."]
BASE_TIME = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
QUESTION_SEED = 1000  # replies are sampled with the model's defaults; each question has its own seed
SEED_STEP = 100  # --sampling-seeds: the i-th repeat's question seeds start at QUESTION_SEED + i * SEED_STEP


@dataclass
class Question:
    user: str
    key: str
    text: str
    answer: str
    old_answer: str | None
    evidence: int  # index into the user's history of the message that holds the answer
    evidence_id: int = 0  # its archive id, once imported

    def answered_by(self, reply: str) -> bool:
        """Whether `reply` names the current value as a word, in the singular or plural
        ("peanut" for "peanuts", "Subaru's"); a value inside another word ("pilot" in
        "autopilot") does not count."""
        stem = self.answer.lower().removesuffix("s")
        return re.search(rf"\b{re.escape(stem)}(s|es|'s)?\b", reply.lower()) is not None


@dataclass
class UserHistory:
    user: str
    sessions: list[list[dict]]
    questions: list[Question] = field(default_factory=list)


def build_workload(seed: int, users: int, facts: int, turns: int, sessions: int, change_frac: float) -> list[UserHistory]:
    """Deterministic histories: facts in session 1, changes in the last past session,
    `turns` messages per user in all (user/assistant pairs of distractor talk around them)."""
    rng = random.Random(seed)
    if not 1 <= facts <= len(FACTS):
        raise SystemExit(f"--facts must be in 1..{len(FACTS)}")
    if sessions < 2:
        raise SystemExit("--sessions must be at least 2 (facts first, changes later)")
    out = []
    for u in range(users):
        name = f"user{u}"
        chosen = rng.sample(FACTS, facts)
        per_session = max(2, turns // sessions // 2)  # pairs per session
        convo: list[list[dict]] = []
        idx = 0
        questions = []
        changeable = [f for f in chosen if f[2] is not None]
        changed = set(f[0] for f in rng.sample(changeable, round(change_frac * len(changeable))))
        first: dict[str, tuple[str, int]] = {}
        for s in range(sessions):
            msgs: list[dict] = []
            pairs = [_distractor(rng) for _ in range(per_session)]
            if s == 0:
                stated = [(f, f[1].format(v=f[4][u % len(f[4])])) for f in chosen]
            elif s == sessions - 1 and changed:
                stated = [(f, f[2].format(v=f[4][(u + 3) % len(f[4])])) for f in chosen if f[0] in changed]
            else:
                stated = []
            slots = sorted(rng.sample(range(per_session), min(len(stated), per_session)))
            for p, (user_text, reply) in enumerate(pairs):
                if slots and p == slots[0]:
                    slots.pop(0)
                    f, text = stated.pop(0)
                    first[f[0]] = (text, idx)
                    msgs.append({"role": "user", "content": text})
                    msgs.append({"role": "assistant", "content": "Thanks, I will remember that."})
                    idx += 2
                msgs.append({"role": "user", "content": user_text})
                msgs.append({"role": "assistant", "content": reply})
                idx += 2
            convo.append(msgs)
        t = BASE_TIME + timedelta(days=30 * u)
        for s, msgs in enumerate(convo):
            for i, m in enumerate(msgs):
                m["created_at"] = t + timedelta(days=7 * s, minutes=2 * i)
        for f in chosen:
            now = f[4][(u + 3) % len(f[4])] if f[0] in changed else f[4][u % len(f[4])]
            old = f[4][u % len(f[4])] if f[0] in changed else None
            questions.append(Question(name, f[0], f[3], now, old, first[f[0]][1]))
        out.append(UserHistory(name, convo, questions))
    return out


def _distractor(rng: random.Random) -> tuple[str, str]:
    t1, t2 = rng.sample(TOPICS, 2)
    user = (f"Yesterday I {rng.choice(ACTIVITIES)} and it made me think about {t1}. {rng.choice(FILLERS)} "
            f"{rng.choice(FILLERS)} Do you know anything interesting about {t2}?")
    return user, rng.choice(REPLIES).format(t=t2.capitalize())


# --- conditions ---------------------------------------------------------------------------------
@dataclass
class Outcome:
    correct: bool
    evidence: bool  # the evidence reached the assembled prompt (after budgeting)
    prompt_tokens: int
    seconds: float
    reply: str
    recalled: bool | None = None  # the evidence is in `search(question, k=10)`
    decode_tok_s: float | None = None  # the reply's tokens after the first, per second of decoding


def prepare(store, engine, config, workload: list[UserHistory], tenant_id: str) -> None:
    """Import every user's history into `tenant_id` (one AgentSession per past session)."""
    from ..session import AgentSession

    for h in workload:
        flat: list[int] = []
        for msgs in h.sessions:
            s = AgentSession(h.user, tenant_id=tenant_id, config=config, engine=engine, store=store)
            flat += [m.id for m in s.add_messages(msgs)]
        for q in h.questions:
            q.evidence_id = flat[q.evidence]
        print(f"  imported {h.user}: {len(flat)} messages", file=sys.stderr)


def run_memory(store, engine, config, workload: list[UserHistory], tenant_id: str, max_tokens: int,
               seed_base: int = QUESTION_SEED) -> list[Outcome]:
    """Ask every question in a new session of each user, through `AgentSession.chat`."""
    from ..session import AgentSession

    out = []
    for h in workload:
        s = AgentSession(h.user, tenant_id=tenant_id, config=config, engine=engine, store=store)
        for q in h.questions:
            t0 = time.perf_counter()
            # the default sampling, seeded per question: the same run gives the same replies
            reply = s.chat(q.text, max_tokens=max_tokens, seed=seed_base + len(out))
            dt = time.perf_counter() - t0
            tr = s.last_turn
            hits = s.search(q.text, k=10)
            found = any(h.id == q.evidence_id if h.kind == "message" else q.evidence_id in h.source_ids for h in hits)
            refs = {seg["ref"] for seg in tr.segments}
            evidence = f"message:{q.evidence_id}" in refs or any(
                q.evidence_id in m["source_ids"] and q.answer.lower() in m["text"].lower() for m in tr.memories_used)
            out.append(Outcome(q.answered_by(reply), evidence, tr.stats.prompt_tokens, dt, reply, found,
                               _decode_rate(tr.stats)))
            print(f"  memory {h.user} {q.key}: {'ok ' if out[-1].correct else 'bad'} ev={evidence} "
                  f"{tr.stats.prompt_tokens} tok {dt:.2f}s {reply[:60]!r}", file=sys.stderr)
    return out


def run_full_context(engine, workload: list[UserHistory], window: int, max_tokens: int) -> list[Outcome]:
    """The same model, the raw history newest-first until the window is full, then the question."""
    out = []
    for h in workload:
        history = [m for msgs in h.sessions for m in msgs]
        for q in h.questions:
            tail = [engine.format_message("user", q.text), engine.chat.generation_prefix]
            room = window - sum(engine.count_tokens(t) for t in tail)
            kept: list[str] = []
            first_kept = len(history)
            for i in range(len(history) - 1, -1, -1):
                text = engine.format_message(history[i]["role"], history[i]["content"])
                n = engine.count_tokens(text)
                if n > room:
                    break
                kept.insert(0, text)
                room -= n
                first_kept = i
            t0 = time.perf_counter()
            g = engine.generate("".join(kept + tail), max_tokens=max_tokens, temperature=0.0)
            dt = time.perf_counter() - t0
            out.append(Outcome(q.answered_by(g.text), q.evidence >= first_kept,
                               g.stats.prompt_tokens, dt, g.text))
            print(f"  full {h.user} {q.key}: {'ok ' if out[-1].correct else 'bad'} {g.stats.prompt_tokens} tok "
                  f"{dt:.2f}s {g.text[:60]!r}", file=sys.stderr)
    return out


def history_tokens(engine, workload: list[UserHistory]) -> list[int]:
    return [sum(engine.count_tokens(engine.format_message(m["role"], m["content"])) for msgs in h.sessions for m in msgs)
            for h in workload for _ in h.questions]


def _decode_rate(stats) -> float | None:
    """Decode tokens per second of one generation (its first token is prefill's)."""
    spent = getattr(stats, "total_s", 0.0) - getattr(stats, "ttft_s", 0.0)
    return (stats.completion_tokens - 1) / spent if stats.completion_tokens > 1 and spent > 0 else None


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]


def summarize(outcomes: list[Outcome]) -> dict:
    n = len(outcomes)
    recalled = [o.recalled for o in outcomes if o.recalled is not None]
    return {"accuracy": sum(o.correct for o in outcomes) / n, "evidence": sum(o.evidence for o in outcomes) / n,
            "recalled": sum(recalled) / len(recalled) if recalled else None,
            "prompt_tokens_mean": statistics.mean(o.prompt_tokens for o in outcomes),
            "p50": _pct([o.seconds for o in outcomes], 0.5), "p95": _pct([o.seconds for o in outcomes], 0.95),
            "decode_tok_s": statistics.median(rates) if (rates := [o.decode_tok_s for o in outcomes
                                                                   if o.decode_tok_s is not None]) else None}


def run_engine(config, args, with_conditions: bool) -> tuple[dict, list[Outcome]]:
    """The workload on `config`'s engine (remote when `config.engine_url` is set) and a store
    of its own: import, the memory condition, and with `with_conditions` the full-context
    baseline and the reflection conditions as asked."""
    from ..engine import load_engine
    from ..tiers import MemoryStore

    print(f"loading engine and embedder (data in {config.data_dir})", file=sys.stderr)
    engine = load_engine(config)  # AGENTMEM_ENGINE_URL: a remote inference server answers
    store = MemoryStore(config)
    workload = build_workload(args.seed, args.users, args.facts, args.turns, args.sessions, args.change_frac)
    t0 = time.perf_counter()
    prepare(store, engine, config, workload, "bench")
    import_s = time.perf_counter() - t0
    outcomes = run_memory(store, engine, config, workload, "bench", args.max_tokens)
    mem = summarize(outcomes)
    hist = history_tokens(engine, workload)
    result = {
        "evidence_recall_at_10": mem["recalled"],
        "evidence_in_prompt": mem["evidence"],
        "answer_accuracy": mem["accuracy"],
        "full_context_accuracy": None,
        "prompt_tokens_mean": mem["prompt_tokens_mean"],
        "history_tokens_mean": statistics.mean(hist),
        "prompt_to_history": mem["prompt_tokens_mean"] / statistics.mean(hist),
        "turn_p50_s": mem["p50"],
        "turn_p95_s": mem["p95"],
        # the median memory turn's decode speed, as an app calling AgentSession.chat gets it
        # (an engine of its own loop, the embedder and the store in one process)
        "decode_tok_s": mem["decode_tok_s"],
    }
    if args.sampling_seeds > 1:
        # the small model's answers turn on its sampling: the same condition under other
        # seeds, each in a tenant of its own (a question asked once is not in another's history)
        accs = [mem["accuracy"]]
        for i in range(1, args.sampling_seeds):
            prepare(store, engine, config, workload, f"bench-seed{i}")
            again = run_memory(store, engine, config, workload, f"bench-seed{i}", args.max_tokens,
                               seed_base=QUESTION_SEED + SEED_STEP * i)
            accs.append(summarize(again)["accuracy"])
        result |= {"answer_accuracy_by_seed": accs, "answer_accuracy_mean": statistics.mean(accs)}
    if with_conditions and not args.no_baseline:
        window = args.window or engine.context_window - args.max_tokens - 1
        full = summarize(run_full_context(engine, workload, window, args.max_tokens))
        result |= {"full_context_accuracy": full["accuracy"], "full_context_evidence": full["evidence"],
                   "full_context_prompt_tokens_mean": full["prompt_tokens_mean"],
                   "full_context_turn_p50_s": full["p50"], "full_context_window": window}
    if with_conditions and not args.no_reflect:
        from .memory_reflect import run as run_reflect_conditions

        result |= run_reflect_conditions(store, engine, config, workload, prepare, args.max_tokens,
                                         use_model=args.reflect_model, rate=args.compress_rate,
                                         compress=not args.no_compress,
                                         remote=bool(config.engine_url) and config.reflect_engine == "remote")
    result |= {"questions": len(hist), "users": args.users, "turns_per_user": args.turns, "seed": args.seed,
               "import_s": import_s, "recall_k": config.recall_k, "context_budget": config.context_budget,
               "model": engine.model_id, "sampling": dict(engine.sampling_defaults)}
    if config.engine_url:  # what the server reported over the memory turns (remote.RemoteStats)
        traces = [t.trace for h in workload for t in store.turns("bench", h.user, limit=1000)]
        stats = [tr["stats"] for tr in traces]
        cached = [st["server"]["cached_tokens"] for st in stats if st.get("server")]
        result |= {"engine": "remote", "server": config.engine_url,
                   "token_counts": "server" if engine.counts_on_server else "local tokenizer files",
                   "server_prompt_tokens": sum(st["prompt_tokens"] for st in stats),
                   "server_cached_tokens": None if None in cached else sum(cached),
                   "server_cached_token_share": None if None in cached or not stats else
                   sum(cached) / sum(st["prompt_tokens"] for st in stats)}
        if None in cached:
            result["server_cached_tokens_reason"] = ("the server reported no cached tokens (no usage."
                                                     "prompt_tokens_details.cached_tokens, no timings.cache_n)")
        result["engine_api"] = engine.api
        if engine.api == "chat":
            result |= chat_turns(engine, traces)
    else:
        result |= {"engine": "embedded", "dtype": str(engine.dtype).removeprefix("torch."),
                   "weights": engine.weights, "device": str(engine.device)}
    store.close()
    return result, outcomes


def chat_turns(engine, traces: list[dict], checked: int = 3) -> dict:
    """Chat mode's figures over the memory turns: the messages a turn sent, the budget's state
    at the end, and the token estimator's error on these turns' prompts (bench/estimator.py:
    the bound an unknown model's tokenizer would get, against the default model's own count),
    whose reference count is checked against the server's `usage.prompt_tokens` (a one-token,
    unstreamed reply) on the first `checked` prompts."""
    from ..engine.remote_chat import to_messages
    from .estimator import counts, measure, trace_prompts

    prompts = trace_prompts(traces)
    pairs = counts(engine.tokenizer, prompts, engine.chat)
    out = {"chat_messages_mean": statistics.mean(t["stats"]["server"]["messages"] for t in traces),
           "chat_dropped_notes": sum(t["stats"]["server"]["dropped_notes"] for t in traces),
           "chat_budget": engine.budget.to_dict()}
    if len(pairs) > 3:
        out |= measure(pairs)
    agree = 0
    for segs, (_, real) in list(zip(prompts, pairs, strict=True))[:checked]:
        r = engine.http.post("/v1/chat/completions", json={"model": engine.model_id, "max_tokens": 1,
                                                           "messages": to_messages(segs, engine.chat)})
        agree += (r.json().get("usage") or {}).get("prompt_tokens") == real
    out |= {"estimator_reference_checked": min(checked, len(pairs)), "estimator_reference_matches_server": agree}
    return out


def server_log_share(log: str, prompt_tokens: int) -> dict:
    """The cached-token share llama-cpp-python's own log gives for this run (engine/llama_server.py)."""
    from ..engine.llama_server import log_cache_hits

    hits = log_cache_hits(log)
    return {"server_log": hits, "server_log_cached_token_share": hits["cached_tokens"] / prompt_tokens
            if prompt_tokens else None,
            "server_log_source": "llama-cpp-python server log: Llama.generate: N prefix-match hit, per completion"}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agentmem bench memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--facts", type=int, default=5, help=f"facts (and questions) per user, at most {len(FACTS)}")
    ap.add_argument("--turns", type=int, default=300, help="messages of history per user")
    ap.add_argument("--sessions", type=int, default=4, help="past sessions per user")
    ap.add_argument("--change-frac", type=float, default=0.4, help="share of changeable facts changed later")
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="reply length; short enough to be quick, long enough not to cut an answer's sentence")
    ap.add_argument("--sampling-seeds", type=int, default=1,
                    help="ask every question under this many sampling seeds (answer_accuracy_mean); "
                         "the 135M model's accuracy on 15 questions moves by a question or two with the seed")
    ap.add_argument("--window", type=int, default=None, help="full-context baseline window (default: the model's)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the full-context baseline")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-reflect", action="store_true", help="skip the reflection and compression conditions")
    ap.add_argument("--reflect-model", action="store_true", help="reflection also uses constrained decoding")
    ap.add_argument("--compress-rate", type=float, default=None, help="LLMLingua rate for recalled messages")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 user, 4 facts, 60 turns, no baseline")
    ap.add_argument("--llama-server", action="store_true",
                    help="start llama-cpp-python's server on the default GGUF and run remote (engine: remote)")
    ap.add_argument("--llama-ctx", type=int, default=8192, help="with --llama-server: its context window")
    ap.add_argument("--llama-threads", type=int, default=1, help="with --llama-server: its threads")
    ap.add_argument("--embedded-peer", action="store_true",
                    help="remote runs: the same workload on the embedded engine too, in this run")
    ap.add_argument("--engine-url", default=None,
                    help="an OpenAI-compatible server answers (engine: remote), as AGENTMEM_ENGINE_URL")
    ap.add_argument("--engine-api", choices=("auto", "chat", "completions"), default=None,
                    help="remote runs: the server's route (AGENTMEM_ENGINE_API); chat adds the estimator's error")
    ap.add_argument("--no-compress", action="store_true", help="skip the compression condition")
    ap.add_argument("--reflect-remote", action="store_true",
                    help="remote runs: reflection on the server too (AGENTMEM_REFLECT_ENGINE=remote), beside the "
                         "embedded reflection")
    args = ap.parse_args(argv)
    if args.engine_url and args.llama_server:
        ap.error("--engine-url and --llama-server both name the server: give one")
    if args.sampling_seeds < 1:
        ap.error("--sampling-seeds must be at least 1")
    if args.quick:
        args.users, args.facts, args.turns, args.no_baseline = 1, 4, 60, True

    from contextlib import ExitStack
    from pathlib import Path

    from ..config import Config

    with ExitStack() as stack:
        engine_url, remote = args.engine_url, {}
        if args.llama_server:
            from ..engine.llama_server import LlamaServer

            log = Path(tempfile.mkdtemp(prefix="agentmem-llama-")) / "server.log"
            print(f"starting llama-cpp-python's server on the default GGUF (log in {log})", file=sys.stderr)
            server = stack.enter_context(LlamaServer(log, n_ctx=args.llama_ctx, threads=args.llama_threads))
            engine_url = server.url
            remote["engine_context"] = args.llama_ctx  # llama-cpp-python's server states no window
        if engine_url:
            remote["engine_url"] = engine_url
            if args.engine_api:
                remote["engine_api"] = args.engine_api
            if args.reflect_remote:
                remote["reflect_engine"] = "remote"
        config = Config(data_dir=tempfile.mkdtemp(prefix="agentmem-bench-"), dtype=args.dtype, **remote)
        result, outcomes = run_engine(config, args, with_conditions=True)
        if config.engine_url and args.llama_server:
            result |= server_log_share(server.log_text(), result["server_prompt_tokens"])
            if not args.no_reflect or result.get("engine_api") == "chat":
                # the log also holds the other conditions' completions, reflection's calls and
                # the budget's probes: its hits are not the memory turns' share
                result |= {"server_log_cached_token_share": None,
                           "server_log_cached_token_share_reason": "the server's log holds more completions than "
                           "the memory turns (other conditions, reflection, chat mode's probes)"}
        if config.engine_url and args.embedded_peer:
            peer_config = Config(data_dir=tempfile.mkdtemp(prefix="agentmem-bench-"), dtype=args.dtype,
                                 engine_url=None)
            peer, peer_outcomes = run_engine(peer_config, args, with_conditions=False)
            pairs = list(zip(outcomes, peer_outcomes, strict=True))
            result["peer"] = peer
            result |= {"embedded_answer_accuracy": peer["answer_accuracy"],
                       "accuracy_gap": result["answer_accuracy"] - peer["answer_accuracy"],
                       "answers_agree": sum(a.correct == b.correct for a, b in pairs) / len(pairs),
                       "replies_identical": sum(a.reply == b.reply for a, b in pairs) / len(pairs)}
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>32}: {v}")
    return 0
