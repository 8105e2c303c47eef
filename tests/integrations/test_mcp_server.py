"""The MCP server with the official `mcp` client: over stdio (`agentmem mcp` as a child
process) and over streamable HTTP inside a real `agentmem serve` (a wrong key is a 401, two
tenants never see each other), every tool, the core blocks as resources, and bad arguments
as tool errors after which the server still answers."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import sys

import httpx
import pytest

pytest.importorskip("mcp")

from _serve import serve  # noqa: E402
from mcp import Client  # noqa: E402
from mcp.client.stdio import StdioServerParameters  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

TOOLS = {"add_memory", "add_messages", "search_memory", "get_context", "list_memories", "update_memory",
         "delete_memory", "set_core_block"}


async def exercise(client: Client, user_args: dict) -> dict:
    """Every tool once, in the order an agent would use them; returns what later checks need."""
    listed = {t.name: t for t in (await client.list_tools()).tools}
    assert TOOLS <= set(listed)
    assert all(len(listed[n].description or "") > 40 for n in TOOLS)
    assert "user_id" in listed["search_memory"].input_schema["properties"]

    async def call(name: str, **args):
        r = await client.call_tool(name, {**args, **user_args})
        assert not r.is_error, r.content
        assert r.content and r.content[0].text
        return r

    r = await call("add_messages", messages=[{"role": "user", "content": "My dog is called Biscuit."},
                                             {"role": "assistant", "content": "Biscuit is a lovely name."}])
    assert len(r.structured_content["message_ids"]) == 2
    r = await call("add_memory", text="The user is allergic to peanuts.")
    mem_id = r.structured_content["memory"]["id"]
    r = await call("search_memory", query="What is my dog called?", k=3)
    hits = r.structured_content["hits"]
    assert hits and hits[0]["text"] == "My dog is called Biscuit."
    assert hits[0]["retrievers"] and hits[0]["time"] and isinstance(hits[0]["score"], float)
    assert "Biscuit" in r.content[0].text
    r = await call("update_memory", memory_id=mem_id, text="The user is allergic to peanuts and cashews.")
    new_id = r.structured_content["memory"]["id"]
    r = await call("list_memories", status="all")
    status = {m["id"]: m["status"] for m in r.structured_content["memories"]}
    assert status == {mem_id: "superseded", new_id: "active"}
    r = await call("list_memories")
    assert [m["id"] for m in r.structured_content["memories"]] == [new_id]
    await call("set_core_block", label="human", value="Name: Alice. Has a dog, Biscuit.")
    r = await call("get_context", query="What do you know about my dog?")
    tiers = [s["tier"] for s in r.structured_content["segments"]]
    assert tiers[0] == "system" and "recall" in tiers
    assert any("Biscuit" in s["text"] for s in r.structured_content["segments"] if s["tier"] == "recall")
    await call("delete_memory", memory_id=new_id)
    r = await call("list_memories", status="all")
    assert new_id not in {m["id"] for m in r.structured_content["memories"]}
    return {"deleted": new_id, "superseded": mem_id}


async def errors(client: Client, user_args: dict, deleted: int) -> None:
    """Bad arguments come back as tool errors with a message saying what was wrong."""
    cases = [
        ("search_memory", {"query": ""}, "query is empty"),
        ("search_memory", {"query": "dog", "k": 0}, "k must be between 1 and 100"),
        ("search_memory", {"query": "dog", "k": 1000}, "k must be between 1 and 100"),
        ("search_memory", {"query": "dog", "since": "2026-02-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"},
         "is after until"),
        ("delete_memory", {"memory_id": deleted}, "not found"),
        ("update_memory", {"memory_id": 123456789, "text": "x y"}, "not found"),
        ("delete_memory", {"memory_id": -4}, "positive integer"),
        ("add_memory", {"text": "x" * 40_000}, "the limit is"),
        ("add_memory", {"text": "nul \x00 here"}, "NUL"),
        ("add_messages", {"messages": []}, "messages is empty"),
        ("list_memories", {"status": "bogus"}, ""),
        ("set_core_block", {"label": "", "value": "v"}, "label is empty"),
        ("search_memory", {"k": 3}, ""),  # query missing: the SDK's own validation
    ]
    for name, args, message in cases:
        r = await client.call_tool(name, {**args, **user_args})
        assert r.is_error, (name, args)
        assert message in r.content[0].text, (name, r.content[0].text)
    r = await client.call_tool("search_memory", {"query": "dog", **user_args})
    assert not r.is_error  # the server is still up


def test_stdio_server_serves_every_tool_and_refuses_bad_arguments(tmp_path):
    env = {**os.environ, "AGENTMEM_DTYPE": "float32", "AGENTMEM_DEVICE": "cpu", "AGENTMEM_COMPILE": "off",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    params = StdioServerParameters(command=sys.executable, args=["-m", "agentmem.cli", "mcp", "--user", "alice",
                                                                "--data-dir", str(tmp_path)], env=env)

    async def main():
        async with Client(params, read_timeout_seconds=300) as client:
            seen = await exercise(client, {})
            await errors(client, {}, seen["deleted"])
            # another user named in the call has a memory of their own
            r = await client.call_tool("search_memory", {"query": "dog", "user_id": "bob"})
            assert not r.is_error and r.structured_content["hits"] == []
            blocks = await client.read_resource("agentmem://core/human")
            assert blocks.contents[0].text == "Name: Alice. Has a dog, Biscuit."
            listing = await client.read_resource("agentmem://core")
            assert '"label": "human"' in listing.contents[0].text
            templates = {t.uri_template for t in (await client.list_resource_templates()).resource_templates}
            assert {"agentmem://core/{label}", "agentmem://users/{user_id}/core"} <= templates
            assert "agentmem://core" in {str(r.uri) for r in (await client.list_resources()).resources}
            bob = await client.read_resource("agentmem://users/bob/core")
            assert bob.contents[0].text == "[]"

    asyncio.run(main())


@pytest.fixture
def served(engine, embedder, tmp_path):
    with serve(engine, embedder, tmp_path, tenants=("acme", "globex")) as s:
        yield s


@contextlib.asynccontextmanager
async def http_client(url: str, key: str | None, user: str | None = None):
    import httpx2  # the mcp client's HTTP library

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if user:
        headers["X-Agentmem-User"] = user
    async with httpx2.AsyncClient(headers=headers, timeout=300) as http:
        async with Client(streamable_http_client(url, http_client=http), read_timeout_seconds=300) as client:
            yield client


def test_http_endpoint_needs_a_key_and_keeps_tenants_apart(served):
    url = served.url + "/mcp"
    acme, globex = served.keys["acme"][1], served.keys["globex"][1]
    for key in (None, "am-wrong"):
        r = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                       headers={"Authorization": f"Bearer {key}"} if key else {})
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"

    async def main():
        async with http_client(url, acme, user="alice") as client:
            seen = await exercise(client, {})
            await errors(client, {}, seen["deleted"])
            r = await client.call_tool("search_memory", {"query": "Biscuit", "user_id": "alice"})
            assert r.structured_content["hits"]
            blocks = await client.read_resource("agentmem://core/human")
            assert blocks.contents[0].text == "Name: Alice. Has a dog, Biscuit."
        async with http_client(url, acme) as client:  # no header: the user must be named
            r = await client.call_tool("search_memory", {"query": "Biscuit"})
            assert r.is_error and "user_id is required" in r.content[0].text
        async with http_client(url, globex, user="alice") as client:  # same user id, another tenant
            r = await client.call_tool("search_memory", {"query": "What is my dog called?"})
            assert not r.is_error and r.structured_content["hits"] == []
            r = await client.call_tool("delete_memory", {"memory_id": seen["superseded"]})
            assert r.is_error and "not found" in r.content[0].text
            r = await client.call_tool("list_memories", {"status": "all"})
            assert r.structured_content["memories"] == []
            listing = await client.read_resource("agentmem://users/alice/core")
            assert listing.contents[0].text == "[]"

    asyncio.run(main())
    # what acme stored over MCP is acme's in REST too, and globex has nothing
    rest = served.client("acme").post("/v1/users/alice/search", json={"query": "dog"}).json()["data"]
    assert any(h["text"] == "My dog is called Biscuit." for h in rest)
    assert served.client("globex").get("/v1/users/alice/memories").status_code == 404


def test_a_deleted_key_stops_writing_at_once_and_reads_follow_the_key_cache(served):
    """Every MCP request is a POST, so the endpoint checks the key from the cache, as a REST read
    does; the tools that write look it up again in the database, as a REST write does."""
    from sqlalchemy import delete

    from agentmem.api import create_tenant_with_key
    from agentmem.tiers.schema import ApiKeyRow

    url = served.url + "/mcp"
    writes = {"add_memory": {"text": "Alice's locker code is now 9876."},
              "add_messages": {"messages": [{"role": "user", "content": "hi"}]},
              "update_memory": {"memory_id": 1, "text": "x"}, "delete_memory": {"memory_id": 1},
              "set_core_block": {"label": "human", "value": "x"}}

    async def main(write: str, tenant: str, key: str):
        async with http_client(url, key, user="alice") as client:
            r = await client.call_tool("add_memory", {"text": "Alice's locker code is 1234."})
            assert not r.is_error
            with served.store.archive.tx() as s:  # another process deletes the key
                s.execute(delete(ApiKeyRow).where(ApiKeyRow.tenant_id == tenant))
            r = await client.call_tool("list_memories", {})  # a read within the cache's lifetime answers
            assert "Alice's locker code is 1234." in [m["text"] for m in r.structured_content["memories"]]
            r = await client.call_tool(write, writes[write])
            assert r.is_error and "invalid API key" in r.content[0].text, write
        # the write taught the cache: from now on every request is a 401, reads too
        r = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 401, r.text
        texts = [m.text for m in served.store.list_memories(tenant, "alice")]
        assert texts == ["Alice's locker code is 1234."]  # nothing was written

    for write in writes:  # each write tool on a tenant of its own
        asyncio.run(main(write, *create_tenant_with_key(served.store, f"t-{write}")))


def test_without_the_extra_the_import_and_the_endpoint_name_it(monkeypatch, tmp_path):
    from fastapi.testclient import TestClient

    import agentmem.integrations
    from agentmem.api import create_app
    from agentmem.config import Config

    monkeypatch.setitem(sys.modules, "mcp", None)
    # as in a process that never imported it: neither the module nor the package's attribute
    monkeypatch.delitem(sys.modules, "agentmem.integrations.mcp_server", raising=False)
    monkeypatch.delattr(agentmem.integrations, "mcp_server", raising=False)
    with pytest.raises(ImportError, match=r"agentmem\[mcp\]"):
        importlib.import_module("agentmem.integrations.mcp_server")
    monkeypatch.delitem(sys.modules, "agentmem.integrations.mcp_server", raising=False)
    app = create_app(Config(data_dir=tmp_path), ui=False)
    r = TestClient(app).post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert r.status_code == 501 and "agentmem[mcp]" in r.json()["error"]["message"]


def test_add_messages_continues_names_or_starts_a_session(tmp_path):
    """Without session_id the user's latest conversation continues (a new one when there is
    none); a session_id the user has is appended to, an unknown one starts that conversation,
    and another user's session of the same id is never written to."""
    from agentmem.config import Config
    from agentmem.integrations.mcp_server import MemoryTools, MessageIn
    from agentmem.tiers.scope import InvalidId
    from agentmem.tiers.store import MemoryStore

    store = MemoryStore(Config(data_dir=tmp_path))
    try:
        tools = MemoryTools(store, lambda: None, store.config)

        def add(user, text, sid=None):
            return tools.add_messages("t", user, [MessageIn(role="user", content=text)], sid)[0]["session_id"]

        first = add("ann", "hello")
        assert add("ann", "again") == first
        assert add("ann", "in a named one", "trip-2027") == "trip-2027"
        assert add("ann", "more of it", "trip-2027") == "trip-2027"
        assert add("bob", "mine", "trip-2027") == "trip-2027"
        texts = {u: [m.text for m in store.session_messages("t", u, "trip-2027")] for u in ("ann", "bob")}
        assert texts == {"ann": ["in a named one", "more of it"], "bob": ["mine"]}
        assert [m.text for m in store.session_messages("t", "ann", first)] == ["hello", "again"]
        with pytest.raises(InvalidId, match="session_id"):
            add("ann", "x", "a/../b")
    finally:
        store.close()
