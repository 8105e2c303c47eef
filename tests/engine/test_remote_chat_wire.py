"""The remote engine's chat mode against FAKE providers (httpx.MockTransport): the shapes of
hosted chat APIs that cannot run on this machine. Each fake is named after the provider
behaviour it stands for: OpenAI's cached-token usage and error `param`, Anthropic's
OpenAI-compatible endpoint refusing `top_k` and `stream_options`, Gemini's compatible
endpoint's list-shaped error, vLLM's `max_model_len`, a provider whose tokenizer counts 1.5x
the local one, 429s, 5xx, a stream cut mid-reply, a refusal. The real llama.cpp server is in
test_remote_chat.py."""

from __future__ import annotations

import json

import httpx
import pytest

from agentmem.engine import EngineRefused, EngineUnavailable, PromptTooLong, Segment
from agentmem.engine.remote import RemoteEngine
from agentmem.engine.remote_budget import MARGIN, PRIOR_FACTOR
from agentmem.engine.remote_chat import to_messages


class FakeProvider:
    """A chat-only OpenAI-compatible API in a function. `ratio`: its tokens per local token;
    `refuse`: request fields it answers 400 to (`style`: how its error says so)."""

    def __init__(self, engine, ratio: float = 1.0, refuse: tuple[str, ...] = (), style: str = "openai",
                 cached: int | None = None, usage_in_stream: bool = True, models: dict | None = None):
        self.engine, self.ratio, self.refuse, self.style = engine, ratio, refuse, style
        self.cached, self.usage_in_stream = cached, usage_in_stream
        self.models = models or {"id": "fake-model"}
        self.requests: list[dict] = []
        self.fail: list[int] = []  # statuses to answer before serving (429, 503 ...)
        self.cut_after: int | None = None  # pieces before the stream breaks off
        self.reply = ["The ", "answer ", "is ", "blue."]
        self.tool_calls: list[dict] | None = None
        self.refusal: str | None = None

    def count(self, messages: list[dict]) -> int:
        text = "".join(self.engine.format_message(m["role"], m["content"] or "") for m in messages)
        return round(self.engine.count_tokens(text) * self.ratio) + 3

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [self.models]})
        if path != "/v1/chat/completions":
            return httpx.Response(404, json={"error": {"message": "Not Found"}})
        body = json.loads(request.content)
        if not body.get("messages"):
            return httpx.Response(400, json={"error": {"message": "messages is required", "param": "messages"}})
        self.requests.append(body)
        if self.fail:
            return httpx.Response(self.fail.pop(0), json={"error": {"message": "slow down"}})
        for name in self.refuse:
            if name in body:
                if self.style == "openai":
                    err = {"error": {"message": f"Unrecognized request argument supplied: {name}", "param": None}}
                elif self.style == "anthropic":
                    err = {"error": {"type": "invalid_request_error", "message": f"{name}: Extra inputs are not permitted"}}
                else:  # gemini's compatible endpoint: a list of errors
                    err = [{"error": {"code": 400, "message": f'Invalid JSON payload received. Unknown name "{name}"'}}]
                return httpx.Response(400, json=err)
        usage = {"prompt_tokens": self.count(body["messages"]), "completion_tokens": len(self.reply)}
        if self.cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
        if not body.get("stream"):
            return httpx.Response(200, json={"choices": [{"message": {"content": "x"}, "finish_reason": "length"}],
                                             "usage": usage})
        events = [{"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
        pieces = self.reply if self.cut_after is None else self.reply[: self.cut_after]
        events += [{"choices": [{"delta": {"content": p}, "finish_reason": None}]} for p in pieces]
        if self.tool_calls:
            for i, call in enumerate(self.tool_calls):  # a call arrives in fragments
                args = call["arguments"]
                events.append({"choices": [{"delta": {"tool_calls": [{"index": i, "id": f"call_{i}", "type": "function",
                               "function": {"name": call["name"], "arguments": args[:5]}}]}}]})
                events.append({"choices": [{"delta": {"tool_calls": [{"index": i, "function": {"arguments": args[5:]}}]}}]})
        if self.refusal:
            events.append({"choices": [{"delta": {"refusal": self.refusal}, "finish_reason": None}]})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
        if self.cut_after is not None:
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        finish = "tool_calls" if self.tool_calls else "stop"
        text += f"data: {json.dumps({'choices': [{'delta': {}, 'finish_reason': finish}]})}\n\n"
        if self.usage_in_stream and body.get("stream_options", {}).get("include_usage"):
            text += f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        return httpx.Response(200, text=text + "data: [DONE]\n\n", headers={"content-type": "text/event-stream"})


def _remote(engine, fake: FakeProvider, window: int = 8192, ask_window: bool = False) -> RemoteEngine:
    r = RemoteEngine("http://fake", engine.tokenizer, api="chat", exact_tokenizer=False, context_window=window,
                     retries=2, backoff_s=0.0, ask_window=ask_window)
    r.http = httpx.Client(base_url=r.url, transport=httpx.MockTransport(fake))
    return r


def _turn(engine) -> list[Segment]:
    """A prompt as the assembly makes it: system (persona, core block), notes and question."""
    so, sc = engine.chat.wraps["system"]
    uo, uc = engine.chat.wraps["user"]
    return [Segment(f"{so}You are a helpful assistant.\n", tier="system"), Segment("[human]\nName: Ana\n", tier="core"),
            Segment(sc, tier="system"), Segment(engine.format_message("user", "Hi, I'm Ana."), tier="turn"),
            Segment(engine.format_message("assistant", "Hello Ana!"), tier="turn"),
            Segment(uo + "Notes:\n", tier="recall", ref="recall:header"),
            Segment("- 2026-01-02 I said: \"My car is blue.\"\n", tier="recall", ref="m1"),
            Segment("\nUsing these notes, answer: What colour is my car?" + uc, tier="user"),
            Segment(engine.chat.generation_prefix, cacheable=False, tier="generation")]


def test_segments_become_messages_in_assembly_order(engine):
    msgs = to_messages(_turn(engine), engine.chat)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"] == "You are a helpful assistant.\n[human]\nName: Ana\n"
    assert msgs[1]["content"] == "Hi, I'm Ana." and msgs[2]["content"] == "Hello Ana!"
    assert msgs[3]["content"].startswith("Notes:\n- 2026-01-02") and msgs[3]["content"].endswith("my car?")
    rendered = "".join(s.text for s in _turn(engine))  # a rendered text maps the same
    assert to_messages(rendered, engine.chat) == msgs
    assert not any("<|im_start|>" in m["content"] or "<|im_end|>" in m["content"] for m in msgs)


def test_openai_shape_streams_reports_cached_tokens_and_calibrates(engine):
    fake = FakeProvider(engine, ratio=1.5, cached=42)
    r = _remote(engine, fake)
    assert r.context_window == int(8191 / (PRIOR_FACTOR * (1 + MARGIN)))  # before the server said anything
    s = r.stream(_turn(engine), max_tokens=16, temperature=0.0)
    assert list(s) == fake.reply and s.result.text == "The answer is blue."
    st = s.result.stats
    assert st.server["cached_tokens"] == 42 and st.reused_tokens == 42 and st.server["api"] == "chat"
    assert st.prompt_tokens == fake.count(fake.requests[-1]["messages"])  # the server's count, not ours
    sent = fake.requests[-1]
    assert "top_k" not in sent and "min_p" not in sent and "repetition_penalty" not in sent  # off: not sent
    assert sent["stream_options"] == {"include_usage": True} and sent["temperature"] == 0.0
    # calibrated: the bound now follows the provider's 1.5 tokens per local token
    assert r.budget.calibrated and 1.35 < r.budget.factor < 1.65
    assert r.budget.upper(st.server["counted_tokens"]) >= st.prompt_tokens


def test_a_refused_parameter_is_named(engine):
    for style in ("openai", "anthropic", "gemini"):
        fake = FakeProvider(engine, refuse=("top_k",), style=style)
        r = _remote(engine, fake)
        with pytest.raises(EngineRefused) as e:
            r.generate(_turn(engine), max_tokens=8, top_k=20)
        assert e.value.param == "top_k" and "'top_k'" in str(e.value) and e.value.status == 400
        assert len(fake.requests) == 2  # the calibration probe and the request: a 400 is not retried
        assert r.generate(_turn(engine), max_tokens=8).text  # top-k off is not sent, so it is served


def test_anthropic_shape_without_stream_options(engine):
    fake = FakeProvider(engine, refuse=("stream_options",), style="anthropic", usage_in_stream=False)
    r = _remote(engine, fake)
    assert r.generate(_turn(engine), max_tokens=8).text == "The answer is blue."
    assert "stream_options" not in fake.requests[-1]
    r.generate(_turn(engine), max_tokens=8)
    assert "stream_options" not in fake.requests[-1]  # remembered: asked once


def test_429_and_5xx_are_retried_then_unavailable(engine):
    fake = FakeProvider(engine)
    r = _remote(engine, fake)
    r.generate(_turn(engine), max_tokens=8)  # calibrated: no probe before the next ones
    fake.fail = [429, 503]
    assert r.generate(_turn(engine), max_tokens=8).text == "The answer is blue."
    fake.fail = [502, 500, 503]
    with pytest.raises(EngineUnavailable) as e:
        r.generate(_turn(engine), max_tokens=8)
    assert not isinstance(e.value, EngineRefused) and "after 3 tries" in str(e.value)


def test_a_stream_cut_mid_reply_and_a_refusal(engine):
    fake = FakeProvider(engine)
    r = _remote(engine, fake)
    fake.cut_after = 2
    s = r.stream(_turn(engine), max_tokens=8)
    with pytest.raises(EngineUnavailable, match="ended the stream without finishing"):
        list(s)
    fake.cut_after, fake.reply, fake.refusal = None, [], "I can't help with that."
    with pytest.raises(EngineRefused, match="I can't help with that"):
        r.generate(_turn(engine), max_tokens=8)


def test_tool_calls_and_native_fields_pass_through(engine):
    fake = FakeProvider(engine)
    fake.reply, fake.tool_calls = [], [{"name": "get_weather", "arguments": '{"city": "Lisbon"}'}]
    r = _remote(engine, fake)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    g = r.generate(_turn(engine), max_tokens=32, native={"tools": tools, "tool_choice": "auto"})
    assert fake.requests[-1]["tools"] == tools and fake.requests[-1]["tool_choice"] == "auto"
    assert g.stats.tool_calls == [{"id": "call_0", "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'}}]
    assert g.stats.finish_reason == "tool_calls"


def test_window_from_metadata_and_notes_dropped_to_fit(engine):
    fake = FakeProvider(engine, ratio=1.0, models={"id": "fake-model", "max_model_len": 120})  # vLLM's field
    r = _remote(engine, fake, ask_window=True)
    assert r.server_context == 120
    prompt = _turn(engine)
    prompt[6:6] = [Segment(f"- 2026-01-0{i} I said: \"note number {i} about nothing much at all\"\n", tier="recall",
                           ref=f"n{i}") for i in range(1, 8)]
    g = r.generate(prompt, max_tokens=200)
    sent = fake.requests[-1]
    assert g.stats.server["dropped_notes"] > 0 and "My car is blue" in sent["messages"][-1]["content"]
    assert fake.count(sent["messages"]) + sent["max_tokens"] <= 120  # prompt and reply fit the window
    tiny = FakeProvider(engine, models={"id": "fake-model", "max_model_len": 20})
    with pytest.raises(PromptTooLong):
        _remote(engine, tiny, ask_window=True).generate(_turn(engine), max_tokens=8)
    assert not tiny.requests  # refused here, before the server could answer 400


def test_rest_service_fronting_a_chat_engine_passes_tools_through(engine, embedder, tmp_path):
    """An agent framework calling `agentmem serve`: the provider's own tool calls come back,
    with the user's memory added to the prompt it got."""
    from agentmem.api import create_app, create_tenant_with_key
    from agentmem.api.local import LocalServer
    from agentmem.config import Config
    from agentmem.tiers import MemoryStore

    fake = FakeProvider(engine)
    remote = _remote(engine, fake)
    cfg = Config(data_dir=tmp_path, engine_url="http://fake")
    store = MemoryStore(cfg, embedder=embedder)
    _, key = create_tenant_with_key(store, "acme")
    tools = [{"type": "function", "function": {"name": "book_table", "description": "Book a restaurant table",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    auth = {"Authorization": f"Bearer {key}"}
    with LocalServer(create_app(cfg, engine=remote, store=store, ui=False)) as api:
        def post(**body):
            return httpx.post(api.url + "/v1/chat/completions", headers=auth, timeout=60,
                              json={"model": "fake-model", "max_tokens": 32, **body})

        assert post(user="dan", messages=[{"role": "user", "content": "I live in Porto now."}]).status_code == 200
        fake.reply, fake.tool_calls = [], [{"name": "book_table", "arguments": '{"city": "Porto"}'}]
        r = post(user="dan", tools=tools, tool_choice="auto",
                 messages=[{"role": "user", "content": "Book me a table in the city I live in."}])
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["tool_calls"][0]["function"] == {"name": "book_table", "arguments": '{"city": "Porto"}'}
        sent = fake.requests[-1]
        assert sent["tools"] == tools and sent["tool_choice"] == "auto"
        assert "I live in Porto now." in sent["messages"][-1]["content"]  # memory in the prompt
        assert not any("<tool_call>" in m["content"] for m in sent["messages"])  # no grammar prompt of our own
        # streamed, and stateless: the request's own messages, tool results included, as they are
        history = [{"role": "user", "content": "Weather?"},
                   {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "book_table", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "done"}]
        with httpx.stream("POST", api.url + "/v1/chat/completions", headers=auth, timeout=60,
                          json={"model": "fake-model", "max_tokens": 32, "stream": True, "tools": tools,
                                "messages": history}) as s:
            chunks = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data: {")]
        calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
        assert calls and calls[0][0]["function"]["name"] == "book_table"
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert fake.requests[-1]["messages"][1]["tool_calls"][0]["id"] == "c1"
        assert fake.requests[-1]["messages"][2] == {"role": "tool", "content": "done", "tool_call_id": "c1"}
    store.close()
