"""`agentmem demo`: memory at work across sessions and processes, on the embedded defaults.

Session 1 states a few facts; session 2 is a long stretch of unrelated talk (imported,
no generation); offline reflection (templates only) distils the facts, with their source
messages, into memories and the "human" core block; then a NEW PROCESS opens a new session per question on the same data
directory and asks about the facts. Each answer is printed with the memories its prompt was
built from, the prompt's size against the whole history, and how much of its KV was reused.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

# (SmolLM2-135M answers "I live in Lisbon." in Portuguese; Denver keeps the demo in English)
FACTS = ["Hi! My name is Alice and I live in Denver.", "My dog is called Biscuit.", "I am allergic to peanuts."]
QUESTIONS = ["What is my dog called?", "Which city do I live in?", "What am I allergic to?"]
TOPICS = ["tide pools", "old maps", "jazz records", "volcanoes", "lighthouses", "beekeeping", "chess openings",
          "Roman roads", "origami", "bird migration"]


def _session(data_dir: str, engine=None, store=None):
    """A new session of alice; `engine`/`store` are shared within one process (tests pass theirs)."""
    from .config import Config
    from .session import AgentSession

    if engine is None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    return AgentSession("alice", config=Config(data_dir=data_dir), engine=engine, store=store)


def phase_one(data_dir: str, max_tokens: int, engine=None, store=None, pairs: int = 60) -> None:
    s = _session(data_dir, engine, store)
    print(f"\n=== session 1 ({s.session_id[:8]}), process {os.getpid()} ===")
    for text in FACTS:
        print(f"you> {text}")
        print(f"bot> {s.chat(text, max_tokens=max_tokens)}")
    s2 = _session(data_dir, s.engine, s.store)
    turns = []
    for i in range(pairs):
        t = TOPICS[i % len(TOPICS)]
        turns += [{"role": "user", "content": f"Let's talk about {t} for a while; what is one curious fact about {t}?"},
                  {"role": "assistant", "content": f"One curious thing about {t} is how much history it hides."}]
    s2.add_messages(turns)
    print(f"\n=== session 2 ({s2.session_id[:8]}): {len(turns)} messages of unrelated talk imported ===")
    from .reflect import reflect

    r = reflect(s.store, None, s.tenant_id, s.user_id, use_model=False)  # templates only: about a second
    print(f"\n=== offline reflection: {r.messages_read} messages read, {len(r.facts_added)} facts written ===")
    for m in s.store.list_memories(s.tenant_id, s.user_id, status="active", kind="fact"):
        print(f"  fact: {m.text}  (from message {', '.join(map(str, m.source_ids))})")


def phase_two(data_dir: str, max_tokens: int, engine=None, store=None) -> None:
    from .repl import show_turn

    s = _session(data_dir, engine, store)
    history = sum(s.engine.count_tokens(m.text) for sess in s.store.list_sessions("default", "alice")
                  for m in s.store.session_messages("default", "alice", sess.id))
    print(f"\n=== a new process {os.getpid()}; history so far: {history} tokens; each question in a new "
          f"session (SmolLM2-135M tends to repeat its last answer within one) ===")
    for i, q in enumerate(QUESTIONS):
        if i:
            s = _session(data_dir, s.engine, s.store)
        t0 = time.perf_counter()
        reply = s.chat(q, max_tokens=max_tokens)
        print(f"[session {s.session_id[:8]}]\nyou> {q}\nbot> {reply}   ({time.perf_counter() - t0:.1f}s)")
        show_turn(s)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agentmem demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=None, help="where to keep the demo's memory (default: a new temp dir)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--phase", choices=["1", "2"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase == "1":
        phase_one(args.data_dir, args.max_tokens)
        return 0
    if args.phase == "2":
        phase_two(args.data_dir, args.max_tokens)
        return 0
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="agentmem-demo-")
    print(f"demo memory lives in {data_dir}")
    for phase in ("1", "2"):
        cmd = [sys.executable, "-m", "agentmem.cli", "demo", "--phase", phase, "--data-dir", data_dir,
               "--max-tokens", str(args.max_tokens)]
        rc = subprocess.call(cmd)
        if rc:
            return rc
    return 0
