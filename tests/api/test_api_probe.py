"""An attacker's and a careless client's inputs against a real server: every text that can
reach the tokenizer or the database is checked (a 400 naming the field, never a 500),
schemas are bounded before anything recurses over them, a JSON reply said to be complete
matches its schema, every accepted id can be read, exported and deleted through REST, and
every 4xx has OpenAI's error shape with `param` and a snake_case `code`."""

from __future__ import annotations

import json
import re
from urllib.parse import quote

import httpx
import jsonschema
import pytest
from _serve import serve
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentmem.tiers.records import InvalidInput

CHAT = "/v1/chat/completions"
SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")


@pytest.fixture(scope="module")
def svc(engine, embedder, tmp_path_factory):
    with serve(engine, embedder, tmp_path_factory.mktemp("probe"), tenants=("acme",), max_tokens=24,
               rate_per_minute=0, max_message_chars=4000) as s:
        yield s


def _err(r: httpx.Response, status: int = 400, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and SNAKE.match(e["code"] or ""), e
    if code is not None:
        assert e["code"] == code, e
    if param is not None:
        assert e["param"] == param, e
    return e


def _raw(c: httpx.Client, body: dict, path: str = CHAT) -> httpx.Response:
    """`body` sent as written: json.dumps keeps a lone surrogate as the escape `\\ud800`."""
    return c.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def _call_history(arguments: str = "{}", call_id: str = "call_1", name: str = "f") -> list[dict]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "42"},
            {"role": "user", "content": "and now?"}]


@pytest.mark.parametrize("bad", ["\ud800", "a\x00b"])
@pytest.mark.parametrize("stream", [False, True])
def test_every_text_of_a_stateless_chat_is_checked(svc, bad, stream):
    c = svc.client("acme")
    base = {"max_tokens": 2, "stream": stream}
    cases = [
        ({"messages": _call_history(arguments='{"x": "' + bad + '"}')}, "messages.1.tool_calls.0.function.arguments"),
        ({"messages": _call_history(call_id="c" + bad)}, "messages.1.tool_calls.0.id"),
        ({"messages": _call_history(name="f" + bad)}, "messages.1.tool_calls.0.function.name"),
        ({"messages": [{"role": "tool", "tool_call_id": bad, "content": "x"}, {"role": "user", "content": "hi"}]},
         "messages.0.tool_call_id"),
        ({"messages": [{"role": "user", "content": "hi"}],
          "tools": [{"type": "function", "function": {"name": "f", "description": "d" + bad}}]},
         "tools.0.function.description"),
        ({"messages": [{"role": "user", "content": "hi"}],
          "tools": [{"type": "function", "function": {"name": "f", "parameters": {
              "type": "object", "properties": {"a": {"type": "string", "description": bad}}}}}]},
         "tools.0.function.parameters.properties.a.description"),
        ({"messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "string", "enum": ["x" + bad]}}}},
         "response_format.json_schema.schema.enum.0"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", bad]}, "stop.1"),
    ]
    for body, param in cases:
        _err(_raw(c, base | body), 400, "invalid_text", param)


@pytest.mark.parametrize("user", ["a/b", "..", ".", "x/../y", "a b", "a?b", "a#b", "a%2Fb", "é", "a+b", ""])
def test_chat_user_and_session_ids_outside_the_alphabet_are_400s(svc, user):
    c = svc.client("acme")
    r = c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "user": user})
    if user == "":
        assert r.status_code == 422  # min_length: pydantic's answer, still naming the field
        assert r.json()["error"]["param"] == "user"
    else:
        _err(r, 400, "invalid_id", "user")
    r = c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "user": "ok",
                           "session_id": user or "a/b"})
    _err(r, 400, "invalid_id", "session_id")
    assert svc.store.list_users(svc.keys["acme"][0]) == []


def test_rest_paths_and_the_python_api_use_the_same_alphabet(svc):
    c = svc.client("acme")
    tid = svc.keys["acme"][0]
    _err(c.post("/v1/users/a%20b/memories", json={"text": "x"}), 400, "invalid_id", "user_id")
    _err(c.get("/v1/users/ok/turns", params={"session_id": "a b"}), 400, "invalid_id", "session_id")
    _err(c.post("/v1/users/ok/messages", json={"session_id": "x y", "messages": [{"role": "user", "content": "x"}]}),
         400, "invalid_id", "session_id")
    with pytest.raises(InvalidInput, match="user_id must be"):
        svc.store.add_memory(tid, "x/../y", "my pin is 4242")
    with pytest.raises(InvalidInput, match="session_id must be"):
        svc.store.open_session(tid, "fine", "a/b")
    assert {u.id for u in svc.store.list_users(tid)} <= {"fine"}


