"""The remote engine's chat mode: `/v1/chat/completions` of any OpenAI-compatible server
(OpenAI, Azure OpenAI, the compatible endpoints of Anthropic, Gemini, Groq and Together,
Ollama, LM Studio, vLLM, SGLang, llama.cpp's servers).

The assembled segments become messages in assembly order: each segment that opens with a
role's wrap of the chat format the prompt was assembled in starts a message of that role,
the following segments join it, and the role's closing wrap ends it; the wraps themselves
and the generation prefix are left out, since the server applies its own model's template.
So an assembled turn is one system message (persona, core blocks, summary), the recent turns
as user and assistant messages, then one user message with the recalled notes and the
question; the stable part leads, so a provider's prompt cache reuses it turn after turn.

Sampling: the settings every chat API takes (temperature, top_p, penalties, seed, stop,
max_tokens) are sent as OpenAI names them; top-k, min-p and the repetition penalty only to
llama.cpp's servers, which take them (and would otherwise apply their own top-k 40 and
repeat penalty 1.1), or where they are on: a hosted API that does not know one refuses it,
and the error says which (`EngineRefused.param`). `stream_options` (usage in a stream) is
left out, once, where a server refuses it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from .errors import EngineRefused
from .sampler import SamplingParams
from .tokenizer import ChatFormat

ROLES = ("system", "user", "assistant")  # "tool" shares the user's wraps: its messages go as the user's


def to_messages(prompt, fmt: ChatFormat) -> list[dict]:
    """Chat messages of a prompt (segments, or a text rendered in `fmt`), in order."""
    pieces = [(s.text, s.tier) for s in prompt] if not isinstance(prompt, str) else _split(prompt, fmt)
    opens = sorted(((fmt.wraps[r][0], r) for r in ROLES if fmt.wraps[r][0]), key=lambda x: -len(x[0]))
    gen = fmt.generation_prefix
    msgs: list[dict] = []
    role = None  # the open message's role; None between messages
    for text, tier in pieces:
        if tier == "generation" or (gen and text == gen):
            continue
        if gen and text.endswith(gen) and role is None:
            text = text[: -len(gen)]
        start = next(((pre, r) for pre, r in opens if text.startswith(pre)), None)
        if start is not None:
            role, text = start[1], text[len(start[0]):]
            msgs.append({"role": role, "content": ""})
        elif role is None:  # text outside any wrap: the user's
            role = "user"
            msgs.append({"role": role, "content": ""})
        close = fmt.wraps[role][1]
        ended = bool(close) and text.endswith(close)
        if ended:
            text = text[: -len(close)]
        msgs[-1]["content"] += text
        if ended:
            role = None
    merged: list[dict] = []
    for m in msgs:
        if not m["content"].strip() and m["role"] != "assistant":
            continue
        if merged and merged[-1]["role"] == m["role"] == "system":
            merged[-1]["content"] += "\n" + m["content"]
        else:
            merged.append(m)
    return merged


def _split(text: str, fmt: ChatFormat) -> list[tuple[str, str]]:
    """A rendered prompt cut before each role's opening wrap."""
    opens = sorted({fmt.wraps[r][0] for r in ROLES if fmt.wraps[r][0]}, key=len, reverse=True)
    if not opens:
        return [(text, "user")]
    cuts = [m.start() for m in re.finditer("|".join(map(re.escape, opens)), text)]
    bounds = [0, *[c for c in cuts if c], len(text)]
    return [(text[a:b], "") for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def sampling_body(params: SamplingParams, dialect: str) -> dict:
    """The sampling fields of a chat request (see the module's docstring)."""
    llama = dialect == "llama"
    out: dict = {"temperature": params.temperature, "max_tokens": params.max_tokens}
    if params.top_p < 1.0 or llama:
        out["top_p"] = params.top_p
    if params.frequency_penalty or llama:
        out["frequency_penalty"] = params.frequency_penalty
    if params.presence_penalty or llama:
        out["presence_penalty"] = params.presence_penalty
    if params.top_k or llama:
        out["top_k"] = params.top_k
    if params.min_p or llama:
        out["min_p"] = params.min_p
    if params.repetition_penalty != 1.0 or llama:
        out["repeat_penalty" if llama else "repetition_penalty"] = params.repetition_penalty
    if params.stop:
        out["stop"] = list(params.stop)
    if params.seed is not None:
        out["seed"] = params.seed
    if params.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    if params.logprobs:
        out["logprobs"] = True
        if params.top_logprobs:
            out["top_logprobs"] = params.top_logprobs
    return out


def refused_param(status: int, detail: str, body: dict) -> str | None:
    """The request field a server's 4xx answer names: OpenAI's `error.param`, else the first
    field of `body` whose name the message quotes (vLLM, llama.cpp, Anthropic's and Gemini's
    compatible endpoints say "Unrecognized request argument supplied: top_k", "Unknown name
    \"min_p\"", "top_k: Extra inputs are not permitted")."""
    if status < 400 or status >= 500:
        return None
    try:
        err = json.loads(detail)
    except ValueError:
        err = None
    if isinstance(err, dict):
        e = err.get("error", err)
        if isinstance(e, dict) and isinstance(e.get("param"), str) and e["param"]:
            return e["param"].split(".")[0]
        if isinstance(err.get("detail"), list):  # FastAPI/pydantic: [{"loc": ["body", "top_k"], ...}]
            for d in err["detail"]:
                loc = [x for x in (d.get("loc") or []) if x != "body"] if isinstance(d, dict) else []
                if loc and str(loc[0]) in body:
                    return str(loc[0])
    for name in sorted(body, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z_]){re.escape(name)}(?![A-Za-z_])", detail):
            return name
    return None


def refusal_error(url: str, status: int, detail: str, body: dict, what: str) -> EngineRefused:
    param = refused_param(status, detail, body)
    said = f" the parameter {param!r}" if param else ""
    return EngineRefused(f"the inference server at {url} refused{said} ({what}): HTTP {status}: {detail}",
                         param=param, status=status)


class ToolCalls:
    """Tool calls as a stream delivers them: fragments by index, their arguments joined."""

    def __init__(self):
        self.calls: dict[int, dict] = {}

    def feed(self, deltas: Sequence[dict]) -> None:
        for d in deltas or []:
            i = d.get("index", len(self.calls))
            call = self.calls.setdefault(i, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] = d.get("id") or call["id"]
            call["type"] = d.get("type") or call["type"]
            fn = d.get("function") or {}
            # the name comes whole, in the first fragment (llama-cpp-python repeats it in each)
            call["function"]["name"] = call["function"]["name"] or fn.get("name") or ""
            args = fn.get("arguments")
            call["function"]["arguments"] += args if isinstance(args, str) else json.dumps(args) if args else ""

    def result(self) -> list[dict] | None:
        return [self.calls[i] for i in sorted(self.calls)] or None


def cached_tokens(usage: dict, timings: dict) -> int | None:
    """Prompt tokens the server served from its cache, where it says: OpenAI, vLLM, SGLang and
    llama.cpp's server (`usage.prompt_tokens_details.cached_tokens`), Anthropic's naming
    (`usage.cache_read_input_tokens`), llama.cpp's `timings.cache_n`; None where it does not."""
    details = usage.get("prompt_tokens_details") or {}
    for value in (details.get("cached_tokens"), usage.get("cache_read_input_tokens"), timings.get("cache_n")):
        if isinstance(value, int):
            return value
    return None
