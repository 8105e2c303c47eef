"""MemGPT-style memory tools: strict parsing, execution, constrained decoding."""

from __future__ import annotations

import json

import pytest

from agentmem.config import Config
from agentmem.tiers import InvalidInput, MemoryStore
from agentmem.tiers.tools import TOOL_PROMPT, TOOLS, ToolCall, generate_tool_call, parse_tool_call, run_tool


@pytest.fixture
def store(tmp_path, embedder):
    s = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    yield s
    s.close()


@pytest.mark.parametrize("bad", ['{"tool": "x", "args": {}}', "not json", '{"tool": "archival_memory_insert"}',
                                 '{"tool": "archival_memory_insert", "args": {"content": 3}}',
                                 '{"tool": "archival_memory_search", "args": {"q": "dog"}}'])
def test_parse_rejects_malformed_calls(bad):
    with pytest.raises(InvalidInput):
        parse_tool_call(bad)


def test_tools_act_on_the_memory(store):
    sid = store.open_session("default", "u").id
    store.add_messages("default", "u", sid, [{"role": "user", "content": "My cat Tom hates rain."}])
    assert run_tool(store, "default", "u", sid, ToolCall("core_memory_append", {"label": "human", "content": "Cat: Tom"}))
    run_tool(store, "default", "u", sid, ToolCall("core_memory_replace",
                                                  {"label": "human", "old_content": "Tom", "new_content": "Tim"}))
    assert store.core_blocks("default", "u")[0].value == "Cat: Tim"
    with pytest.raises(InvalidInput):
        run_tool(store, "default", "u", sid, ToolCall("core_memory_replace",
                                                      {"label": "human", "old_content": "Rex", "new_content": "x"}))
    run_tool(store, "default", "u", sid, ToolCall("archival_memory_insert", {"content": "Owns a cat named Tom."}))
    assert [m.text for m in store.list_memories("default", "u")] == ["Owns a cat named Tom."]
    found = run_tool(store, "default", "u", sid, ToolCall("conversation_search", {"query": "cat and rain"}))
    assert "My cat Tom hates rain." in found and "Owns a cat" not in found


def test_constrained_decoding_always_gives_a_valid_call(engine):
    sys_open, sys_close = engine.chat.wraps["system"]
    prompt = (sys_open + TOOL_PROMPT + sys_close
              + engine.format_message("user", "Please remember that my favourite tea is oolong.")
              + engine.chat.generation_prefix)
    call = generate_tool_call(engine, prompt)
    assert call.name in TOOLS and set(call.args) == set(TOOLS[call.name])
    assert all(v and '"' not in v for v in call.args.values())
    assert parse_tool_call(call.to_json()) == call
    assert json.loads(call.to_json())["tool"] == call.name
