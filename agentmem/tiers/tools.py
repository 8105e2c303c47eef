"""Optional MemGPT-style memory tools, for models able to call them.

The default path manages memory automatically (a 135M model cannot call tools reliably).
For a model that can, `generate_tool_call` decodes a call under the engine's grammar (the
same llguidance path as the chat API's `tools`): a JSON object naming one of the tools with
exactly its string arguments. The result always parses and always names a real tool with
all of its arguments; `run_tool` executes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..engine.grammar import Grammar
from .records import InvalidInput
from .store import MemoryStore

# tool -> its string arguments, in order
TOOLS: dict[str, tuple[str, ...]] = {
    "core_memory_append": ("label", "content"),
    "core_memory_replace": ("label", "old_content", "new_content"),
    "archival_memory_insert": ("content",),
    "archival_memory_search": ("query",),
    "conversation_search": ("query",),
}
TOOL_PROMPT = ("You can call one memory tool by answering with JSON "
               '{"tool": NAME, "args": {...}}. Tools: '
               + "; ".join(f"{name}({', '.join(args)})" for name, args in TOOLS.items()) + ".")


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: dict[str, str]

    def to_json(self) -> str:
        return json.dumps({"tool": self.name, "args": self.args})


def parse_tool_call(text: str) -> ToolCall:
    """Strictly validate a tool call written as JSON."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInput(f"tool call is not JSON: {e}") from None
    if not isinstance(doc, dict) or set(doc) != {"tool", "args"}:
        raise InvalidInput('a tool call is {"tool": NAME, "args": {...}}')
    name, args = doc["tool"], doc["args"]
    if name not in TOOLS:
        raise InvalidInput(f"unknown tool {name!r}; expected one of {sorted(TOOLS)}")
    if not isinstance(args, dict) or set(args) != set(TOOLS[name]):
        raise InvalidInput(f"{name} takes arguments {TOOLS[name]}")
    if not all(isinstance(v, str) for v in args.values()):
        raise InvalidInput("tool arguments must be strings")
    return ToolCall(name, dict(args))


def run_tool(store: MemoryStore, tenant_id: str, user_id: str, session_id: str, call: ToolCall) -> str:
    """Execute a call against the memory; the text result is what the model would see next."""
    a = call.args
    if call.name in ("core_memory_append", "core_memory_replace"):
        blocks = {b.label: b.value for b in store.core_blocks(tenant_id, user_id)}
        old = blocks.get(a["label"], "")
        if call.name == "core_memory_append":
            new = (old + "\n" + a["content"]).strip()
        else:
            if not a["old_content"] or a["old_content"] not in old:
                raise InvalidInput(f"{a['old_content']!r} is not in block {a['label']!r}")
            new = old.replace(a["old_content"], a["new_content"])
        store.set_core_block(tenant_id, user_id, a["label"], new)
        return f"block {a['label']} updated"
    if call.name == "archival_memory_insert":
        m = store.add_memory(tenant_id, user_id, a["content"], kind="fact")
        return f"stored memory {m.id}"
    hits = store.search(tenant_id, user_id, a["query"], k=5)
    if call.name == "conversation_search":
        hits = [h for h in hits if h.kind == "message"]
    return "\n".join(f"- {h.time:%Y-%m-%d} {h.text}" for h in hits) or "no results"


def call_grammar() -> Grammar:
    """Any one call of TOOLS, as JSON."""
    arg = {"type": "string", "minLength": 1, "maxLength": 200, "pattern": '^[^"\\\\\\n]*$'}
    return Grammar.json_schema({"anyOf": [
        {"type": "object", "properties": {"tool": {"const": name},
                                          "args": {"type": "object", "properties": {a: arg for a in args},
                                                   "required": list(args), "additionalProperties": False}},
         "required": ["tool", "args"], "additionalProperties": False}
        for name, args in TOOLS.items()]})


def generate_tool_call(engine, prompt: str, max_tokens: int = 160) -> ToolCall:
    """Decode a tool call for `prompt` (chat text ending in the generation prefix) under the
    grammar of `call_grammar`; greedy, so the same prompt gives the same call."""
    g = engine.generate(prompt, max_tokens=max_tokens, temperature=0.0, grammar=call_grammar())
    if g.stats.finish_reason == "length":
        raise InvalidInput(f"the tool call did not close within {max_tokens} tokens")
    return parse_tool_call(g.text)
