"""One check for every text of a chat request that can reach the tokenizer or the database.

Message content, an assistant's earlier tool calls (their ids, names and argument text),
a tool's `tool_call_id` and `name`, tool names and descriptions, every key and string of a
JSON schema, `stop`, and the `user` and `session_id` ids: each is checked here, before any
work, and a text the tokenizer or the database cannot take (a lone surrogate, a NUL) is a
400 whose `param` names the field (`messages.2.tool_calls.0.function.arguments`). Sampling
errors the engine finds get the same shape: a 400 naming the field, code `invalid_sampling`.
"""

from __future__ import annotations

import math
import re

from ..engine import InvalidSampling
from ..tiers.scope import InvalidId, check_id
from .errors import ApiError
from .schemas import ChatCompletionRequest, storable

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "stop", "seed", "copy_ngram")
_FIELD = re.compile(r"^([a-z_]+)")


def check_ids(user: str | None, session_id: str | None) -> None:
    for value, param in ((user, "user"), (session_id, "session_id")):
        if value is not None:
            try:
                check_id(value, param, "user_id" if param == "user" else "session_id")
            except InvalidId as exc:
                raise ApiError(400, str(exc), code="invalid_id", param=param) from None


def check_texts(req: ChatCompletionRequest) -> None:
    """Every text of `req` the tokenizer or the database sees, or a 400 naming the first bad one."""
    check_ids(req.user, req.session_id)
    storable(req.model, "model")
    for i, m in enumerate(req.messages):
        p = f"messages.{i}"
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                storable(part.text, f"{p}.content.{j}.text")
        else:
            storable(m.text(), f"{p}.content")
        for name in ("tool_call_id", "name"):
            if getattr(m, name) is not None:
                storable(getattr(m, name), f"{p}.{name}")
        for j, call in enumerate(m.tool_calls or []):
            q = f"{p}.tool_calls.{j}"
            storable(call.id, f"{q}.id")
            storable(call.function.name, f"{q}.function.name")
            storable(call.function.arguments, f"{q}.function.arguments")
    for i, t in enumerate(req.tools or []):
        if t.function is not None:
            storable(t.function.name, f"tools.{i}.function.name")
            if t.function.description is not None:
                storable(t.function.description, f"tools.{i}.function.description")
    rf = req.response_format
    if rf is not None and rf.json_schema is not None:
        storable(rf.json_schema.name, "response_format.json_schema.name")
        if rf.json_schema.description is not None:
            storable(rf.json_schema.description, "response_format.json_schema.description")
    if req.tool_choice is not None and not isinstance(req.tool_choice, str):
        storable(req.tool_choice.function.name, "tool_choice.function.name")
    for i, stop in enumerate(req.stops()):
        storable(stop, "stop" if isinstance(req.stop, str) else f"stop.{i}")


def check_logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    """logit_bias as token id -> bias, each id inside the model's vocabulary (stated as its
    real range) and each bias a finite number in [-100, 100], as OpenAI has it."""
    if bias is None:
        return None
    out: dict[int, float] = {}
    top = f"0..{vocab_size - 1}" if vocab_size else "0 or more"
    for key, value in bias.items():
        try:
            tok = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias keys must be token ids ({top}), got {key!r}", code="invalid_sampling",
                           param="logit_bias") from None
        if tok < 0 or (vocab_size and tok >= vocab_size):
            raise ApiError(400, f"logit_bias token id {tok} is outside the vocabulary ({top})", code="invalid_sampling",
                           param="logit_bias")
        if not (isinstance(value, int | float) and math.isfinite(value) and -100 <= value <= 100):
            raise ApiError(400, f"logit_bias[{tok}] must be in [-100, 100], got {value!r}", code="invalid_sampling",
                           param="logit_bias")
        out[tok] = float(value)
    return out


def sampling_error(exc: InvalidSampling) -> ApiError:
    """The engine's sampling refusal as a 400 naming the field its message starts with."""
    m = _FIELD.match(str(exc))
    param = m.group(1) if m and m.group(1) in SAMPLING_FIELDS else None
    if param is None and str(exc).startswith("stop "):
        param = "stop"
    return ApiError(400, str(exc), code="invalid_sampling", param=param)
