"""`agentmem bench replies`: are the replies ones a person would accept, and do agent calls parse.

On a fixed set of chat openings (one session, in order) and memory questions (the seeded
workload of `bench memory`, small: each user's facts imported, then every question asked in
one new session), for: greedy and the model card's sampling as replies were made before
(earlier replies in the prompt, no copy guard), the card's sampling with the repetition
penalties, and the defaults (those penalties, the copy guard, earlier replies left out of
the prompt). Per sampling: `loop_rate` (replies the loop detector had to cut),
`distinct_2`, `copy_previous_rate` (reply_metrics.py) and `answer_accuracy` (the questions).
Then tool calls and JSON replies through the chat API's planning, with and without the
grammar: `tool_call_valid_rate`, `json_schema_valid_rate` (parses and matches the schema),
and decode `tokens_per_s` with the grammar on and off on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

OPENINGS = [
    "I moved to Lisbon last month and I work as a pharmacist.",
    "Hi! How are you today?",
    "Can you tell me a fun fact about octopuses?",
    "I'm planning a trip to Japan in the spring. Any tips?",
    "What should I cook for dinner tonight?",
    "I just adopted a kitten. What do I need to buy?",
    "My sister is getting married next week and I have to give a speech.",
    "Explain in simple words what a black hole is.",
]
NO_PENALTY = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
# name -> (Config overrides, sampling): how replies were made before this benchmark's
# remedies (greedy; the card's sampling alone), the defaults now, and the defaults with the
# session's earlier replies back in the prompt (the assembly remedy undone)
SAMPLINGS: dict[str, tuple[dict, dict]] = {
    "greedy": ({"prompt_replies": True}, {"temperature": 0.0, "copy_ngram": 0, **NO_PENALTY}),
    "card": ({"prompt_replies": True}, {"copy_ngram": 0, **NO_PENALTY}),
    "penalties": ({"prompt_replies": True}, {"copy_ngram": 0}),
    "defaults": ({}, {}),
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"]}}}
REMIND = {"type": "function", "function": {"name": "set_reminder", "description": "Remind the user later", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}, "minutes": {"type": "integer", "minimum": 1}},
    "required": ["text", "minutes"]}}}
TOOL_ASKS = ["What's the weather like in Oslo?", "Remind me to call my mum in 20 minutes.",
             "Is it raining in Lima today?", "Set a reminder to water the plants in an hour."]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}
BOOK = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                         "genres": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "year", "genres"]}
JSON_ASKS = [("Invent a person: name, age and city. Reply in JSON.", PERSON),
             ("Describe your favourite book as JSON with title, year and genres.", BOOK),
             ("I'm Ana, 34, from Porto. Give my details as JSON.", PERSON),
             ("Make up a classic novel and give it as JSON.", BOOK)]


def run_openings(engine, store, config, sampling: dict, max_tokens: int) -> list[tuple[str, str]]:
    from ..session import AgentSession

    s = AgentSession("opener", tenant_id="t", config=config, engine=engine, store=store)
    out = []
    for i, text in enumerate(OPENINGS):
        reply = s.chat(text, max_tokens=max_tokens, seed=i, **sampling)
        out.append((reply, s.last_turn.stats.finish_reason))
        print(f"  open {i}: {s.last_turn.stats.finish_reason:<10} {reply[:70]!r}", file=sys.stderr)
    return out


def run_questions(engine, store, config, sampling: dict, workload, max_tokens: int):
    from ..session import AgentSession

    sessions, correct = [], []
    for h in workload:
        s = AgentSession(h.user, tenant_id="t", config=config, engine=engine, store=store)
        replies = []
        for i, q in enumerate(h.questions):
            reply = s.chat(q.text, max_tokens=max_tokens, seed=i, **sampling)
            replies.append((reply, s.last_turn.stats.finish_reason))
            correct.append(q.answered_by(reply))
            print(f"  ask {h.user} {q.key}: {'ok ' if correct[-1] else 'bad'} {reply[:60]!r}", file=sys.stderr)
        sessions.append(replies)
    return sessions, correct


def sampling_figures(engine, config, overrides: dict, sampling: dict, workload, max_tokens: int) -> dict:
    from ..engine.repetition import find_loop
    from ..reply_metrics import copy_previous_rate, distinct_2
    from ..tiers import MemoryStore
    from .memory import prepare

    with tempfile.TemporaryDirectory() as d:
        cfg = config.model_copy(update={"data_dir": Path(d), "db_url": None, "kv_disk_dir": None, **overrides})
        store = MemoryStore(cfg)
        try:
            openings = run_openings(engine, store, cfg, sampling, max_tokens)
            prepare(store, engine, cfg, workload, "t")
            asked, correct = run_questions(engine, store, cfg, sampling, workload, max_tokens)
        finally:
            store.close()
    sessions = [openings] + asked
    replies = [r for s in sessions for r in s]
    looped = [why == "repetition" or find_loop(engine.encode(text)) is not None for text, why in replies]
    return {"loop_rate": sum(looped) / len(replies), "distinct_2": distinct_2([t for t, _ in replies]),
            "copy_previous_rate": copy_previous_rate([[t for t, _ in s] for s in sessions]),
            "answer_accuracy": sum(correct) / len(correct), "replies": len(replies)}


def _valid(doc, schema) -> bool:
    from jsonschema import ValidationError, validate

    try:
        validate(doc, schema)
    except ValidationError:
        return False
    return True


def usable(calls: list[dict], content: str | None, finish: str, tools: dict | None, schema: dict | None) -> bool:
    """Whether a client can use the reply: with `tools`, one or more calls, each of a given
    tool with arguments that match its schema; with `schema`, content that parses and matches
    it. A reply that max_tokens cut ("length") is never usable: the openai SDK's `parse()`
    raises on it, and its calls may not be all the model meant to make."""
    if finish == "length":
        return False
    if tools is not None:
        return bool(calls) and all(c["function"]["name"] in tools and _valid(
            json.loads(c["function"]["arguments"]), tools[c["function"]["name"]]) for c in calls)
    try:
        return content is not None and _valid(json.loads(content), schema)
    except json.JSONDecodeError:
        return False


def structured_figures(engine, max_tokens: int) -> dict[bool, dict]:
    """Tool calls and JSON replies planned, sampled and read back as the chat API does (its
    sampling defaults, its reading of calls and finish reasons), each decoded with and then
    without the grammar (the same system prompt and seed; interleaved, so both see the same
    machine load): grammar on/off -> figures."""
    from ..api.reply_format import plan, read_reply
    from ..api.schemas import ChatCompletionRequest
    from ..engine.sampler import with_defaults

    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, REMIND)}
    cases = [(text, {"tools": [WEATHER, REMIND], "tool_choice": "required"}, None) for text in TOOL_ASKS]
    cases += [(text, {"response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}},
               schema) for text, schema in JSON_ASKS]
    ok: dict[bool, dict[str, list[bool]]] = {g: {"tool": [], "json": []} for g in (True, False)}
    finishes: dict[bool, dict[str, int]] = {True: {}, False: {}}
    calls_made: dict[bool, list[int]] = {True: [], False: []}
    tokens = {True: 0, False: 0}
    seconds = {True: 0.0, False: 0.0}
    for i, (text, fields, schema) in enumerate(cases):
        fmt = plan(ChatCompletionRequest(messages=[{"role": "user", "content": text}], **fields), engine.grammars)
        msgs = [{"role": "system", "content": fmt.system}, {"role": "user", "content": text}]
        for grammar in (True, False):
            params = with_defaults(engine.sampling_defaults, max_tokens=max_tokens, seed=i,
                                   grammar=fmt.grammar if grammar else None)
            g = engine.generate(engine.chat_segments(msgs), params)
            tokens[grammar] += g.stats.completion_tokens
            seconds[grammar] += g.stats.total_s - g.stats.ttft_s
            calls, content, finish = read_reply(g.text, fmt, g.stats.finish_reason)
            finishes[grammar][finish] = finishes[grammar].get(finish, 0) + 1
            if schema is None:
                calls_made[grammar].append(len(calls))
            ok[grammar]["json" if schema else "tool"].append(
                usable(calls, content, finish, None if schema else tools, schema))
            print(f"  {'grammar' if grammar else 'free   '} {finish:<10} {g.text[:80]!r}", file=sys.stderr)
    return {g: {"tool_call_valid_rate": sum(ok[g]["tool"]) / len(ok[g]["tool"]),
                "json_schema_valid_rate": sum(ok[g]["json"]) / len(ok[g]["json"]),
                "tokens_per_s": tokens[g] / seconds[g] if seconds[g] else 0.0,
                "finish_reasons": finishes[g], "tool_calls_per_reply": calls_made[g]} for g in (True, False)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agentmem bench replies", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--structured-max-tokens", type=int, default=96,
                    help="max_tokens of the tool-call and JSON replies")
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--facts", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)

    import torch

    from ..config import Config
    from ..engine import Engine
    from ..engine.grammar import Grammar
    from .memory import build_workload

    config = Config(dtype=args.dtype)
    engine = Engine.load(config)
    t0 = time.perf_counter()
    # llguidance builds the tokenizer's token trie on the first mask, once per process: here,
    # not inside the first timed decode
    engine.grammars.matcher(Grammar.json_object()).mask(torch.zeros(engine.model.args.vocab_size))
    trie_s = time.perf_counter() - t0
    workload = build_workload(0, args.users, args.facts, 60, 2, 0.4)
    out: dict = {"samplings": {}}
    for name, (overrides, sampling) in SAMPLINGS.items():
        print(f"sampling {name}: {overrides} {sampling}", file=sys.stderr)
        out["samplings"][name] = sampling_figures(engine, config, overrides, sampling, workload, args.max_tokens)
    figs = structured_figures(engine, args.structured_max_tokens)
    on, off = figs[True], figs[False]
    for key in ("tool_call_valid_rate", "json_schema_valid_rate", "tokens_per_s", "finish_reasons",
                "tool_calls_per_reply"):
        out[key] = {"grammar": on[key], "no_grammar": off[key]}
    out["structured_max_tokens"] = args.structured_max_tokens
    out |= {"defaults": engine.sampling_defaults, "copy_guard_ngram": config.copy_guard_ngram,
            "prompt_replies": config.prompt_replies, "max_tokens": args.max_tokens,
            "grammar_first_use_s": trie_s, "model": engine.model_id, "dtype": str(engine.dtype).removeprefix("torch."),
            "weights": engine.weights, "device": str(engine.device), "threads": torch.get_num_threads()}
    print(json.dumps(out, indent=None if args.json else 2))
    return 0
