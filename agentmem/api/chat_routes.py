"""`POST /v1/chat/completions` (plain and SSE) and `GET /v1/models`, as OpenAI defines them.

Handlers are plain `def`s, so FastAPI runs them in its threadpool: a request blocks a
worker thread while the engine's scheduler batches it with the others, and the event loop
stays free. A streamed reply is started before the response is, so a request the engine
refuses still gets a 4xx JSON error rather than a broken stream.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ..engine.weights import DEFAULT_MODEL_ID
from .chat import TurnResult, now
from .deps import Caller, caller, services
from .disconnect import until_disconnected
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
                      memories_used=r.memories_used)


@router.post("/chat/completions", response_model=ChatCompletion,
             responses={200: {"content": {"text/event-stream": {}}, "description": "a completion, or SSE chunks"}})
def chat_completions(req: ChatCompletionRequest, request: Request, who: Caller = Depends(caller),
                     svc=Depends(services)):
    """One chat turn. With `user`, that user's memory is recalled and the turn is stored;
    `session_id` (an agentmem extension) picks the conversation, default: the user's own."""
    max_tokens = svc.chat.check(req)
    model = _model_id(svc) if svc.engine_loaded else req.model
    cid = "chatcmpl-" + uuid.uuid4().hex
    m = svc.metrics
    m.queue.inc()
    try:
        pieces, result = svc.chat.run(who.tenant_id, req, max_tokens)
        if not req.stream:
            text = "".join(until_disconnected(pieces, getattr(request.state, "client_gone", None)))
    except BaseException:
        m.queue.dec()
        raise
    if not req.stream:
        m.queue.dec()
        r = result()
        m.observe_generation(who.tenant_id, r.prompt_tokens, r.completion_tokens, r.reused_tokens, r.ttft_s)
        return ChatCompletion(id=cid, created=now(), model=_model_id(svc),
                              choices=[Choice(message=AssistantMessage(content=text), finish_reason=r.finish_reason)],
                              usage=_usage(r), session_id=r.session_id, agentmem=_extras(r))
    try:
        first = next(pieces, None)
    except BaseException:
        m.queue.dec()
        _close(pieces)
        raise
    return StreamingResponse(_sse(cid, model, who.tenant_id, req, first, pieces, result, svc),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _chunk(cid: str, model: str, delta: dict, finish: str | None = None, **extra) -> str:
    body = {"id": cid, "object": "chat.completion.chunk", "created": now(), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
    return f"data: {json.dumps(body)}\n\n"


def _sse(cid: str, model: str, tenant_id: str, req: ChatCompletionRequest, first: str | None,
         pieces: Iterator[str], result, svc) -> Iterator[str]:
    m = svc.metrics
    try:
        yield _chunk(cid, model, {"role": "assistant", "content": ""})
        if first:
            yield _chunk(cid, model, {"content": first})
        for piece in pieces:
            if piece:
                yield _chunk(cid, model, {"content": piece})
        r = result()
        m.observe_generation(tenant_id, r.prompt_tokens, r.completion_tokens, r.reused_tokens, r.ttft_s)
        yield _chunk(cid, model, {}, r.finish_reason, session_id=r.session_id,
                     agentmem=_extras(r).model_dump())
        if req.stream_options and req.stream_options.include_usage:
            body = {"id": cid, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": [],
                    "usage": _usage(r).model_dump()}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    except Exception as exc:  # the status line is gone: report in-band, as OpenAI does
        yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'api_error'}})}\n\n"
    finally:
        m.queue.dec()
        _close(pieces)


def _close(pieces) -> None:
    close = getattr(pieces, "close", None)
    if close is not None:
        close()
