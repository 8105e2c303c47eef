"""What a chat request asks its reply to be: prose, a tool call, or JSON matching a schema.

OpenAI's `tools` / `tool_choice` / `response_format` become, for the embedded engine, a
system-prompt addition (the tool signatures, Hermes-style `<tool_call>` tags, which the
instruct models this engine runs were tuned on) and a grammar the reply is decoded under, so
a call always parses and its arguments match the tool's schema. Definitions are checked
first: a bad schema or tool is a 400 that says what is wrong.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from ..engine.grammar import Grammar, InvalidGrammar
from .errors import ApiError
from .roles import prompt_role
from .schema_check import prepare

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 8  # calls in one reply: a 135M model allowed any number may not stop
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass
class ReplyFormat:
    grammar: Grammar | None = None
    system: str | None = None  # added to the system message for this turn
    tools: dict[str, dict] = field(default_factory=dict)  # name -> parameters schema
    calls: str = "none"  # none | auto | required: whether the reply may / must be a tool call
    parallel: bool = True  # several calls in one reply (OpenAI's parallel_tool_calls)
    schema: dict | None = None  # what a JSON reply must validate against (response_format)
    schema_param: str = "response_format"

    @property
    def may_call(self) -> bool:
        return self.calls != "none"


def _bad(message: str, param: str, code: str = "invalid_schema") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def _check_schema(schema, param: str, compiler) -> dict:
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    if not isinstance(schema, dict):
        raise _bad(f"{param} must be a JSON schema object, got {type(schema).__name__}", param)
    flat = prepare(schema, param)  # size, depth and $ref cycles first: the checks below recurse
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        raise _bad(f"{param} is not a valid JSON schema: {e.message}", param) from None
    if compiler is not None:
        try:
            compiler.check(Grammar.json_schema(flat))
        except InvalidGrammar as e:
            raise _bad(f"{param} cannot be compiled: {_words(e)}", param) from None
    return flat


def _words(e: Exception) -> str:
    """The grammar engine's reason, without its position and parser state dump."""
    first = str(e).removeprefix("invalid grammar or schema: ").strip().splitlines()[0]
    return re.sub(r"^at \d+\(\d+\): ", "", first)


