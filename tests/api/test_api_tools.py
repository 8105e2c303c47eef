"""Agent frameworks' side of the chat API, through the official openai client on a real
server: tools (plain and streamed), a named tool_choice, a role tool reply sent back,
response_format json_schema, sampling fields, and 400s that say what is wrong."""

from __future__ import annotations

import json

import httpx
import pytest
from _serve import serve
from jsonschema import validate
from openai import BadRequestError, OpenAI

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def oa(engine, embedder, tmp_path_factory):
    with serve(engine, embedder, tmp_path_factory.mktemp("tools"), ui=True, max_body_bytes=64_000,
               max_message_chars=4000, max_tokens=96, rate_per_minute=10_000) as s:
        yield OpenAI(base_url=s.url + "/v1", api_key=s.keys["acme"][1])


def _args_valid(call, tool) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    validate(args, tool["function"]["parameters"])
    return args


def test_required_tool_call_has_openais_shape_and_valid_arguments(oa):
    r = oa.chat.completions.create(model="agentmem", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                   max_tokens=64, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls  # parallel_tool_calls is on by default: one or more
    for call in choice.message.tool_calls:
        _args_valid(call, WEATHER if call.function.name == "get_weather" else TIME)


def test_named_tool_choice_streamed_and_a_tool_reply_sent_back(oa):
    named = {"type": "function", "function": {"name": "get_time"}}
    chunks = list(oa.chat.completions.create(model="agentmem", messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                             max_tokens=64, stream=True, seed=1))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    _args_valid(calls[0], TIME)
    assert not "".join(d.content or "" for d in deltas)
    back = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                      {"id": calls[0].id, "type": "function",
                       "function": {"name": "get_time", "arguments": calls[0].function.arguments}}]},
                  {"role": "tool", "tool_call_id": calls[0].id, "content": "14:05"}]
    r = oa.chat.completions.create(model="agentmem", messages=back, tools=[WEATHER, TIME], tool_choice="none",
                                   max_tokens=24, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_auto_tool_choice_gives_a_call_or_prose_never_a_broken_call(oa):
    for stream in (False, True):
        if stream:
            chunks = list(oa.chat.completions.create(model="agentmem", messages=ASK, tools=[WEATHER], max_tokens=64,
                                                     stream=True, temperature=0))
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            m = oa.chat.completions.create(model="agentmem", messages=ASK, tools=[WEATHER], max_tokens=64,
                                           temperature=0).choices[0].message
            calls, text = m.tool_calls or [], m.content or ""
        assert bool(calls) != bool(text.strip())
        for c in calls:
            _args_valid(c, WEATHER)
        assert "<tool_call>" not in text


def _stream_calls(oa, **kw) -> tuple[list, str | None]:
    """The calls of a streamed reply, joined by index as the openai client's users join
    them, and the finish reason."""
    chunks = [c for c in oa.chat.completions.create(stream=True, **kw) if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == list(range(len(deltas)))  # each call whole, in order
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    return deltas, chunks[-1].choices[0].finish_reason


def test_parallel_tool_calls_each_parsed_and_valid_streamed_and_not(oa, engine):
    # end-of-reply pushed down, so the model goes on to further calls until max_tokens
    more = {str(t): -100 for t in engine.eos_ids}
    ask = [{"role": "user", "content": "What is the weather in Paris, in Rome and in Oslo?"}]
    kw = dict(model="agentmem", messages=ask, tools=[WEATHER, TIME], tool_choice="required", max_tokens=96, temperature=0,
              logit_bias=more)
    r = oa.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert len(calls) >= 2 and r.choices[0].finish_reason in ("tool_calls", "length")
    assert len({c.id for c in calls}) == len(calls)
    for c in calls:
        _args_valid(c, WEATHER if c.function.name == "get_weather" else TIME)
    streamed, finish = _stream_calls(oa, **kw)
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in calls] and finish == r.choices[0].finish_reason
    # parallel_tool_calls=false: the grammar ends the reply after one call, whatever the bias
    one = oa.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert len(one.message.tool_calls) == 1 and one.finish_reason == "tool_calls"
    streamed, finish = _stream_calls(oa, **kw, parallel_tool_calls=False)
    assert len(streamed) == 1 and finish == "tool_calls"
    # the calls sent back with their results, as an agent loop does
    back = ask + [{"role": "assistant", "content": None, "tool_calls": [
                      {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                    "arguments": c.function.arguments}}
                      for c in calls]}]
    back += [{"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls]
    r = oa.chat.completions.create(model="agentmem", messages=back, tools=[WEATHER, TIME], tool_choice="none",
                                   max_tokens=24, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_call_reader_reads_calls_as_they_close():
    from agentmem.api.reply_format import CallReader, ReplyFormat, parse_calls

    fmt = ReplyFormat(tools={"f": {"type": "object"}}, calls="auto")
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    reader, seen = CallReader(fmt), []
    for i in range(0, len(text), 7):
        seen.append(len(reader.feed(text[i:i + 7])))
        assert not reader.prose
    assert sum(seen) == 2 and seen.index(1) < len(seen) - 1  # the first is out before the second ends
    assert [json.loads(c["function"]["arguments"]) for c in reader.calls] == [{"a": 1}, {}]
    assert reader.finish() == ([], False)
    calls, cut = parse_calls(text[:-20], fmt)  # cut short inside the second call
    assert len(calls) == 1 and cut
    assert parse_calls("<tool", fmt) == (None, False) and parse_calls("Hello <tool_call>", fmt) == (None, False)
    prose = CallReader(fmt)
    assert prose.feed(" <to") == [] and not prose.prose
    assert prose.feed("p>") == [] and prose.prose and prose.rest == " <top>"
    assert parse_calls('<tool_call>{"name": "g", "arguments": {}}</tool_call>', fmt) == (None, False)
    twice = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert len(parse_calls(twice, fmt)[0]) == 1  # the same call twice is one call


def test_response_format_json_schema_matches(oa):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "Invent a person with a name and an age."}]
    r = oa.chat.completions.create(model="agentmem", messages=msgs, response_format=fmt, max_tokens=64, seed=4)
    validate(json.loads(r.choices[0].message.content), schema)
    chunks = oa.chat.completions.create(model="agentmem", messages=msgs, response_format={"type": "json_object"},
                                        max_tokens=64, stream=True, temperature=0)
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), dict)


