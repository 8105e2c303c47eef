"""`POST /v1/chat/completions` (plain and SSE) and `GET /v1/models`, as OpenAI defines them.

Handlers are plain `def`s, so FastAPI runs them in its threadpool: a request blocks a
worker thread while the engine's scheduler batches it with the others, and the event loop
stays free. A streamed reply is started before the response is, so a request the engine
refuses still gets a 4xx JSON error rather than a broken stream.
"""

from __future__ import annotations

import json
import uuid
import weakref
from collections.abc import Iterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ..engine.weights import DEFAULT_MODEL_ID
from ..tiers.records import NotFound
from .chat import TurnResult, now
from .deps import Caller, caller, services
from .disconnect import until_disconnected
from .errors import ApiError, error_body
from .reply_format import CallReader, ReplyFormat, ending, read_reply, verify
from .schemas import (
    AssistantMessage,
    CacheStats,
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    ModelCard,
    ModelList,
    Usage,
)

router = APIRouter(prefix="/v1", tags=["openai"])


def _model_id(svc) -> str:
    return svc.engine().model_id if svc.engine_loaded else (
        DEFAULT_MODEL_ID if svc.config.model_path is None else svc.config.model_path.name)


@router.get("/models", response_model=ModelList)
def list_models(_: Caller = Depends(caller), svc=Depends(services)) -> ModelList:
    return ModelList(data=[ModelCard(id=_model_id(svc), created=now())])


def _usage(r: TurnResult) -> Usage:
    return Usage(prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens,
                 total_tokens=r.prompt_tokens + r.completion_tokens)


def _extras(r: TurnResult) -> CacheStats:
    return CacheStats(reused_tokens=r.reused_tokens, recomputed_tokens=r.recomputed_tokens,
                      prefilled_tokens=r.prefilled_tokens, cache_hit_ratio=r.cache_hit_ratio, ttft_s=r.ttft_s,
                      memories_used=r.memories_used, finish_reason=r.engine_finish)


def _logprobs(r: TurnResult, svc) -> dict | None:
    """OpenAI's choice.logprobs: per token its text, log-probability, bytes and alternatives."""
    if r.logprobs is None:
        return None
    decode = svc.engine().decode

    def entry(tok: int, lp: float) -> dict:
        text = decode([tok])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in alts]} for t, lp, alts in r.logprobs]}


def _message(text: str, r: TurnResult, fmt: ReplyFormat) -> tuple[AssistantMessage, str]:
    if r.tool_calls:  # a chat engine's provider made them (api/native.py)
        return AssistantMessage(content=text or None, tool_calls=r.tool_calls), "tool_calls"
    calls, content, finish = read_reply(text, fmt, r.engine_finish or r.finish_reason)
    return AssistantMessage(content=content, tool_calls=calls or None), finish


@router.post("/chat/completions", response_model=ChatCompletion,
             responses={200: {"content": {"text/event-stream": {}}, "description": "a completion, or SSE chunks"}})
