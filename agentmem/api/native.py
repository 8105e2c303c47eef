"""The request fields a chat engine's server takes as they are (engine/remote_chat.py).

Fronting the embedded engine, `tools`, `tool_choice` and `response_format` become a grammar
and a system prompt here (reply_format.py). Fronting a remote engine in chat mode, the
provider's own model handles them: they go through to its `/v1/chat/completions` unchanged
(checked first as for the embedded engine, so a bad tool is the same 400), memory is added
to the prompt as on any turn, and the provider's tool calls come back as it made them. A
stateless request (no `user`) also sends its messages as they are, an assistant's earlier
`tool_calls` and the tools' results (`tool_call_id`) included, so an agent's tool loop runs
on the provider's own format. With `user`, the new turn must be the user's (one turn of a
remembered conversation), as for the embedded engine.
"""

from __future__ import annotations


def native_fields(req, engine) -> dict | None:
    """What goes to the server as it is, or None where the engine renders the fields itself."""
    if not getattr(engine, "native_tools", False):
        return None
    out: dict = {}
    if req.tools:
        out["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    if req.tool_choice is not None:
        tc = req.tool_choice
        out["tool_choice"] = tc if isinstance(tc, str) else tc.model_dump(exclude_none=True)
    if req.parallel_tool_calls is not None and req.tools:
        out["parallel_tool_calls"] = req.parallel_tool_calls
    rf = req.response_format
    if rf is not None and rf.type != "text":
        out["response_format"] = rf.model_dump(exclude_none=True, by_alias=True)
    if req.user is None:
        out["messages"] = [_message(m) for m in req.messages]
    return out


def _message(m) -> dict:
    msg: dict = {"role": m.role, "content": m.content if isinstance(m.content, str) or m.content is None
                 else [p.model_dump() for p in m.content]}
    if m.tool_calls:
        msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        msg["name"] = m.name
    return msg