ID_TEXT = st.one_of(st.text(min_size=1, max_size=40),
                    st.text(alphabet="abcXYZ019_-.@:/%+ ~", min_size=1, max_size=12),
                    st.sampled_from([".", "..", "a/b", "x/../y", "a%2Fb", "alice@example.com", "t:u", "_", "a" * 128,
                                     "a" * 129, "-x", ".x"]))


def test_any_id_accepted_anywhere_can_be_read_exported_and_deleted(svc):
    """Property: an id the Python API or a REST write accepts is one every endpoint addresses."""
    c = svc.client("acme")
    tid = svc.keys["acme"][0]

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(uid=ID_TEXT, via_rest=st.booleans())
    def run(uid, via_rest):
        path = "/v1/users/" + quote(uid, safe="")
        if via_rest:
            r = c.put(path + "/core/notes", json={"value": "my pin is 4242"})
            accepted = r.status_code == 200
            if not accepted:
                assert r.status_code in (400, 404, 405, 422), r.text  # never a 5xx; 404/405: no route for it
                assert r.json()["error"]["code"]
        else:
            try:
                svc.store.set_core_block(tid, uid, "notes", "my pin is 4242")
                accepted = True
            except InvalidInput:
                accepted = False
        if not accepted:
            assert uid not in {u.id for u in svc.store.list_users(tid)}
            return
        listed = c.get("/v1/users", params={"limit": 1000}).json()["data"]
        assert uid in {u["id"] for u in listed}
        assert c.get(path + "/core").json()["data"][0]["value"] == "my pin is 4242"
        assert c.get(path + "/export").json()["user_id"] == uid
        assert c.delete(path).status_code == 200
        assert c.get(path + "/export").status_code == 404
        assert uid not in {u.id for u in svc.store.list_users(tid)}

    run()


def _nested(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


CYCLE = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"],
         "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
TREE = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}}}


def _both_paths(schema) -> list[tuple[dict, str]]:
    msgs = [{"role": "user", "content": "Give me the value."}]
    return [({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
              "tool_choice": "required"}, "tools.0.function.parameters"),
            ({"messages": msgs, "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "r", "schema": schema}}},
             "response_format.json_schema.schema")]


def test_a_body_nested_past_the_parser_is_a_400(svc):
    deep = "[" * 100_000 + "]" * 100_000
    for path in (CHAT, "/v1/users/u/import"):
        r = svc.client("acme").post(path, content=f'{{"messages": [], "x": {deep}}}',
                                    headers={"Content-Type": "application/json"})
        assert r.status_code in (400, 413, 422), r.text
        assert r.json()["error"]["code"]


@pytest.mark.parametrize("schema, code", [(_nested(100), "schema_too_deep"), (_nested(400), "schema_too_deep"),
                                          (CYCLE, "schema_ref_cycle"), (TREE, "schema_ref_cycle"),
                                          ({"$ref": "#"}, "schema_ref_cycle"),
                                          ({"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                             for i in range(3000)}},
                                           "schema_too_large")])
def test_bad_schemas_are_400s_in_words_on_both_paths(svc, schema, code):
    c = svc.client("acme")
    for body, param in _both_paths(schema):
        e = _err(c.post(CHAT, json=body | {"max_tokens": 4}), 400, code, param)
        assert "<state>" not in e["message"] and "Parser" not in e["message"] and len(e["message"]) < 300


def test_schema_with_refs_works_on_both_paths(svc):
    schema = {"type": "object", "properties": {"n": {"$ref": "#/$defs/num"}}, "required": ["n"],
              "$defs": {"num": {"type": "integer", "minimum": 0, "maximum": 9}}}
    c = svc.client("acme")
    for body, _ in _both_paths(schema):
        r = c.post(CHAT, json=body | {"max_tokens": 24})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            jsonschema.validate(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]), schema)
        elif choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def _assert_schematic(r: httpx.Response, schema: dict) -> None:
    """A 200 that says it is complete validates; otherwise a 400 that says why, or a reply cut by max_tokens."""
    if r.status_code != 200:
        _err(r, 400)
        return
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls"), choice
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_an_unboundable_pattern_never_gives_an_unschematic_stop(svc, stream):
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(.*a){20}$", "maxLength": 60}},
              "required": ["s"]}
    body = {"messages": [{"role": "user", "content": "Write it."}], "max_tokens": 24, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    c = svc.client("acme")
    if not stream:
        _assert_schematic(c.post(CHAT, json=body), schema)
        return
    with c.stream("POST", CHAT, json=body) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    finish = [e["choices"][0]["finish_reason"] for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    errors = [e["error"] for e in events if "error" in e]
    if finish == ["stop"]:
        jsonschema.validate(json.loads(text), schema)
    else:
        assert finish == ["length"] or (errors and errors[0]["code"] == "schema_unsatisfiable"), events[-2:]


PATTERNS = ["^[a-z]{3}$", "^(.*a){20}$", "^(a+)+$", "^\\d{2}-\\d{2}$", "^(x|y)*z$", "[[:alpha:]]", "(?=a)b", "^$"]
LEAF = st.one_of(
    st.just({"type": "integer"}), st.just({"type": "boolean"}), st.just({"type": "number", "minimum": 0}),
    st.just({"type": "string"}), st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
    st.builds(lambda p, n: {"type": "string", "pattern": p, "maxLength": n}, st.sampled_from(PATTERNS),
              st.integers(0, 40)),
    st.builds(lambda xs: {"enum": xs}, st.lists(st.sampled_from(["a", "b", 1, None, True]), min_size=1, max_size=3)),
    st.just({"$ref": "#/$defs/leaf"}), st.just({"$ref": "#"}), st.just({}), st.just({"type": "string", "minLength": 50}))
SCHEMA = st.recursive(LEAF, lambda kids: st.one_of(
    st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props)[:1]},
              st.dictionaries(st.sampled_from(["a", "b", "c"]), kids, min_size=1, max_size=3)),
    st.builds(lambda k, n: {"type": "array", "items": k, "maxItems": n}, kids, st.integers(0, 3)),
    st.builds(lambda xs: {"anyOf": xs}, st.lists(kids, min_size=1, max_size=2))), max_leaves=6)