def plan(req, compiler) -> ReplyFormat:
    """Check the request's tools, tool_choice and response_format; what the reply must be.
    `compiler` (the engine's GrammarCompiler) also checks that each schema compiles; None
    skips that (a remote engine gets the fields as they are)."""
    tools: dict[str, dict] = {}
    for i, t in enumerate(req.tools or []):
        p = f"tools.{i}"
        if t.type != "function" or t.function is None:
            raise _bad(f"{p}.type must be 'function' with a 'function' object", f"{p}.type", "invalid_tool")
        name = t.function.name
        if not _NAME.match(name or ""):
            raise _bad(f"{p}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                       f"{p}.function.name", "invalid_tool")
        if name in tools:
            raise _bad(f"tool {name!r} is defined twice", f"{p}.function.name", "invalid_tool")
        params = t.function.parameters if t.function.parameters is not None else {"type": "object", "properties": {}}
        tools[name] = _check_schema(params, f"{p}.function.parameters", compiler)
        if params.get("type", "object") != "object":
            raise _bad(f"{p}.function.parameters must describe an object", f"{p}.function.parameters", "invalid_tool")
    choice = req.tool_choice
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad("tool_choice must be 'auto', 'none', 'required' or a named function", "tool_choice",
                       "invalid_tool_choice")
        calls, only = (choice if tools else "none"), None
        if choice == "required" and not tools:
            raise _bad("tool_choice 'required' needs tools", "tool_choice", "invalid_tool_choice")
    elif choice is not None:
        only = choice.function.name
        if only not in tools:
            raise _bad(f"tool_choice names {only!r}, which is not in tools", "tool_choice", "invalid_tool_choice")
        calls = "required"
    else:
        calls, only = ("auto" if tools else "none"), None

    # a named tool_choice asks for that one call
    fmt = ReplyFormat(tools=tools, calls=calls, parallel=req.parallel_tool_calls is not False and only is None)
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if fmt.may_call:
            raise _bad("response_format with tools is not supported: use tool_choice 'none' or drop one",
                       "response_format", "unsupported")
        if rf.type == "json_object":
            fmt.grammar, fmt.system = Grammar.json_object(), "Reply with one JSON object and nothing else."
            fmt.schema, fmt.schema_param = {"type": "object"}, "response_format"
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise _bad("response_format json_schema needs json_schema.schema", "response_format.json_schema")
            schema = _check_schema(rf.json_schema.schema_, "response_format.json_schema.schema", compiler)
            fmt.grammar = Grammar.json_schema(tighten(schema, max_string=1000))
            fmt.schema, fmt.schema_param = schema, "response_format.json_schema.schema"
            fmt.system = ("Reply with one JSON value matching this JSON schema, and nothing else:\n"
                          + json.dumps(schema))
        else:
            raise _bad("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format.type",
                       "invalid_response_format")
    if fmt.may_call:
        names = [only] if only else list(tools)
        fmt.grammar = Grammar.choice([_call_schema(n, tools[n]) for n in names], CALL_OPEN, CALL_CLOSE,
                                     or_text=calls == "auto", most=MAX_PARALLEL_CALLS if fmt.parallel else 1)
        fmt.system = _tool_prompt(req.tools, only, fmt.parallel)
    return fmt


def _call_schema(name: str, params: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": tighten(params)},
            "required": ["name", "arguments"], "additionalProperties": False}


def tighten(schema, max_string: int = 160):
    """The schema a grammar decodes under: no properties beyond those declared and strings of
    bounded length where the schema leaves them open. Everything it allows, the original
    allows too; without it a 135M model fills a call with invented keys and endless strings
    until max_tokens cuts the JSON."""
    if isinstance(schema, list):
        return [tighten(s, max_string) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (tighten(v, max_string) if k in ("items", "anyOf", "oneOf", "allOf", "prefixItems") else v)
           for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: tighten(v, max_string) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    # not with a pattern or format: the grammar engine would have to intersect the two, and
    # for a pattern such as ^(.*a){20}$ its lexer runs out of states mid-string
    if schema.get("type") == "string" and not {"enum", "const", "pattern", "format"} & schema.keys():
        out.setdefault("maxLength", max_string)
    return out


def _tool_prompt(tools, only: str | None, parallel: bool) -> str:
    sigs = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
    ask = (f"Call the function {only} now." if only
           else "If a function helps, call it; otherwise answer normally.")
    several = " To make several calls at once, write one such line per call." if parallel else ""
    return ("You can call functions. Their signatures:\n<tools>\n" + sigs + "\n</tools>\n"
            f'To call one, reply with {CALL_OPEN}{{"name": NAME, "arguments": {{...}}}}{CALL_CLOSE}.{several} ' + ask)


class CallReader:
    """Tool calls read from a reply as it arrives, each in OpenAI's shape once its closing
    tag is in, so a stream sends every call as soon as it is complete. A reply that does not
    open with the call tag is prose (`prose` turns true as soon as that is clear)."""

    def __init__(self, fmt: ReplyFormat):
        self.fmt = fmt
        self.calls: list[dict] = []
        self.rest = ""  # what is not (yet) a complete call: all of it, once the reply is prose
        self.prose = not fmt.may_call
        self._stuck = False  # a closed call that is none (no grammar: a remote engine)
        self.cut = False  # text that is no call left after the calls (cut short by max_tokens)

    def feed(self, text: str) -> list[dict]:
        """Read `text`; the calls it completed."""
        self.rest += text
        new: list[dict] = []
        while not self.prose and not self._stuck:
            head = self.rest.lstrip()
            if not self.calls and not new and not head.startswith(CALL_OPEN):
                self.prose = not CALL_OPEN.startswith(head)  # else too early to tell
                break
            if not head.startswith(CALL_OPEN) or CALL_CLOSE not in head:
                break
            end = head.index(CALL_CLOSE)
            call = _call(head[len(CALL_OPEN):end], self.fmt)
            if call is None:
                self.prose, self._stuck = not (self.calls or new), True
                break
            if not _repeats(call, self.calls + new):
                new.append(call)
            self.rest = head[end + len(CALL_CLOSE):]
        self.calls += new
        return new

    def finish(self) -> tuple[list[dict], bool]:
        """At the reply's end: a last call left unclosed (the model ended it without the tag),
        and whether text that is no call is left after the calls (cut short by max_tokens)."""
        head = self.rest.strip()
        if self.prose or not head:
            return [], False
        call = None if self._stuck or not head.startswith(CALL_OPEN) else _call(head[len(CALL_OPEN):], self.fmt)
        if call is None:
            if not self.calls:  # never a call after all
                self.prose = True
            self.cut = bool(self.calls)
            return [], self.cut
        self.rest = ""
        if _repeats(call, self.calls):
            return [], False
        self.calls.append(call)
        return [call], False


def _repeats(call: dict, calls: list[dict]) -> bool:
    """The same function with the same arguments again: one call (the small model, free to
    add calls, sometimes writes one twice; an agent would run it twice)."""
    return any(c["function"] == call["function"] for c in calls)


def _call(body: str, fmt: ReplyFormat) -> dict | None:
    try:
        doc = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or doc.get("name") not in fmt.tools or not isinstance(doc.get("arguments"), dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": doc["name"], "arguments": json.dumps(doc["arguments"])}}


def ending(reader: CallReader, engine_finish: str) -> tuple[str | None, str]:
    """How a reply that may hold tool calls ends for the client, once `reader` has read all
    of it and `finish()`ed: (text still to send as content, or None; OpenAI's finish_reason).

    Complete calls end in "tool_calls", or in "length" where max_tokens cut the reply: under
    the grammar the engine rolls such a reply back to its last whole call, so what is sent
    is whole, and "length" says the model was not done (the openai SDK's `parse()` refuses
    a "length" reply; an agent may still run the calls it got). A call that max_tokens cut
    before it closed is never sent, neither as a call nor as text: no content, "length"."""
    finish = "length" if engine_finish == "length" else "stop"
    if reader.calls:
        return None, "length" if reader.cut or finish == "length" else "tool_calls"
    if finish == "length" and reader.rest.lstrip().startswith(CALL_OPEN):
        return None, "length"
    return reader.rest, finish


def verify(text: str, fmt: ReplyFormat, finish: str) -> None:
    """A reply said to be complete (`finish` "stop") matches what it was decoded under, or
    a 400: the grammar engine gave up inside the value (its lexer ran out of states on a
    pattern it cannot bound) and the engine ended the reply there. Never a 200 whose JSON
    fails its own schema, or a broken tool call sent as prose."""
    if finish != "stop":
        return
    if fmt.schema is not None:
        import jsonschema_rs

        try:
            ok = jsonschema_rs.validator_for(fmt.schema).is_valid(json.loads(text))
        except (ValueError, jsonschema_rs.ValidationError):
            ok = False
        if not ok:
            raise _bad(f"the reply could not be completed under {fmt.schema_param}: the grammar engine cannot "
                       "bound it (a pattern with nested repetition, say); simplify the schema",
                       fmt.schema_param, "schema_unsatisfiable")
    elif fmt.may_call and fmt.grammar is not None and text.lstrip().startswith(CALL_OPEN):
        reader = CallReader(fmt)
        reader.feed(text)
        reader.finish()
        if not reader.calls:
            raise _bad("the tool call could not be completed under its parameters' schema: the grammar engine cannot "
                       "bound it; simplify the schema", "tools", "schema_unsatisfiable")


def read_reply(text: str, fmt: ReplyFormat, engine_finish: str) -> tuple[list[dict], str | None, str]:
    """A whole reply as the chat API sends it back: (tool calls, content, finish_reason)."""
    reader = CallReader(fmt)
    reader.feed(text)
    reader.finish()
    content, finish = ending(reader, engine_finish)
    return reader.calls, content, finish


def parse_calls(text: str, fmt: ReplyFormat) -> tuple[list[dict] | None, bool]:
    """The tool calls in a whole reply, in OpenAI's shape (arguments as a JSON string), or
    None when the reply is prose; and whether a call was cut short after them."""
    reader = CallReader(fmt)
    reader.feed(text)
    cut = reader.finish()[1]
    return (reader.calls or None), cut


def render_message(m) -> tuple[str, str]:
    """(role, text) of a request message for the prompt: an assistant's tool calls in the
    same tags the model is asked to write, a tool's result wrapped as Hermes does."""
    text = m.text()
    if m.role == "assistant" and m.tool_calls:
        calls = "\n".join(f'{CALL_OPEN}{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}'
                         f"{CALL_CLOSE}" for c in m.tool_calls)
        return "assistant", (text + "\n" if text else "") + calls
    if prompt_role(m.role) == "tool":
        return "tool", f"<tool_response>\n{text}\n</tool_response>"
    return prompt_role(m.role), text