def chat_completions(req: ChatCompletionRequest, request: Request, who: Caller = Depends(caller),
                     svc=Depends(services)):
    """One chat turn. With `user`, that user's memory is recalled and the turn is stored;
    `session_id` (an agentmem extension) picks the conversation, default: the user's own."""
    max_tokens = svc.chat.check(req)
    fmt = svc.chat.reply_format(req)
    model = _model_id(svc) if svc.engine_loaded else req.model
    cid = "chatcmpl-" + uuid.uuid4().hex
    m = svc.metrics
    release = svc.chat_slots.enter(who.tenant_id)  # the tenant's own queue: 429 past it
    m.queue.inc()
    try:
        pieces, result = svc.chat.run(who.tenant_id, req, max_tokens, fmt)
        if not req.stream:
            for _ in until_disconnected(pieces, getattr(request.state, "client_gone", None)):
                pass
    except BaseException:
        m.queue.dec()
        release()
        raise
    if not req.stream:
        m.queue.dec()
        release()
        r = result()
        m.observe_generation(who.tenant_id, r.prompt_tokens, r.completion_tokens, r.reused_tokens, r.ttft_s)
        message, finish = _message(r.text, r, fmt)  # r.text: a looping reply holds one cycle
        verify(r.text, fmt, finish)
        return ChatCompletion(id=cid, created=now(), model=_model_id(svc),
                              choices=[Choice(message=message, finish_reason=finish, logprobs=_logprobs(r, svc))],
                              usage=_usage(r), session_id=r.session_id, agentmem=_extras(r))
    try:
        first = next(pieces, None)
    except BaseException:
        m.queue.dec()
        _close(pieces)
        release()
        raise
    body = _sse(cid, model, who.tenant_id, req, first, pieces, result, svc, fmt, release)
    weakref.finalize(body, release)  # a stream the client left before it started never runs its finally
    return StreamingResponse(body,
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _chunk(cid: str, model: str, delta: dict, finish: str | None = None, logprobs: dict | None = None,
           **extra) -> str:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    if logprobs:
        choice["logprobs"] = logprobs
    body = {"id": cid, "object": "chat.completion.chunk", "created": now(), "model": model,
            "choices": [choice], **extra}
    return f"data: {json.dumps(body)}\n\n"


def _sse(cid: str, model: str, tenant_id: str, req: ChatCompletionRequest, first: str | None,
         pieces: Iterator[str], result, svc, fmt: ReplyFormat, release) -> Iterator[str]:
    """Text streams as it comes. A reply that may be tool calls is read until its first
    characters tell (under the grammar a call starts with the call tag, prose cannot); each
    call is then sent whole, in its own tool_calls delta, as soon as it has closed."""
    m = svc.metrics
    try:
        yield _chunk(cid, model, {"role": "assistant", "content": ""})
        reader = CallReader(fmt)
        for piece in _chain(first, pieces):
            if not piece:
                continue
            if reader.prose:
                yield _chunk(cid, model, {"content": piece})
                continue
            done = len(reader.calls)
            for i, call in enumerate(reader.feed(piece), done):
                yield _chunk(cid, model, {"tool_calls": [{"index": i, **call}]})
            if reader.prose:  # prose after all: what was held back, then the rest as it comes
                yield _chunk(cid, model, {"content": reader.rest})
                reader.rest = ""
        r = result()
        m.observe_generation(tenant_id, r.prompt_tokens, r.completion_tokens, r.reused_tokens, r.ttft_s)
        last, _ = reader.finish()
        for call in last:
            yield _chunk(cid, model, {"tool_calls": [{"index": len(reader.calls) - 1, **call}]})
        content, finish = ending(reader, r.engine_finish or r.finish_reason)
        verify(r.text, fmt, finish)
        if content:
            yield _chunk(cid, model, {"content": content})
        for i, call in enumerate(r.tool_calls or []):  # a chat engine's provider's own calls
            yield _chunk(cid, model, {"tool_calls": [{"index": i, **call}]})
            finish = "tool_calls"
        lp = _logprobs(r, svc)
        yield _chunk(cid, model, {}, finish, lp, session_id=r.session_id, agentmem=_extras(r).model_dump())
        if req.stream_options and req.stream_options.include_usage:
            body = {"id": cid, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": [],
                    "usage": _usage(r).model_dump()}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    except ApiError as exc:  # the status line is gone: report in-band, as OpenAI does
        yield f"data: {json.dumps(error_body(exc.message, exc.type, exc.code, exc.param))}\n\n"
    except NotFound as exc:  # its user or tenant was deleted while it streamed: what a new request gets
        yield f"data: {json.dumps(error_body(str(exc), 'not_found_error', 'not_found'))}\n\n"
    except Exception as exc:
        yield f"data: {json.dumps(error_body(str(exc), 'api_error', 'stream_failed'))}\n\n"
    finally:
        m.queue.dec()
        _close(pieces)
        release()


def _chain(first: str | None, pieces: Iterator[str]) -> Iterator[str]:
    if first:
        yield first
    yield from pieces


def _close(pieces) -> None:
    close = getattr(pieces, "close", None)
    if close is not None:
        close()