def test_sampling_fields_and_logprobs(oa):
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = oa.chat.completions.create(model="agentmem", messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                   top_logprobs=2, frequency_penalty=0.5, presence_penalty=0.2)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in lp)
    assert "".join(t.token for t in lp) == r.choices[0].message.content


@pytest.mark.parametrize("body,says", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                        "pattern": "(("}}}},
     "schema"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_logprobs": 3}, "logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
])
def test_invalid_tools_schemas_and_settings_are_400s_that_say_why(oa, body, says):
    with pytest.raises(BadRequestError) as e:
        oa.chat.completions.create(model="agentmem", messages=ASK, max_tokens=4, **body)
    assert e.value.status_code == 400 and says in str(e.value)


def test_remembered_turn_with_a_schema(oa):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = oa.chat.completions.create(model="agentmem", user="dora", max_tokens=48, temperature=0,
                                   messages=[{"role": "user", "content": "I live in Oslo. Where do I live?"}],
                                   response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    validate(json.loads(r.choices[0].message.content), schema)
    assert httpx.codes.OK


def test_a_call_that_max_tokens_cuts_is_never_sent_and_says_length(oa):
    kw = dict(model="agentmem", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=6,
              temperature=0)
    choice = oa.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None and choice.message.content is None  # no half call, no raw tags
    chunks = [c for c in oa.chat.completions.create(stream=True, **kw) if c.choices]
    assert not any(c.choices[0].delta.tool_calls or c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_bench_counts_only_what_a_client_can_use():
    from agentmem.bench.replies import usable

    tools = {"f": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    bad = {**call, "function": {"name": "f", "arguments": '{"a": "x"}'}}
    assert usable([call], None, "tool_calls", tools, None)
    assert not usable([call], None, "length", tools, None)  # cut: the SDK's parse() refuses it
    assert not usable([call, bad], None, "tool_calls", tools, None) and not usable([], "hi", "stop", tools, None)
    schema = {"type": "object", "required": ["a"]}
    assert usable([], '{"a": 1}', "stop", None, schema) and not usable([], '{"a": 1', "length", None, schema)
    assert not usable([], '{"b": 1}', "stop", None, schema)
