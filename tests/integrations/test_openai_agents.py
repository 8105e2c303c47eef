"""The OpenAI Agents SDK adapter (integrations/openai_agents.py) with the real SDK: the `Session`
protocol as the SDK's own SQLiteSession keeps it, items exactly as given, what they say as the
user's searchable memory (gone again when popped or cleared), and `Runner.run` against a real
`agentmem serve`."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import time

import pytest
from _serve import serve
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner
from agents.memory import Session, SQLiteSession
from agents.tool_context import ToolContext
from openai import AsyncOpenAI

from agentmem.config import Config
from agentmem.integrations.openai_agents import AgentmemSession, recall_memory_tool
from agentmem.session import AgentSession
from agentmem.tiers import InvalidInput, MemoryStore, recall, session_items


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def store(tmp_path, embedder):
    s = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    yield s
    s.close()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


WEATHER_CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "id": "fc_1",
                "arguments": json.dumps({"city": "Porto"}), "status": "completed"}
WEATHER_OUT = {"type": "function_call_output", "call_id": "call_1", "output": "Porto: 18 degrees, light drizzle"}
REPLY = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Bring an umbrella to Porto.", "annotations": [],
                      "logprobs": []}]}
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "weather first"}],
             "encrypted_content": None}


def found(store: MemoryStore, tenant: str, user_id: str, query: str, text: str, **kw) -> bool:
    return any(text in h.text for h in store.search(tenant, user_id, query, k=10, **kw))


def test_session_behaves_as_the_sdks_sqlite_session(store):
    ours = AgentmemSession("s1", "ana", store=store)
    theirs = SQLiteSession("s1")
    items = [user("one"), REPLY, user("three"), WEATHER_CALL, WEATHER_OUT]

    async def both(op):
        return await op(ours), await op(theirs)

    async def main():
        assert isinstance(ours, Session)
        assert await both(lambda s: s.pop_item()) == (None, None)
        assert await both(lambda s: s.get_items()) == ([], [])
        await both(lambda s: s.add_items(items[:2]))
        await both(lambda s: s.add_items([]))
        await both(lambda s: s.add_items(items[2:]))
        for limit in (None, 2, 0, 1, 5, 50, -1):
            a, b = await both(lambda s, n=limit: s.get_items(limit=n))
            assert a == b, limit
        assert (await ours.get_items(limit=2)) == items[3:]
        assert (await ours.get_items()) == items
        assert await both(lambda s: s.pop_item()) == (WEATHER_OUT, WEATHER_OUT)
        assert (await ours.get_items()) == items[:4]
        await both(lambda s: s.clear_session())
        assert await both(lambda s: s.get_items()) == ([], [])
        assert await both(lambda s: s.pop_item()) == (None, None)
        # the default limit is the session settings'
        limited = AgentmemSession("s2", "ana", store=store, session_settings={"limit": 2})
        await limited.add_items(items)
        assert await limited.get_items() == items[3:]
        assert await limited.get_items(limit=4) == items[1:]

    run(main())
    theirs.close()


def test_items_round_trip_exactly(tmp_path, embedder):
    items = [
        user("hello"),
        {"role": "user", "content": [{"type": "input_text", "text": "look ☂ here"},
                                     {"type": "input_image", "image_url": "https://example.invalid/a.png",
                                      "detail": "auto"}]},
        {"role": "developer", "content": "be brief"},
        REASONING, WEATHER_CALL, WEATHER_OUT, REPLY,
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "part one"}, {"type": "input_text", "text": "part two"}]},
        {"type": "message", "role": "assistant", "content": [], "id": "msg_2", "status": "incomplete",
         "extra": {"n": 3, "x": 1.5, "ok": True, "none": None, "nested": [[1, "a"], {"b": ""}]}},
    ]
    config = Config(data_dir=tmp_path)
    store = MemoryStore(config, embedder=embedder)
    run(AgentmemSession("s", "ana", store=store).add_items(items))
    assert run(AgentmemSession("s", "ana", store=store).get_items()) == items
    store.close()
    again = AgentmemSession("s", "ana", config=config)  # its own store, on the same files
    assert run(again.get_items()) == items
    again.close()


def test_what_items_say_is_the_users_memory(store):
    session = AgentmemSession("trip", "ana", store=store)
    run(session.add_items([user("My sister Maya teaches piano in Porto."), REASONING, WEATHER_CALL,
                           WEATHER_OUT, REPLY, {"role": "system", "content": "you are a travel agent"}]))
    said = store.session_messages("default", "ana", "trip")
    assert [(m.role, m.text) for m in said] == [
        ("user", "My sister Maya teaches piano in Porto."),
        ("tool", 'called get_weather({"city": "Porto"})'),
        ("tool", "Porto: 18 degrees, light drizzle"),
        ("assistant", "Bring an umbrella to Porto."),
    ]
    # found from any other session of the user
    other = store.open_session("default", "ana").id
    assert other != "trip"
    assert found(store, "default", "ana", "who teaches piano?", "Maya teaches piano")
    assert found(store, "default", "ana", "drizzle in Porto", "light drizzle")
    assert found(store, "default", "ana", "what weather tool did I call", "called get_weather")
    assert not found(store, "default", "ana", "travel agent", "travel agent")  # system text is not memory


def test_recall_memory_tool_finds_the_users_memory_and_is_not_memory_itself(store):
    guess = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Your dog Max?"}]}
    run(AgentmemSession("earlier", "ana", store=store).add_items([user("My dog is called Rex."), guess]))
    assert found(store, "default", "ana", "the user's dog", "Your dog Max?")
    tool = recall_memory_tool("ana", store=store, k=3)
    assert tool.name == "recall_memory" and "remember" in tool.description
    args = json.dumps({"query": "the user's dog"})
    ctx = ToolContext(context=None, tool_name=tool.name, tool_call_id="call_r", tool_arguments=args)
    out = run(tool.on_invoke_tool(ctx, args))
    assert "the user said: My dog is called Rex." in out and out.startswith("- 20")
    assert "Max" not in out  # the agent's own earlier guesses are not evidence
    nobody = recall_memory_tool("bob", store=store)
    assert run(nobody.on_invoke_tool(ctx, args)) == "Nothing remembered about that."
    # a recall's call and output are stored as items, never as memory read back again later
    session = AgentmemSession("now", "ana", store=store)
    call = {"type": "function_call", "call_id": "call_r", "name": "recall_memory", "arguments": args}
    run(session.add_items([user("what is my dog called?"), call,
                           {"type": "function_call_output", "call_id": "call_r", "output": out}]))
    assert run(session.get_items())[1:] == [call, {"type": "function_call_output", "call_id": "call_r",
                                                   "output": out}]
    assert [m.text for m in store.session_messages("default", "ana", "now")] == ["what is my dog called?"]


def test_users_and_tenants_are_isolated(store):
    t2 = store.create_tenant("other")
    scopes = [("default", "ana"), ("default", "bob"), (t2, "ana")]
    sessions = {scope: AgentmemSession("same-id", scope[1], scope[0], store=store) for scope in scopes}
    for (tenant, uid), s in sessions.items():
        run(s.add_items([user(f"{uid} of {tenant} keeps a secret parrot named Kiwi-{uid}-{tenant}")]))
    for (tenant, uid), s in sessions.items():
        mine = f"Kiwi-{uid}-{tenant}"
        assert [i["content"].split()[-1] for i in run(s.get_items())] == [mine]
        hits = store.search(tenant, uid, "secret parrot named Kiwi")
        assert {h.text.split()[-1] for h in hits} == {mine}
    run(sessions[("default", "ana")].clear_session())
    assert run(sessions[("default", "ana")].get_items()) == []
    assert run(sessions[("default", "bob")].pop_item())["content"].endswith("Kiwi-bob-default")
    assert len(run(sessions[(t2, "ana")].get_items())) == 1
    assert found(store, t2, "ana", "secret parrot", f"Kiwi-ana-{t2}")


def test_popped_and_cleared_items_leave_search_at_once(store, monkeypatch):
    # no reconcile by count during the test: what vanishes must vanish without it
    monkeypatch.setattr(recall, "COUNT_SECONDS", 1e9)
    a, b, c = (AgentmemSession(sid, "ana", store=store) for sid in "abc")
    run(AgentmemSession("first", "ana", store=store).add_items([user("I grew up by the sea in Vigo.")]))
    run(a.add_items([user("I keep bees on the roof of my flat."), user("My violin was made in Cremona.")]))
    run(b.add_items([user("The marathon in Seville is in February.")]))
    run(c.add_items([user("My favourite cheese is a smoked Idiazabal.")]))
    kept = (("growing up by the sea", "Vigo"), ("marathon in Seville", "Seville"))
    cleared = (("bees on the roof", "bees"), ("violin made in Cremona", "Cremona"))
    popped = ("smoked Idiazabal cheese", "Idiazabal")
    everything = (None, {"dense"}, {"lexical"})
    for retrievers in everything:
        for query, text in (*kept, *cleared, popped):
            assert found(store, "default", "ana", query, text, retrievers=retrievers), (query, retrievers)
    # from the middle of the user's history: the index's newest and oldest messages stay, so
    # it has no reason to reconcile; search must drop them all the same
    run(a.clear_session())
    assert run(a.get_items()) == [] and store.session_messages("default", "ana", "a") == []
    for retrievers in everything:
        for query, text in cleared:
            assert not found(store, "default", "ana", query, text, retrievers=retrievers), (query, retrievers)
    assert run(c.pop_item()) == user("My favourite cheese is a smoked Idiazabal.")  # the user's newest
    for retrievers in everything:
        assert not found(store, "default", "ana", *popped, retrievers=retrievers), retrievers
        for query, text in kept:
            assert found(store, "default", "ana", query, text, retrievers=retrievers), (query, retrievers)


def test_concurrent_pops_take_each_item_once(store):
    s = AgentmemSession("s", "ana", store=store)
    items = [user(f"item {i}") for i in range(6)]
    run(s.add_items(items))

    async def pops():
        return await asyncio.gather(*[s.pop_item() for _ in range(8)])

    got = run(pops())
    assert sorted((g for g in got if g is not None), key=lambda i: i["content"]) == items
    assert got.count(None) == 2
    assert store.session_messages("default", "ana", "s") == []


def test_bad_items_are_refused_whole(store):
    s = AgentmemSession("s", "ana", store=store)
    for bad in ([user("fine"), user("nul \x00 inside")], [user("lone \ud800 surrogate")],
                [{"type": "function_call_output", "call_id": "c", "output": "x", "score": float("nan")}],
                [{"role": "user", "content": b"bytes are not JSON"}], ["not a dict"]):
        with pytest.raises(InvalidInput):
            run(s.add_items(bad))
    assert run(s.get_items()) == []
    assert store.list_sessions("default", "ana") == []


def test_the_sql_runs_off_the_event_loop(store, monkeypatch):
    slow_items = session_items.items

    def slow(*args, **kw):
        time.sleep(0.3)
        return slow_items(*args, **kw)

    monkeypatch.setattr(session_items, "items", slow)
    s = AgentmemSession("s", "ana", store=store)

    async def main():
        ticks = 0

        async def heartbeat():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        beat = asyncio.create_task(heartbeat())
        await s.get_items()
        beat.cancel()
        return ticks

    assert run(main()) >= 5  # blocked, the loop would have ticked once


def test_runner_keeps_its_turns_in_the_session(engine, embedder, tmp_path):
    with serve(engine, embedder, tmp_path, max_tokens=128) as served:
        tenant, key = served.keys["acme"]
        store = served.store
        session = AgentmemSession("now", "ana", tenant, store=store)
        quiet = RunConfig(tracing_disabled=True)

        async def turns():  # one event loop: the OpenAI client's connections belong to it
            await AgentmemSession("before", "ana", tenant, store=store).add_items([user("My dog is called Rex.")])
            client = AsyncOpenAI(base_url=served.url + "/v1", api_key=key)
            model = OpenAIChatCompletionsModel(model="agentmem", openai_client=client)
            # turn one: the model must call recall_memory (the server's grammar makes the call
            # parse, its query at most 160 characters); its output ends the turn. Greedy: the same
            # reply every run
            recaller = Agent(name="helper", instructions="Answer from memory.", model=model,
                             tools=[recall_memory_tool("ana", tenant, store=store)],
                             tool_use_behavior="stop_on_first_tool",
                             model_settings=ModelSettings(max_tokens=96, temperature=0.0,
                                                         tool_choice="required"))
            first = await Runner.run(recaller, "What is my dog called?", session=session, run_config=quiet)
            after_first = await session.get_items()
            # turn two: a plain reply, on top of the history the session gave the model
            talker = Agent(name="helper", instructions="Be brief.", model=model,
                           model_settings=ModelSettings(max_tokens=8, temperature=0.0))
            second = await Runner.run(talker, "I also have a cat, Miso.", session=session, run_config=quiet)
            await client.close()
            return first, after_first, second, await session.get_items()

        first, got, second, everything = run(turns())
        assert "My dog is called Rex." in first.final_output
        assert [i.get("type", "message") for i in got] == ["message", "function_call", "function_call_output"]
        assert got[0] == user("What is my dog called?")
        assert got[1]["name"] == "recall_memory" and got[2]["call_id"] == got[1]["call_id"]
        assert got[2]["output"] == first.final_output
        assert everything[:3] == got and len(everything) == 5
        assert everything[3] == user("I also have a cat, Miso.")
        assert everything[4]["type"] == "message" and everything[4]["role"] == "assistant"
        assert everything[4]["content"][0]["text"] == second.final_output
        # the user's words are memory for any session, the REST service's and AgentSession's
        assert found(store, tenant, "ana", "cat named Miso", "I also have a cat, Miso.")
        later = AgentSession("ana", tenant_id=tenant, engine=engine, store=store)
        assert any("cat, Miso" in h.text for h in later.search("what is my cat called"))


def test_import_without_the_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "agents", None)
    monkeypatch.delitem(sys.modules, "agentmem.integrations.openai_agents")
    with pytest.raises(ImportError, match=r"agentmem\[agents\]"):
        importlib.import_module("agentmem.integrations.openai_agents")
