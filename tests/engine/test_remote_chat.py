"""The remote engine's chat mode against a real server: llama-cpp-python's OpenAI-compatible
server on the default GGUF, through `/v1/chat/completions` (`llama_server`, conftest.py: one
for the session, on a free loopback port; `make bench-peers` / `make test` install it; skipped,
saying so, where llama_cpp is not importable). Provider shapes that cannot run here are in
test_remote_chat_wire.py (fakes)."""

from __future__ import annotations

import importlib.util
import json

import httpx
import pytest

from agentmem.api import create_app, create_tenant_with_key
from agentmem.api.local import LocalServer
from agentmem.config import Config
from agentmem.engine import EngineUnavailable, PromptTooLong, Segment, load_engine
from agentmem.engine.llama_server import LlamaServer, log_cache_hits
from agentmem.engine.remote import RemoteEngine
from agentmem.session import AgentSession
from agentmem.tiers import MemoryStore

pytestmark = [pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed: `make bench-peers` builds and installs it (the remote engine's peer)"),
    pytest.mark.slow]  # the server loads the model

WINDOW = 2048  # the window agentmem is told (engine_context); the shared server's is larger
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def _config(tmp_path, url: str, **kw) -> Config:
    return Config(data_dir=tmp_path, engine_url=url, engine_retries=2,
                  **{"engine_context": WINDOW, "context_budget": 1024, "reply_tokens": 128, **kw})


@pytest.fixture
def chat(llama_server, tmp_path) -> RemoteEngine:
    e = load_engine(_config(tmp_path, llama_server.url, engine_api="chat"))
    yield e
    e.close()


def test_auto_picks_completions_where_the_tokenizer_is_the_servers_and_chat_where_asked(llama_server, tmp_path, chat):
    auto = load_engine(_config(tmp_path, llama_server.url))
    assert auto.api == "completions"  # the server has the route and counts as the local files do
    assert chat.api == "chat" and chat.budget.exact  # the same test tells the files are the model's
    no_route = load_engine(_config(tmp_path, llama_server.url))
    no_route._has_route = lambda path: False  # a chat-only server (OpenAI, Anthropic's and Gemini's endpoints)
    assert no_route.api == "chat"
    for e in (auto, no_route):
        e.close()


def test_chat_turns_stream_and_the_stable_prefix_is_reused(llama_server, chat, tmp_path, embedder):
    cfg = _config(tmp_path, llama_server.url, engine_api="chat")
    store = MemoryStore(cfg, embedder=embedder)
    s = AgentSession("alice", config=cfg, engine=chat, store=store)
    s.chat("My cat is called Miso and she is three years old.", max_tokens=8)
    before = log_cache_hits(llama_server.log_text())["cached_tokens"]
    pieces = list(s.chat_stream("What is my cat called?", max_tokens=12))
    assert len(pieces) > 1 and "".join(pieces).strip() == s.last_turn.reply
    trace = store.turns("default", "alice")[-1].trace
    server_stats = trace["stats"]["server"]
    assert server_stats["api"] == "chat" and server_stats["messages"] >= 2 and server_stats["dropped_notes"] == 0
    assert "cached_tokens" in server_stats  # None: llama-cpp-python reports none (its log does, below)
    assert "Miso" in trace["segments"][-2]["text"] or any("Miso" in seg["text"] for seg in trace["segments"])
    # the system message (persona, core blocks) leads every turn, so the server's own prefix
    # cache reuses it: its log shows a prefix hit for this turn
    assert log_cache_hits(llama_server.log_text())["cached_tokens"] > before
    assert chat.budget.calibrated and 0.9 < chat.budget.factor < 1.2  # the same tokenizer: ~1, template aside
    assert [m.role for m in store.session_messages("default", "alice", s.session_id)] == ["user", "assistant"] * 2
    store.close()


def test_tools_go_to_the_server_and_its_calls_come_back(chat):
    prompt = chat.chat_segments([{"role": "user", "content": "What is the weather in Paris?"}])
    g = chat.generate(prompt, max_tokens=48, native={"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    assert g.stats.finish_reason == "tool_calls" and g.stats.tool_calls
    call = g.stats.tool_calls[0]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])


def test_rest_service_fronting_the_chat_engine(llama_server, chat, tmp_path, embedder):
    cfg = _config(tmp_path, llama_server.url, engine_api="chat")
    store = MemoryStore(cfg, embedder=embedder)
    tenant, key = create_tenant_with_key(store, "acme")
    with LocalServer(create_app(cfg, engine=chat, store=store, ui=False)) as api:
        r = httpx.post(api.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                       json={"model": "smollm2", "user": "erin", "max_tokens": 48, "tools": TOOLS,
                             "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                             "messages": [{"role": "user", "content": "What is the weather in Lisbon?"}]})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert [m.text for m in store.archive.messages(tenant, "erin")] == ["What is the weather in Lisbon?"]
    store.close()


def test_budgets_without_the_tokenizer_never_reach_the_servers_400(llama_server, tmp_path, embedder):
    """The estimator path (the tokenizer not known to be the model's): long turns near the
    budget, a window the budget's bound must respect, and no prompt-too-long from the server."""
    cfg = _config(tmp_path, llama_server.url, engine_api="chat", context_budget=1400, reply_tokens=64)
    e = load_engine(cfg)
    e._server_counts_as_local = lambda: False  # as for a model whose tokenizer agentmem lacks
    assert e.api == "chat" and not e.budget.exact
    assert e.context_window < WINDOW  # the window in counted tokens, bounded by the prior
    store = MemoryStore(cfg, embedder=embedder)
    s = AgentSession("frank", config=cfg, engine=e, store=store)
    long = " ".join(f"On day {i} I walked to the harbour, bought bread at the bakery and met my friend Ana." for i in
                    range(12))
    for i in range(3):
        s.chat(f"{long} Turn {i}.", max_tokens=4)
        st = s.last_turn.stats.server
        assert st["bound_tokens"] + 1 <= WINDOW
    assert e.budget.calibrated
    # a prompt over the window: the notes go first, the least relevant first, and it is served
    uo, uc = e.chat.wraps["user"]
    notes = [Segment(f"- 2026-01-{i % 28 + 1:02d} I said: \"{long}\"\n", tier="recall", ref=f"m{i}") for i in range(10)]
    prompt = [Segment(uo + "Notes:\n", tier="recall", ref="recall:header"), *notes,
              Segment("\nUsing these notes, answer: Where did I walk?" + uc, tier="user")]
    g = e.generate(prompt, max_tokens=8)
    assert g.stats.server["dropped_notes"] >= 1 and g.stats.server["bound_tokens"] < WINDOW
    with pytest.raises(PromptTooLong):  # nothing left to drop: refused here, not by the server
        e.generate([Segment(long * 8, tier="user")], max_tokens=8)
    # and the server does refuse what the bound keeps out: a window set too large lets through a
    # prompt past the server's own (conftest.LLAMA_CTX, 4096: this text is ~6k tokens)
    wrong = load_engine(_config(tmp_path, llama_server.url, engine_api="chat", engine_context=8 * WINDOW))
    over = [{"role": "user", "content": long * 24}]
    r = httpx.post(llama_server.url + "/v1/chat/completions", timeout=120,
                   json={"model": "smollm2", "messages": over, "max_tokens": 8})
    assert r.status_code == 400 and "context" in r.text  # unstreamed, the server's prompt-too-long
    # streamed (as the engine asks), llama-cpp-python answers 200 and an empty stream instead:
    # the turn fails all the same, saying the reply never came
    with pytest.raises(EngineUnavailable, match="without finishing the reply"):
        wrong.generate([Segment(long * 24, tier="user")], max_tokens=8)
    for x in (e, wrong):
        x.close()
    store.close()


def test_server_down_keeps_the_message_and_says_so(tmp_path, embedder):
    dying = LlamaServer(tmp_path / "llama.log", n_ctx=WINDOW)
    cfg = _config(tmp_path, dying.url, engine_api="chat")
    store = MemoryStore(cfg, embedder=embedder)
    e = load_engine(cfg)
    s = AgentSession("gina", config=cfg, engine=e, store=store)
    out = s.chat_stream("Write a long story about a lighthouse keeper and the sea.", max_tokens=300)
    first = next(out)
    dying.kill()
    with pytest.raises(EngineUnavailable, match="broke off|ended the stream"):
        for _ in out:
            pass
    assert first
    with pytest.raises(EngineUnavailable, match="unreachable after 3 tries"):
        s.chat("Are you there?", max_tokens=4)
    assert [m.text for m in store.session_messages("default", "gina", s.session_id)] == [
        "Write a long story about a lighthouse keeper and the sea.", "Are you there?"]
    e.close()
    store.close()
