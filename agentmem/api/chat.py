"""Chat turns for the REST service.

With a `user`, a request is one turn of that user's `AgentSession`: the server holds the
history, so only the last user message is new (earlier ones are stored first when they
start a new session). Without a `user` the request is stateless: its messages are the
prompt, as with any OpenAI-compatible server. Either way generation goes through the
engine's batching scheduler; the only lock is per session, so two turns of one
conversation cannot interleave while different conversations run together.

`serial=True` is the benchmark's peer: one lock around every turn, so the server answers
one request at a time, as a server without a batching engine would.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from ..config import Config
from ..engine import InvalidSampling
from ..engine.results import ReuseShare
from ..engine.sampler import with_defaults
from ..tiers.store import default_session_id
from .errors import ApiError
from .inputs import check_logit_bias, check_texts, sampling_error
from .limits import Limits
from .native import native_fields
from .reply_format import ReplyFormat, plan, render_message
from .schemas import ChatCompletionRequest

MAX_OPEN_SESSIONS = 256


@dataclass
class TurnResult(ReuseShare):
    """What a finished turn reports, whichever path served it."""

    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    prefilled_tokens: int = 0
    ttft_s: float = 0.0
    finish_reason: str = "stop"
    session_id: str | None = None
    memories_used: list[str] = field(default_factory=list)
    engine_finish: str = ""  # the engine's reason, "repetition" included
    logprobs: list | None = None  # per token: (id, logprob, [(id, logprob)])
    tool_calls: list[dict] | None = None  # a chat engine's provider's own calls (api/native.py)


@dataclass
class _Open:
    session: object
    lock: threading.Lock = field(default_factory=threading.Lock)


def _from_stats(stats, text: str, session_id: str | None, memories: list[str], logprobs=None) -> TurnResult:
    return TurnResult(engine_finish=getattr(stats, "finish_reason", ""), logprobs=logprobs,text=text, prompt_tokens=stats.prompt_tokens, completion_tokens=stats.completion_tokens,
                      reused_tokens=stats.reused_tokens, recomputed_tokens=getattr(stats, "recomputed_tokens", 0),
                      prefilled_tokens=getattr(stats, "prefilled_tokens", 0), ttft_s=stats.ttft_s,
                      finish_reason=_finish(getattr(stats, "finish_reason", "stop")), session_id=session_id,
                      memories_used=memories, tool_calls=getattr(stats, "tool_calls", None))


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


class ChatService:
    def __init__(self, config: Config, store, engine_getter: Callable[[], object], limits: Limits,
                 serial: bool = False):
        self.config = config
        self.store = store
        self.engine = engine_getter
        self.limits = limits
        self._open: OrderedDict[tuple[str, str, str], _Open] = OrderedDict()
        self._lock = threading.Lock()
        self._serial = threading.Lock() if serial else None

    # --- validation ----------------------------------------------------------------------
    def check(self, req: ChatCompletionRequest) -> int:
        """Refuse what the limits forbid; returns the max_tokens to use."""
        if len(req.messages) > self.limits.max_messages:
            raise ApiError(400, f"at most {self.limits.max_messages} messages per request", code="too_many_messages",
                           param="messages")
        check_texts(req)
        for i, m in enumerate(req.messages):
            if len(m.text()) > self.limits.max_message_chars:
                raise ApiError(400, f"message {i} is longer than {self.limits.max_message_chars} characters",
                               code="message_too_long", param=f"messages.{i}.content")
        wanted = req.max_completion_tokens or req.max_tokens or self.config.reply_tokens
        if wanted > self.limits.max_tokens:
            raise ApiError(400, f"max_tokens may be at most {self.limits.max_tokens}", code="max_tokens_too_large",
                           param="max_tokens")
        if req.user is not None and not req.messages[-1].text().strip():
            raise ApiError(400, "the last message must have text", code="empty_message", param="messages")
        if req.user is not None and req.messages[-1].role != "user":
            raise ApiError(400, "with `user`, the last message must be the user's new turn", code="last_not_user",
                           param="messages")
        if req.user is None and req.session_id is not None:
            raise ApiError(400, "session_id needs a user", code="session_without_user", param="session_id")
        if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
            raise ApiError(400, f"temperature must be in [0, 2], got {req.temperature}", code="invalid_sampling",
                           param="temperature")
        try:
            self.sampling(req, wanted).validate(self._vocab())
        except InvalidSampling as exc:
            raise sampling_error(exc) from None
        return wanted

    def _vocab(self) -> int | None:
        """The model's vocabulary size where the engine knows it (a remote one may not)."""
        return getattr(getattr(self.engine(), "grammars", None), "vocab_size", None)

    def reply_format(self, req: ChatCompletionRequest) -> ReplyFormat:
        """What the reply must be (prose, tool call, JSON); a bad tool or schema is a 400."""
        engine = self.engine()
        fmt = plan(req, getattr(engine, "grammars", None))
        return ReplyFormat() if native_fields(req, engine) is not None else fmt  # the provider's own

    def sampling(self, req: ChatCompletionRequest, max_tokens: int, fmt: ReplyFormat | None = None):
        """The request's sampling on top of the model's defaults (OpenAI names)."""
        bias = check_logit_bias(req.logit_bias, self._vocab())
        return with_defaults(getattr(self.engine(), "sampling_defaults", {}), **self._sampling_kw(req, max_tokens, fmt),
                             logit_bias=bias)

    @staticmethod
    def _sampling_kw(req: ChatCompletionRequest, max_tokens: int, fmt: ReplyFormat | None) -> dict:
        return dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                    frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                    logprobs=req.logprobs, top_logprobs=req.top_logprobs, stop=req.stops(), seed=req.seed,
                    grammar=fmt.grammar if fmt is not None else None)

    # --- sessions ------------------------------------------------------------------------
    def _session(self, tenant_id: str, req: ChatCompletionRequest) -> tuple[_Open, bool]:
        from ..session import AgentSession

        sid = req.session_id or default_session_id(tenant_id, req.user)
        key = (tenant_id, req.user, sid)
        with self._lock:
            if key in self._open:
                self._open.move_to_end(key)
                return self._open[key], False
        # resumes the caller's own session or starts it; another tenant's id is NotFound (404)
        new = self.store.open_session(tenant_id, req.user, sid).message_count == 0
        session = AgentSession(req.user, tenant_id=tenant_id, session_id=sid, config=self.config,
                               engine=self.engine(), store=self.store)
        with self._lock:
            opened = self._open.setdefault(key, _Open(session))
            while len(self._open) > MAX_OPEN_SESSIONS:
                self._open.popitem(last=False)
        return opened, new

    def forget(self, tenant_id: str, user_id: str | None) -> None:
        """Drop open sessions of a deleted user or tenant (the store hook calls this)."""
        with self._lock:
            for key in [k for k in self._open if k[0] == tenant_id and (user_id is None or k[1] == user_id)]:
                del self._open[key]

    # --- turns ---------------------------------------------------------------------------
    def run(self, tenant_id: str, req: ChatCompletionRequest, max_tokens: int, fmt: ReplyFormat | None = None
            ) -> tuple[Iterator[str], Callable[[], TurnResult]]:
        """Start a turn: (iterator of text pieces, result() valid once the iterator is done)."""
        fmt = fmt or ReplyFormat()
        if req.user is None:
            return self._stateless(tenant_id, req, max_tokens, fmt)
        return self._remembered(tenant_id, req, max_tokens, fmt)

    def _one_at_a_time(self):
        return self._serial if self._serial is not None else contextlib.nullcontext()

    def _stateless(self, tenant_id: str, req, max_tokens: int, fmt: ReplyFormat):
        engine = self.engine()
        messages = [dict(zip(("role", "content"), render_message(m), strict=True)) for m in req.messages]
        if fmt.system:
            if messages[0]["role"] == "system":
                messages[0]["content"] += "\n\n" + fmt.system
            else:
                messages.insert(0, {"role": "system", "content": fmt.system})
        segments = [replace(s, namespace=tenant_id) for s in engine.chat_segments(messages)]
        params = self.sampling(req, max_tokens, fmt)
        native = native_fields(req, engine)
        done: dict[str, TurnResult] = {}

        def pieces() -> Iterator[str]:
            with self._one_at_a_time():
                stream = engine.stream(segments, params, **({"native": native} if native is not None else {}))
                try:
                    yield from stream
                finally:
                    stream.close()
                g = stream.result
                done["r"] = _from_stats(g.stats, g.text, None, [], g.logprobs)

        return pieces(), lambda: done["r"]

    def _remembered(self, tenant_id: str, req, max_tokens: int, fmt: ReplyFormat):
        opened, new = self._session(tenant_id, req)
        key_sid = req.session_id or default_session_id(tenant_id, req.user)
        session = opened.session
        text = req.messages[-1].text()
        earlier = [{"role": m.role, "content": m.text()} for m in req.messages[:-1]
                   if m.role in ("user", "assistant") and m.text().strip()]
        p = self.sampling(req, max_tokens, fmt)
        kw = {k: getattr(p, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                         "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
                                         "top_logprobs", "stop", "seed", "grammar")}
        native = native_fields(req, self.engine())
        if native is not None:
            kw["native"] = native
        done: dict[str, TurnResult] = {}

        def pieces() -> Iterator[str]:
            with opened.lock, self._one_at_a_time():
                if new and earlier:
                    session.add_messages(earlier)
                out = session.chat_stream(text, max_tokens=max_tokens, extra_system=fmt.system, **kw)
                parts = []
                for piece in out:
                    parts.append(piece)
                    yield piece
                turn = session.last_turn
                mems = [m["ref"] if isinstance(m, dict) else str(m) for m in turn.memories_used]
                done["r"] = _from_stats(turn.stats, "".join(parts), key_sid, mems, turn.logprobs)

        return pieces(), lambda: done["r"]


def now() -> int:
    return int(time.time())
