"""`agentmem chat`: talk to a model that remembers you, in the terminal.

Lines starting with '/' are commands: /search TEXT, /context TEXT, /memories, /sessions,
/forget, /help, /quit. With --show-memories each reply is followed by the memories that
went into its prompt and how much of the prompt's KV was reused.
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = """commands:
  /search TEXT    search this user's memory (messages and facts)
  /context TEXT   show the prompt a turn with TEXT would use, segment by segment
  /memories       list reflected facts and their status
  /sessions       list this user's sessions
  /forget         delete everything stored about this user
  /quit           leave (Ctrl-D works too)"""


def show_turn(session, out=sys.stdout) -> None:
    t = session.last_turn
    if t is None:
        return
    s = t.stats
    print(f"  [{s.prompt_tokens} prompt tokens, {s.reused_tokens} reused, ttft {s.ttft_s:.2f}s, "
          f"{len(t.memories_used)} memories]", file=out)
    for m in t.memories_used:
        print(f"  * {m['ref']} ({m['time'][:10]}, score {m['score']:.2f}): {m['text'][:100]}", file=out)


def run_command(session, line: str, out=sys.stdout) -> bool:
    """Handle a /command; False means quit."""
    cmd, _, arg = line[1:].partition(" ")
    if cmd in ("quit", "exit", "q"):
        return False
    if cmd == "search" and arg:
        for h in session.search(arg, k=10):
            print(f"  {h.score:.3f} {h.ref} {h.time:%Y-%m-%d}: {h.text[:120]}", file=out)
    elif cmd == "context" and arg:
        ctx = session.context(arg)
        for seg in ctx.segments:
            print(f"  {seg.tier:<10} {seg.tokens:>5} tok  {seg.ref or '':<18} {seg.text[:80]!r}", file=out)
        print(f"  total {ctx.total_tokens} tokens: {json.dumps(ctx.tokens_by_tier())}", file=out)
    elif cmd == "memories":
        for m in session.memories():
            print(f"  #{m.id} [{m.status}] {m.text}", file=out)
    elif cmd == "sessions":
        for s in session.store.list_sessions(session.tenant_id, session.user_id):
            here = " (this one)" if s.id == session.session_id else ""
            print(f"  {s.id} {s.created_at:%Y-%m-%d %H:%M} {s.message_count} messages{here}", file=out)
    elif cmd == "forget":
        session.forget()
        print("  forgotten: rows, vectors and cached KV of this user are deleted", file=out)
    else:
        print(HELP, file=out)
    return True


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agentmem chat", description=__doc__.split("\n\n")[0])
    ap.add_argument("--user", default="me")
    ap.add_argument("--tenant", default="default")
    ap.add_argument("--session", default=None, help="resume this session id (default: a new session)")
    ap.add_argument("--show-memories", action="store_true", help="after each reply, show the memories it used")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=None, help="default: the model's recommendation")
    args = ap.parse_args(argv)

    from .session import AgentSession
    from .tiers import InvalidInput

    print("loading model and memory ...", file=sys.stderr)
    session = AgentSession(args.user, tenant_id=args.tenant, session_id=args.session)
    print(f"user {args.user}, session {session.session_id}. /help for commands.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line.strip():
            continue
        if line.startswith("/"):
            if not run_command(session, line):
                return 0
            continue
        try:
            print("bot> ", end="", flush=True)
            for piece in session.chat_stream(line, max_tokens=args.max_tokens, temperature=args.temperature):
                print(piece, end="", flush=True)
            print()
        except InvalidInput as e:
            print(f"\n  ! {e}", file=sys.stderr)
            continue
        if args.show_memories:
            show_turn(session)
