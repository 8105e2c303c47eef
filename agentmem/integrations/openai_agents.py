"""The OpenAI Agents SDK's `Session` on agentmem, and a `recall_memory` tool (`agentmem[agents]`).

    session = AgentmemSession("chat-42", user_id="ana", store=store)
    agent = Agent(name="helper", tools=[recall_memory_tool("ana", store=store)], model=...)
    await Runner.run(agent, "I moved to Lisbon", session=session)

The session keeps the SDK's items exactly as given (messages, function calls and their
outputs, reasoning, anything else), oldest first, in the archive's `session_items` table
(tiers/session_items.py). What an item says in words also becomes the user's memory: user and
assistant messages, `called NAME(ARGS)` for a function call and the output text of its result
are archive messages (roles user / assistant / tool) in the agentmem session of the same id,
so `MemoryStore.search` and `AgentSession.search` find them from any later session, and so
does the agent through `recall_memory`. System and developer messages, reasoning and other
item types have no such text: they are kept in the log only. So are `recall_memory`'s own calls
and outputs: they are memory read back, and stored again each recall would find the last
one's list.

`pop_item` and `clear_session` delete the items' messages too: an item taken back must not
linger as memory. They leave search at once, with no change to the recall index: every
candidate a search finds (by its full-text index, which the database updates with the row, or
by FAISS) is read back from the archive before it is ranked, and one whose row is gone is
dropped there. The vectors themselves go at the index's next reconcile: at once when the
deletion moved the newest or oldest message id (a popped item's message is the user's newest),
otherwise at its next count (`recall.COUNT_SECONDS`). Facts that reflection already drew from
such a message stay: they are memories of their own (`MemoryStore.delete_memory`).

Every SDK call is async: the SQL runs in a worker thread (`asyncio.to_thread`), never on the
event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

from ..config import Config
from ..tiers import Hit, MemoryStore, clean_text, session_items
from ..tiers.keys import message_text
from . import require

require("agents", "agents")

from agents import FunctionTool, function_tool  # noqa: E402
from agents.memory import SessionSettings  # noqa: E402
from agents.memory.session_settings import coerce_session_settings, resolve_session_limit  # noqa: E402

RECALL_TOOL = "recall_memory"
HIT_CHARS = 300  # of a hit's text in the tool's answer: enough to answer from, short enough for a small context
_SAID = {"user": "the user said", "assistant": "you said", "tool": "a tool returned"}  # named speakers: "NAME said"


class AgentmemSession:
    """The SDK's `Session` protocol for one user's session `session_id`. `store`: a
    `MemoryStore` shared with the app (the REST service's, an `AgentSession`'s); without one,
    the session opens its own from `config` and `close()` closes it."""

    def __init__(self, session_id: str, user_id: str, tenant_id: str = "default", *,
                 store: MemoryStore | None = None, config: Config | None = None,
                 session_settings: SessionSettings | dict[str, Any] | None = None):
        self.session_id = clean_text(session_id, "session_id")
        self.user_id = clean_text(user_id, "user_id")
        self.tenant_id = clean_text(tenant_id, "tenant_id")
        self.session_settings = (coerce_session_settings(session_settings) if session_settings is not None
                                 else SessionSettings())
        self._own_store = store is None
        self._recalls: set[str] = set()  # call ids of recall_memory calls, whose outputs are not memory
        self.store = store if store is not None else MemoryStore(config or Config())

    def close(self) -> None:
        if self._own_store:
            self.store.close()

    async def get_items(self, limit: int | None = None) -> list[dict]:
        """The history, oldest first; `limit` (else `session_settings.limit`): the newest that
        many. A negative limit is no limit, as the SDK's SQLiteSession reads it."""
        n = resolve_session_limit(limit, self.session_settings)
        return await asyncio.to_thread(session_items.items, self.store.archive, self.tenant_id, self.user_id,
                                       self.session_id, None if n is None or n < 0 else n)

    async def add_items(self, items: list[dict]) -> None:
        if not items:
            return
        self._recalls |= {item.get("call_id") for item in items if isinstance(item, dict)
                          and item.get("type") == "function_call" and item.get("name") == RECALL_TOOL}
        entries = [(item, memory_message(item, self._recalls)) for item in items]
        await asyncio.to_thread(session_items.append, self.store.archive, self.tenant_id, self.user_id,
                                self.session_id, entries)

    async def pop_item(self) -> dict | None:
        return await asyncio.to_thread(session_items.pop, self.store.archive, self.tenant_id, self.user_id,
                                       self.session_id)

    async def clear_session(self) -> None:
        await asyncio.to_thread(session_items.clear, self.store.archive, self.tenant_id, self.user_id,
                                self.session_id)


def memory_message(item: dict, recalls: Collection[str] = ()) -> dict | None:
    """The archive message an item's words become, or None for an item without any.
    `recalls`: the call ids of `recall_memory` calls."""
    if not isinstance(item, dict):
        return None
    kind = item.get("type", "message")
    if kind == "message" and item.get("role") in ("user", "assistant"):
        role, text = item["role"], message_text(item.get("content"))
    elif kind == "function_call" and item.get("name") != RECALL_TOOL:
        role, text = "tool", f"called {item.get('name')}({item.get('arguments', '')})"
    elif kind == "function_call_output" and item.get("call_id") not in recalls:
        role, text = "tool", message_text(item.get("output"))
    else:
        return None
    if not isinstance(text, str) or not text.strip():
        return None
    return {"role": role, "content": text}


def recall_memory_tool(user_id: str, tenant_id: str = "default", *, store: MemoryStore | None = None,
                       k: int = 5) -> FunctionTool:
    """A `recall_memory` function tool over the user's whole memory (hybrid recall,
    `MemoryStore.search`): every session's messages and the facts reflection drew from them.
    The agent's own earlier replies are left out, as agentmem's prompt leaves them out of its
    notes: what the user said is evidence, a small model's past guesses are not."""
    user_id, tenant_id = clean_text(user_id, "user_id"), clean_text(tenant_id, "tenant_id")
    memory = store if store is not None else MemoryStore(Config())

    async def recall_memory(query: str) -> str:
        """Look up what you remember about this user from earlier conversations: what they told
        you (name, family, pets, home, work, plans, likes and dislikes), what happened and when,
        what tools returned. Call it whenever the answer depends on something about the user
        that is not in the conversation you can see, before saying you do not know.

        Args:
            query: what to remember, in plain words, e.g. "the user's dog's name" or "trip to Lisbon".
        """
        hits = await asyncio.to_thread(memory.search, tenant_id, user_id, query, k, own_replies=False)
        return render_hits(hits)

    return function_tool(recall_memory, name_override=RECALL_TOOL)


def render_hits(hits: list[Hit]) -> str:
    """One line a hit: when, and who said it, in words the agent reads as its own notes."""
    if not hits:
        return "Nothing remembered about that."
    lines = []
    for h in hits:
        if h.kind != "message":
            who = f"a {h.kind} you know"
        elif h.name:
            who = f"{h.name} said"
        else:
            who = _SAID.get(h.role, f"{h.role} said")
        text = " ".join(h.text.split())
        if len(text) > HIT_CHARS:
            text = text[:HIT_CHARS - 1] + "…"
        lines.append(f"- {h.time:%Y-%m-%d %H:%M} UTC, {who}: {text}")
    return "\n".join(lines)
