"""An MCP server over agentmem's memory: `agentmem mcp` (stdio, one user by default) and
`/mcp` inside `agentmem serve` (streamable HTTP, the REST service's tenants and keys).

The tools are the memory API an agent needs, named for what it does with them; each takes
an optional `user_id`. Over stdio the user defaults to `--user`; over HTTP the tenant is
the API key's (`Authorization: Bearer am-...`, a wrong key is a 401 before MCP sees the
request) and the user is the argument or the `X-Agentmem-User` header. Core memory blocks
are resources (`agentmem://core/{label}`). A result carries structured content (ids, text,
times, scores, the retrievers that found a hit) and a short text rendering for the model.
A bad argument is a tool error (`isError`) that says what was wrong; the server stays up.

The work is `MemoryStore`'s and `AgentSession`'s, the same calls the Python API and the
REST routes make; it runs in a worker thread, off the server's event loop. HTTP runs
stateless (every request stands alone, as the REST replicas do), so any replica behind a
load balancer can answer any call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from . import require

require("mcp", "mcp")

from mcp.server.mcpserver import Context, MCPServer  # noqa: E402
from mcp.server.mcpserver.exceptions import ToolError  # noqa: E402
from mcp.server.transport_security import TransportSecuritySettings  # noqa: E402
from mcp.types import CallToolResult, TextContent, ToolAnnotations  # noqa: E402

from ..api.limits import Limits  # noqa: E402 (the REST service's: one call carries what one request may)
from ..config import Config  # noqa: E402
from ..tiers.records import Conflict, Hit, InvalidInput, Memory, NotFound  # noqa: E402
from ..tiers.scope import check_id  # noqa: E402
from ..tiers.store import MemoryStore  # noqa: E402

MAX_K = 100
USER_HEADER = "x-agentmem-user"
INSTRUCTIONS = (
    "Long-term memory of the user you are talking to. Before answering anything that depends on "
    "what the user told you earlier (names, preferences, plans, facts about their life), call "
    "search_memory. Save what the user says with add_messages (whole turns) or add_memory (one "
    "fact you want kept). When the user corrects something you remembered, call update_memory with "
    "the memory's id; when they ask you to forget it, delete_memory. Core blocks (set_core_block) "
    "hold what must be in every prompt, such as the user's name and standing instructions."
)


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system", "tool"] = Field(description="who said it")
    content: str = Field(description="what was said")
    created_at: datetime | None = Field(None, description="when it was said (ISO 8601); default: now")
    name: str | None = Field(None, description="the speaker's name, when the conversation has several")


UserId = Annotated[str | None, Field(description="whose memory; default: the server's user (stdio) or the "
                                                 "X-Agentmem-User header (HTTP)")]


class MemoryTools:
    """The tools' work on one (tenant, user), plain and synchronous: each returns the
    structured result and its text rendering, and raises ToolError on bad input."""

    def __init__(self, store: MemoryStore, engine: Callable[[], Any], config: Config, limits: Limits | None = None):
        self.store, self.engine, self.config, self.limits = store, engine, config, limits or Limits()

    def _text(self, value: str, what: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ToolError(f"{what} is empty")
        if len(value) > self.limits.max_message_chars:
            raise ToolError(f"{what} is {len(value)} characters; the limit is {self.limits.max_message_chars}")
        return value

    def add_memory(self, tenant: str, user: str, text: str) -> tuple[dict, str]:
        m = self.store.add_memory(tenant, user, self._text(text, "text"))
        return {"memory": _memory(m)}, f"Saved memory {m.id}: {m.text}"

    def add_messages(self, tenant: str, user: str, messages: list[MessageIn], session_id: str | None) -> tuple[dict, str]:
        if not messages:
            raise ToolError("messages is empty: give at least one {role, content}")
        if len(messages) > self.limits.max_messages:
            raise ToolError(f"{len(messages)} messages; at most {self.limits.max_messages} per call")
        for i, m in enumerate(messages):
            self._text(m.content, f"messages[{i}].content")
        rows = [m.model_dump(exclude_none=True) for m in messages]
        sid = session_id or self.store.latest_session(tenant, user) or self.store.open_session(tenant, user).id
        try:  # the common case, an existing session, costs the insert alone (open_session counts its messages)
            stored = self.store.add_messages(tenant, user, sid, rows)
        except NotFound:
            if session_id is None:
                raise
            sid = self.store.open_session(tenant, user, session_id).id  # a conversation the caller starts
            stored = self.store.add_messages(tenant, user, sid, rows)
        ids = [m.id for m in stored]
        return ({"session_id": sid, "message_ids": ids},
                f"Stored {len(ids)} message{'s' * (len(ids) != 1)} in session {sid}.")

    def search_memory(self, tenant: str, user: str, query: str, k: int, since: datetime | None,
                      until: datetime | None) -> tuple[dict, str]:
        self._text(query, "query")
        if isinstance(k, bool) or not 1 <= k <= MAX_K:
            raise ToolError(f"k must be between 1 and {MAX_K}, got {k}")
        if since and until and since > until:
            raise ToolError(f"since ({since.isoformat()}) is after until ({until.isoformat()})")
        hits = self.store.search(tenant, user, query, k, since, until)
        lines = [f"{i}. {_hit_line(h)}" for i, h in enumerate(hits, 1)]
        head = f"{len(hits)} memor{'y' if len(hits) == 1 else 'ies'} for {query!r}" + (":" if hits else ".")
        return {"query": query, "hits": [_hit(h) for h in hits]}, "\n".join([head, *lines])

    def get_context(self, tenant: str, user: str, query: str) -> tuple[dict, str]:
        from ..session import preview_context

        self._text(query, "query")
        ctx = preview_context(self.store, self.engine(), self.config, tenant, user, query).to_dict()
        total = sum(s["tokens"] for s in ctx["segments"])
        parts = [f"The prompt a turn with this question would get: {len(ctx['segments'])} segments, {total} tokens."]
        parts += [f"[{s['tier']}, {s['tokens']} tokens] {s['text'].strip()}" for s in ctx["segments"] if s["text"].strip()]
        return {**ctx, "prompt_tokens": total}, "\n".join(parts)

    def list_memories(self, tenant: str, user: str, status: str) -> tuple[dict, str]:
        if status not in ("active", "superseded", "all"):
            raise ToolError(f"status must be active, superseded or all, got {status!r}")
        mems = self.store.list_memories(tenant, user, None if status == "all" else status)
        lines = [f"- {m.id} [{m.kind}, {m.status}, {m.time.date().isoformat()}] {m.text}"
                 + (f" (superseded by {m.superseded_by})" if m.superseded_by else "") for m in mems]
        return ({"memories": [_memory(m) for m in mems]},
                "\n".join([f"{len(mems)} {status} memor{'y' if len(mems) == 1 else 'ies'}" + (":" if mems else "."),
                           *lines]))

    def update_memory(self, tenant: str, user: str, memory_id: int, text: str) -> tuple[dict, str]:
        new = self.store.correct_memory(tenant, user, _memory_id(memory_id), self._text(text, "text"))
        return ({"memory": _memory(new), "superseded": memory_id},
                f"Memory {memory_id} is superseded by {new.id}: {new.text}")

    def delete_memory(self, tenant: str, user: str, memory_id: int) -> tuple[dict, str]:
        self.store.delete_memory(tenant, user, _memory_id(memory_id))
        return {"deleted": memory_id}, f"Deleted memory {memory_id}."

    def set_core_block(self, tenant: str, user: str, label: str, value: str) -> tuple[dict, str]:
        if not isinstance(label, str) or not label.strip():
            raise ToolError("label is empty")
        if len(value) > self.limits.max_message_chars:
            raise ToolError(f"value is {len(value)} characters; the limit is {self.limits.max_message_chars}")
        b = self.store.set_core_block(tenant, user, label, value)
        return {"block": b.to_dict()}, f"Core block {b.label!r} set ({len(b.value)} of {b.limit} characters)."

    def core_blocks(self, tenant: str, user: str) -> list[dict]:
        return [b.to_dict() for b in self.store.core_blocks(tenant, user)]


def _memory_id(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**63:
        raise ToolError(f"memory_id must be a positive integer, got {value!r}")
    return value


def _hit(h: Hit) -> dict:
    return {"id": h.id, "ref": h.ref, "kind": h.kind, "text": h.text, "time": h.time.isoformat(),
            "score": round(h.score, 4), "similarity": round(h.similarity, 4), "retrievers": h.retrievers,
            "role": h.role, "session_id": h.session_id, "source_ids": h.source_ids}


def _hit_line(h: Hit) -> str:
    who = h.name or h.role or h.kind
    via = "+".join(h.retrievers) or "-"
    return (f"[{h.kind} {h.id} · {who} · {h.time.strftime('%Y-%m-%d %H:%M')} · score {h.score:.2f} · {via}] "
            f"{h.text}")


def _memory(m: Memory) -> dict:
    return {k: v for k, v in m.to_dict().items() if k != "user_id"}


# --- who is calling --------------------------------------------------------------------------
class StdioCaller:
    """The stdio server acts for one tenant, and for `user` unless a call names another."""

    def __init__(self, tenant_id: str, user_id: str):
        self.tenant_id, self.user_id = tenant_id, user_id

    def __call__(self, ctx: Context, user_id: str | None, write: bool = False) -> tuple[str, str]:
        return self.tenant_id, user_id or self.user_id


class HttpCaller:
    """Over HTTP the key names the tenant and the user is the argument or the X-Agentmem-User
    header. The endpoint already refused a bad key with a 401 from the key cache, as a REST
    read does; a tool that writes looks the key up in the database again, as a REST write
    does, so a key deleted by any process stops writing at once."""

    def __init__(self, tenant_for_key: Callable[[str], str | None]):
        self.tenant_for_key = tenant_for_key

    def __call__(self, ctx: Context, user_id: str | None, write: bool = False) -> tuple[str, str]:
        from ..api.auth import bearer_token, hash_key

        headers = {k.lower(): v for k, v in (ctx.headers or {}).items()}
        key = bearer_token(headers.get("authorization"))
        tenant = self.tenant_for_key(hash_key(key), write) if key else None
        if tenant is None:
            raise ToolError("invalid API key")
        user = user_id or headers.get(USER_HEADER)
        if not user:
            raise ToolError("user_id is required over HTTP (or send an X-Agentmem-User header)")
        return tenant, user


def build_server(tools: MemoryTools, caller: Callable[..., tuple[str, str]]) -> MCPServer:
    """The MCP server: the tools, their descriptions, and the core blocks as resources."""
    server = MCPServer("agentmem", instructions=INSTRUCTIONS, version="0.1.0")
    writers = {tools.add_memory, tools.add_messages, tools.update_memory, tools.delete_memory,
               tools.set_core_block}

    def act(ctx: Context, user_id: str | None, work: Callable[..., tuple[dict, str]], *args) -> tuple[dict, str]:
        tenant, user = caller(ctx, user_id, work in writers)  # a write's key lookup may read the database
        check_id(user, "user_id")  # the REST service's id alphabet: what MCP stores, REST can delete
        return work(tenant, user, *args)

    async def call(ctx: Context, user_id: str | None, work: Callable[..., tuple[dict, str]], *args) -> CallToolResult:
        try:  # all of it in a worker thread, off the event loop
            data, text = await asyncio.to_thread(act, ctx, user_id, work, *args)
        except (InvalidInput, NotFound, Conflict) as exc:
            raise ToolError(str(exc)) from None
        return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=data)

    read_only = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)
    writes = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)

    @server.tool(annotations=writes)
    async def add_memory(text: Annotated[str, Field(description="the fact, in a full sentence")],
                         ctx: Context, user_id: UserId = None) -> CallToolResult:
        """Save one fact about the user to long-term memory, in a full sentence that stands on its own
        ("Ana's birthday is 3 May"). Use it for something worth remembering that the conversation
        itself will not store; to store the conversation's turns, use add_messages."""
        return await call(ctx, user_id, tools.add_memory, text)

    @server.tool(annotations=writes)
    async def add_messages(messages: Annotated[list[MessageIn], Field(description="the turns, oldest first")],
                           ctx: Context, session_id: Annotated[str | None, Field(
                               description="the conversation they belong to; default: the user's latest")] = None,
                           user_id: UserId = None) -> CallToolResult:
        """Store conversation turns (the user's and yours) in long-term memory, so that later
        conversations can recall them. Call it after each exchange; the turns become searchable at once."""
        return await call(ctx, user_id, tools.add_messages, messages, session_id)

    @server.tool(annotations=read_only)
    async def search_memory(query: Annotated[str, Field(description="what you want to remember, as a question "
                                                                    "or keywords")],
                            ctx: Context, k: Annotated[int, Field(description="how many results, 1-100")] = 10,
                            since: Annotated[datetime | None, Field(description="only from this time on "
                                                                                "(ISO 8601)")] = None,
                            until: Annotated[datetime | None, Field(description="only up to this time "
                                                                                "(ISO 8601)")] = None,
                            user_id: UserId = None) -> CallToolResult:
        """Search everything the user has said and every fact remembered about them (full-text and
        semantic search, fused, with time in the question understood: "last week", "in March"). Call it
        before answering anything that depends on the user's past: names, preferences, plans, events."""
        return await call(ctx, user_id, tools.search_memory, query, k, since, until)

    @server.tool(annotations=read_only)
    async def get_context(query: Annotated[str, Field(description="the user's next message")], ctx: Context,
                          user_id: UserId = None) -> CallToolResult:
        """Show the prompt agentmem would assemble for this message, segment by segment: persona, core
        blocks, summary, recalled memories, recent turns. Use it to see what memory would bring to a reply."""
        return await call(ctx, user_id, tools.get_context, query)

    @server.tool(annotations=read_only)
    async def list_memories(ctx: Context, status: Annotated[Literal["active", "superseded", "all"], Field(
                                description="active (current), superseded (replaced by a correction) or all")]
                            = "active", user_id: UserId = None) -> CallToolResult:
        """List the facts and insights remembered about the user, with their ids (which update_memory and
        delete_memory take), kinds and dates."""
        return await call(ctx, user_id, tools.list_memories, status)

    @server.tool(annotations=writes)
    async def update_memory(memory_id: Annotated[int, Field(description="the memory's id, from search_memory "
                                                                        "or list_memories")],
                            text: Annotated[str, Field(description="the corrected fact")], ctx: Context,
                            user_id: UserId = None) -> CallToolResult:
        """Correct a remembered fact when the user says it changed or was wrong. The old memory is kept as
        superseded, linked to the new one, so its history stays."""
        return await call(ctx, user_id, tools.update_memory, memory_id, text)

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False))
    async def delete_memory(memory_id: Annotated[int, Field(description="the memory's id")], ctx: Context,
                            user_id: UserId = None) -> CallToolResult:
        """Delete a remembered fact for good, when the user asks you to forget it."""
        return await call(ctx, user_id, tools.delete_memory, memory_id)

    @server.tool(annotations=writes)
    async def set_core_block(label: Annotated[str, Field(description='the block, e.g. "human" or "persona"')],
                             value: Annotated[str, Field(description="its whole new text")], ctx: Context,
                             user_id: UserId = None) -> CallToolResult:
        """Set a core memory block: text that is in every prompt, such as what you must always know about
        the user ("human") or how you should behave ("persona"). Replaces the block's whole text."""
        return await call(ctx, user_id, tools.set_core_block, label, value)

    async def blocks(tenant: str, user: str) -> str:
        return json.dumps(await asyncio.to_thread(tools.core_blocks, tenant, user))

    if isinstance(caller, StdioCaller):  # one user: the listing is a plain resource clients show
        @server.resource("agentmem://core", name="core-memory", mime_type="application/json",
                         description=f"{caller.user_id}'s core memory blocks (in every prompt)")
        async def core_resource() -> str:
            return await blocks(caller.tenant_id, caller.user_id)

    @server.resource("agentmem://users/{user_id}/core", name="user-core-memory", mime_type="application/json",
                     description="a user's core memory blocks (in every prompt)")
    async def user_core_resource(user_id: str, ctx: Context) -> str:
        return await blocks(*caller(ctx, user_id))

    @server.resource("agentmem://core/{label}", name="core-block", mime_type="text/plain",
                     description="one core memory block's text")
    async def core_block_resource(label: str, ctx: Context) -> str:
        tenant, user = caller(ctx, None)
        blocks = {b["label"]: b["value"] for b in await asyncio.to_thread(tools.core_blocks, tenant, user)}
        if label not in blocks:
            raise ValueError(f"no core block {label!r}")
        return blocks[label]

    return server