def test_fuzzed_schemas_every_200_matches_its_schema(svc):
    """Random and adversarial schemas, both paths: every reply that says it is complete
    validates against its schema; everything else is a 400 in words or says `length`."""
    c = svc.client("acme")
    seen = {"ok": 0, "refused": 0}

    @settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(inner=SCHEMA, tools=st.booleans())
    def run(inner, tools):
        schema = {"type": "object", "properties": {"v": inner}, "required": ["v"],
                  "$defs": {"leaf": {"type": "integer", "maximum": 5}}}
        body, _ = _both_paths(schema)[0 if tools else 1]
        r = c.post(CHAT, json=body | {"max_tokens": 24})
        if r.status_code != 200:
            _err(r, 400)
            seen["refused"] += 1
            return
        seen["ok"] += 1
        choice = r.json()["choices"][0]
        if tools:
            for call in choice["message"].get("tool_calls") or []:
                jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
            assert choice["finish_reason"] in ("tool_calls", "length"), choice
        else:
            _assert_schematic(r, schema)

    run()
    assert seen["ok"] and seen["refused"]


def test_error_bodies_name_the_field_with_a_snake_case_code(svc, engine):
    c = svc.client("acme")
    hi = [{"role": "user", "content": "hi"}]
    one = {"messages": hi, "max_tokens": 2}
    for field, value in (("top_p", 5), ("min_p", -1), ("top_k", -3), ("frequency_penalty", 1e9),
                         ("presence_penalty", float("inf")), ("repetition_penalty", -1), ("top_logprobs", 99),
                         ("temperature", 7)):
        body = json.dumps({"messages": hi, "max_tokens": 2, field: value}).replace("Infinity", "1e999")
        _err(c.post(CHAT, content=body, headers={"Content-Type": "application/json"}), 400, "invalid_sampling", field)
    vocab = engine.grammars.vocab_size
    for key in ("-1", str(vocab), "x"):
        e = _err(c.post(CHAT, json=one | {"logit_bias": {key: 5}}), 400, "invalid_sampling", "logit_bias")
        assert f"0..{vocab - 1}" in e["message"]
    _err(c.post(CHAT, json=one | {"logit_bias": {"5": 500}}), 400, "invalid_sampling", "logit_bias")
    e = _err(c.post(CHAT, content=b'{"messages": [', headers={"Content-Type": "application/json"}), 400, "invalid_json")
    assert e["type"] == "invalid_request_error"
    _err(c.get("/v1/nowhere"), 404, "not_found")
    _err(c.put("/v1/users"), 405, "method_not_allowed")
    _err(c.post(CHAT, json=one | {"tool_choice": "sometimes"}), 400, "invalid_tool_choice", "tool_choice")
    _err(c.post(CHAT, json={"messages": hi, "max_tokens": 10**6}), 400, "max_tokens_too_large", "max_tokens")
    _err(c.post(CHAT, json=one | {"response_format": {"type": "xml"}}), 400, "invalid_response_format",
         "response_format.type")