# --- streamable HTTP inside `agentmem serve` ------------------------------------------------------
class McpEndpoint:
    """ASGI endpoint of `/mcp`: the caller's key is checked as every REST route checks it
    (401, failed-auth and tenant rate limits; from the key cache, as a REST read: a miss
    reads the database on the loop, once per key and KEY_CACHE_SECONDS), then the request goes to the MCP SDK's
    stateless streamable-HTTP app. The SDK's session manager runs on the serving event
    loop, started by the first request."""

    def __init__(self, services):
        self.services = services
        tools = MemoryTools(services.store, services.engine, services.config, services.limits)
        self.server = build_server(tools, HttpCaller(services.tenant_for_key))
        self._apps: dict[asyncio.AbstractEventLoop, asyncio.Future] = {}
        self._lock = threading.Lock()
        self._tasks: list[asyncio.Task] = []

    async def __call__(self, scope, receive, send) -> None:
        from starlette.requests import Request

        from ..api.auth import bearer_token
        from ..api.deps import authenticate

        if scope["type"] == "http":  # every MCP request is a POST: the tools say which ones write
            request = Request(scope)
            authenticate(request, bearer_token(request.headers.get("authorization")), fresh=False)
        app = await self._app()
        await app(scope, receive, send)

    async def _app(self):
        loop = asyncio.get_running_loop()
        with self._lock:
            ready = self._apps.get(loop)
            if ready is None:
                ready = self._apps[loop] = loop.create_future()
                self._tasks.append(loop.create_task(self._run(ready)))
        return await asyncio.shield(ready)

    async def _run(self, ready: asyncio.Future) -> None:
        # the key is the credential, so the SDK's DNS-rebinding guard (which only knows localhost
        # names) would refuse every deployment's host name and protect nothing the key does not
        app = self.server.streamable_http_app(
            streamable_http_path="/mcp", stateless_http=True, json_response=True,
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
        async with self.server.session_manager.run():
            ready.set_result(app)
            await asyncio.Event().wait()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._apps.clear()


def mount(app, services) -> None:
    """Serve MCP at `/mcp` of the REST app."""
    from starlette.routing import Route

    endpoint = McpEndpoint(services)
    app.router.routes.append(Route("/mcp", endpoint, methods=["GET", "POST", "DELETE"], include_in_schema=False))
    app.router.on_shutdown.append(endpoint.close)


# --- `agentmem mcp` ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="agentmem mcp", description="MCP server over stdio for one user's memory "
                                "(Claude Desktop, Claude Code, Cursor, agent frameworks)")
    p.add_argument("--user", required=True, help="the user whose memory the tools use unless a call names another")
    p.add_argument("--tenant", default="default", help="the tenant (default: default)")
    p.add_argument("--data-dir", help="where the archive lives (default: AGENTMEM_DATA_DIR or the user data dir)")
    args = p.parse_args(argv)
    config = Config(**({"data_dir": args.data_dir} if args.data_dir else {}))
    store = MemoryStore(config)
    engine_lock = threading.Lock()
    loaded: list = []

    def engine():
        """The model, loaded by the first get_context: the other tools need none."""
        with engine_lock:
            if not loaded:
                from ..engine import load_engine

                loaded.append(load_engine(config))
            return loaded[0]

    server = build_server(MemoryTools(store, engine, config), StdioCaller(args.tenant, args.user))
    print(f"agentmem mcp: user {args.user!r}, tenant {args.tenant!r}, archive {store.archive.engine.url!r}",
          file=sys.stderr)
    try:
        server.run("stdio")
    finally:
        store.close()
    return 0
