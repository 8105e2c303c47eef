"""`AgentSession`: one user's conversation with memory, the turn of the design wired up.

A turn: store the user's message (committed before anything else), index it for recall,
fit the working context to its budget (evicting into the summary), recall memories for the
message, assemble the prompt as segments (namespace = tenant, so chunk KV never crosses
tenants), generate, then store the reply and a trace of what went into the prompt.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, fields, replace
from datetime import datetime

from .assemble import NOTE_MARGIN, RECALL_SHARE, Assembler, Context
from .compress.policy import BudgetPolicy
from .config import Config
from .engine.sampler import SamplingParams, with_defaults
from .tiers import MemoryStore, WorkingContext, clean_text
from .tiers.records import Hit, Memory, Message

# what `chat` / `chat_stream` take as keywords: SamplingParams' fields, but the ones the turn fills in
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams)) - {"copy_sources"}
TOOL_CALL_OPEN = "<tool_call>"  # api/reply_format.py's CALL_OPEN: a reply that opens with it is a tool call


@dataclass
class TurnTrace:
    """What one turn did: prompt segments with their KV fate, memories used, engine stats."""

    session_id: str
    segments: list[dict]
    memories_used: list[dict]
    stats: object  # engine GenerationStats
    message_ids: list[int]
    evicted: list[int] = field(default_factory=list)
    reply: str = ""
    logprobs: list | None = None  # when asked for: per token (id, logprob, [(id, logprob)])
    kv_pins: dict | None = None  # a reply that is a tool call: its prompt's chunks pinned {"pinned", "missing"}

    def to_dict(self) -> dict:
        s = self.stats
        stats = {k: getattr(s, k) for k in ("prompt_tokens", "completion_tokens", "reused_tokens", "recomputed_tokens",
                                            "prefilled_tokens", "ttft_s", "total_s", "finish_reason")}
        stats["cache_hit_ratio"] = s.cache_hit_ratio
        if getattr(s, "server", None):  # a remote engine: what the inference server reported
            stats["server"] = s.server
        out = {"session_id": self.session_id, "segments": self.segments, "memories_used": self.memories_used,
               "stats": stats, "message_ids": self.message_ids, "evicted": self.evicted, "reply": self.reply}
        if self.kv_pins is not None:
            out["kv_pins"] = self.kv_pins
        return out


class AgentSession:
    def __init__(self, user_id: str, tenant_id: str = "default", session_id: str | None = None,
                 config: Config | None = None, engine=None, store: MemoryStore | None = None):
        self.config = config or (store.config if store is not None else Config())
        if engine is None:
            from .engine import load_engine

            engine = load_engine(self.config)
        self.engine = engine
        self.store = store or MemoryStore(self.config)
        self.tenant_id, self.user_id = tenant_id, user_id
        budget = self.config.context_budget
        if budget + self.config.reply_tokens >= engine.context_window:
            raise ValueError(f"context_budget {budget} + reply_tokens {self.config.reply_tokens} must be below the "
                             f"model's context window {engine.context_window}")
        self.assembler = Assembler(engine, budget, BudgetPolicy(always_compress=self.config.compress_always))
        self.last_turn: TurnTrace | None = None
        self._compressor = None  # LLMLingua, built on the first question-aware turn
        self._lock = threading.RLock()
        self._open(session_id)

    def _open(self, session_id: str | None) -> None:
        info = self.store.open_session(self.tenant_id, self.user_id, session_id)
        self.session_id = info.id
        self.working = WorkingContext.open(self.store, self.tenant_id, self.user_id, self.session_id,
                                           self.engine.count_tokens, self.config.context_budget,
                                           self.config.evict_trigger,
                                           count_many=getattr(self.engine, "count_tokens_many", None))

    def sync(self) -> None:
        """Reload the working context when the archive no longer matches it: another replica
        added turns to this session, deleted some, or deleted the user (whose messages this
        object would otherwise still hold). The queue holds exactly the session's messages
        after the summary's last one, so one indexed query over those (their count and newest
        id) tells; its cost does not grow with the session's history. Replicas share only the
        database."""
        queue = self.working.queue
        tail = self.store.archive.session_tail(self.tenant_id, self.user_id, self.session_id,
                                               self.working.summary_upto)
        if tail != (len(queue), queue[-1].id if queue else 0):
            self._open(self.session_id)

    # --- the turn ----------------------------------------------------------------------------
    def chat(self, text: str | bytes, params: SamplingParams | None = None, *legacy, stream: bool = False,
             question_aware_tokens: int | None = None, extra_system: str | None = None,
             **overrides) -> str | Iterator[str]:
        """Reply to `text`: the reply's text, stored with a trace (`last_turn`) before it is
        returned. Takes `chat_stream`'s arguments, which yields the reply as it is made.
        `stream=True` is the older spelling of `chat_stream`, kept for the callers that use
        it: the one case where this returns an iterator."""
        params, qat = self._params(params, legacy, overrides)
        gen, pieces = self._turn(text, params, question_aware_tokens if qat is None else qat, extra_system)
        if stream:
            return pieces
        for _ in pieces:
            pass
        return gen.result.text

    def chat_stream(self, text: str | bytes, params: SamplingParams | None = None, *legacy,
                    question_aware_tokens: int | None = None, extra_system: str | None = None,
                    native: dict | None = None, **overrides) -> Iterator[str]:
        """Reply to `text` as an iterator of text pieces; the reply is stored and `last_turn`
        set when it is exhausted. The user's message is committed first, before this returns.

        Sampling is a `SamplingParams` (engine/sampler.py) and/or its fields as keywords on
        top (`max_tokens=64, temperature=0.7, stop=[...], grammar=...`). Without `params`, a
        field left out is the model's default (`engine.sampling_defaults`: generation_config.json,
        the model card, AGENTMEM_SAMPLE_*), max_tokens is `config.reply_tokens`, and the reply
        may not repeat `config.copy_guard_ngram` tokens in a row of an earlier reply of this
        session (`copy_ngram`). Bad values raise `InvalidSampling` before anything is stored.
        `extra_system` is appended to the system segment for this turn (tool definitions).
        `native`: request fields a chat engine's server takes as they are (api/native.py).
        `question_aware_tokens`: compress the recalled memories against `text` to about that
        many tokens (LongLLMLingua); their cached KV cannot be reused for this turn.
        Positional max_tokens and temperature after `text` (the older signature) still work, with
        a DeprecationWarning."""
        params, qat = self._params(params, legacy, overrides)
        return self._turn(text, params, question_aware_tokens if qat is None else qat, extra_system, native)[1]

    def _params(self, params, legacy: tuple, overrides: dict) -> tuple[SamplingParams, int | None]:
        """The turn's sampling, `params` (or the model's defaults) with `overrides` on top, and
        the question_aware_tokens an old positional call gave."""
        qat = None
        if legacy or (params is not None and not isinstance(params, SamplingParams)):
            warnings.warn("chat(text, max_tokens, temperature, question_aware_tokens) positionally is deprecated: "
                          "pass them as keywords, or a SamplingParams", DeprecationWarning, stacklevel=3)
            old = (params, *legacy)
            if len(old) > 3:
                raise TypeError(f"at most 3 positional arguments after text, got {len(old)}")
            old += (None,) * (3 - len(old))
            overrides = {"max_tokens": old[0], "temperature": old[1], **overrides}
            params, qat = None, old[2]
        unknown = sorted(set(overrides) - SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"unknown argument(s) {', '.join(unknown)}; sampling takes {', '.join(sorted(SAMPLING_FIELDS))}")
        given = {k: v for k, v in overrides.items() if v is not None}
        if params is None:
            given = {"max_tokens": self.config.reply_tokens, "copy_ngram": self.config.copy_guard_ngram, **given}
            params = with_defaults(getattr(self.engine, "sampling_defaults", {}), **given)
        else:
            params = replace(params, **given)
        return params.validate(), qat

    def _turn(self, text: str | bytes, params: SamplingParams, question_aware_tokens: int | None = None,
              extra_system: str | None = None, native: dict | None = None):
        """The turn of `chat` and `chat_stream`: (the engine's generation, its pieces as stored)."""
        with self._lock:
            text = clean_text(text, "message")
            self.sync()
            user_msg = self.store.add_messages(self.tenant_id, self.user_id, self.session_id,
                                               [{"role": "user", "content": text}])
            ctx, evicted = self._prepare(text, persist=True, exclude={user_msg[0].id})
            if extra_system:
                ctx = self.assembler.add_system(ctx, extra_system)
            if question_aware_tokens is not None:
                from .compress import Compressor, question_aware

                self._compressor = self._compressor or Compressor(self.engine)
                ctx = question_aware(ctx, self._compressor, text, question_aware_tokens)
            self.working.push(user_msg)
            if params.copy_ngram:
                earlier = [self.engine.encode(m.text) for m in self.working.queue if m.role == "assistant"]
                params = replace(params, copy_sources=earlier).validate()
            gen = self.engine.stream(ctx.prompt, params, **({"native": native} if native else {}))
        return gen, self._finish(gen, ctx, user_msg[0], evicted)

    def _finish(self, gen, ctx: Context, user_msg: Message, evicted: list[int]) -> Iterator[str]:
        yield from gen
        result = gen.result
        with self._lock:
            reply = result.text.strip()
            ids = [user_msg.id]
            if reply:
                stored = self.store.add_messages(self.tenant_id, self.user_id, self.session_id,
                                                 [{"role": "assistant", "content": reply}])
                self.working.push(stored)
                ids.append(stored[0].id)
            pins = self._pin_tool_call(ctx, result, reply)
            trace = TurnTrace(self.session_id, _segment_trace(ctx, result.stats), _memories_trace(ctx),
                              result.stats, ids, evicted, reply, result.logprobs, pins)
            self.store.record_turn(self.tenant_id, self.user_id, self.session_id, trace.to_dict())
            self.last_turn = trace

    def _pin_tool_call(self, ctx: Context, result, reply: str) -> dict | None:
        """A turn whose reply is a tool call keeps its prompt's chunk KV pinned in memory for
        `tool_pin_s` (AGENTMEM_TOOL_PIN_S): the continuation that brings the tool's result
        sends the same persona, core blocks and notes again and reuses them, however full the
        store got while the tool ran. Other pins may still push one out; that continuation's
        trace then says `kv_pin: evicted`. None: not a tool call, or no chunk KV reuse."""
        if not ends_in_tool_call(reply, result):
            return None
        reuse = getattr(self.engine, "chunk_reuse", None)
        if reuse is None or reuse.pin_s <= 0:
            return None
        # right after the turn's own prefill, so the chunks the store did not admit are
        # still at hand (ChunkReuse.pin)
        return reuse.pin(self.engine.tokenize_prompt(ctx.prompt))

    def _prepare(self, text: str, persist: bool, exclude: frozenset | set = frozenset()) -> tuple[Context, list[int]]:
        """Fit the working context and assemble the prompt for `text` as the next user turn."""
        working = self.working if persist else replace(self.working, queue=list(self.working.queue), persist=False)
        blocks = working.core_blocks()
        fixed = sum(s.tokens for s in self.assembler.fixed(blocks, text))
        summary_tokens = self.engine.count_tokens(working.summary) if working.summary else 0
        evicted = working.fit(fixed + summary_tokens + int(RECALL_SHARE * self.config.context_budget), keep_last=0)
        # With the earlier replies in the prompt, the recent turns are chat turns and recall
        # skips them. Without (the default), the user's side alone would be a run of turns
        # nobody answered, which the small model reads as questions still open (it answered
        # the previous one: "your sister is called ..." when asked for the dog); so recent
        # messages compete in recall like older ones and come in as notes when relevant
        # (docs/replies.md, "Answering from memory").
        recent = list(working.queue) if self.config.prompt_replies else []
        k = math.ceil(self.config.recall_k * NOTE_MARGIN)
        hits = self.store.search(self.tenant_id, self.user_id, text, k=k, own_replies=False,
                                 exclude_messages={m.id for m in recent} | set(exclude))
        memories = self.assembler.select_memories(hits, limit=self.config.recall_k)
        ctx = self.assembler.build(blocks, working.summary, memories, recent, text, namespace=self.tenant_id)
        return ctx, [m.id for m in evicted]

    # --- the rest of the API -----------------------------------------------------------------
    def add_messages(self, messages: list[dict]) -> list[Message]:
        """Import history without generating (times may be given: created_at, event_time).
        The messages join this session's working context, evicting into the summary as needed."""
        with self._lock:
            self.sync()
            stored = self.store.add_messages(self.tenant_id, self.user_id, self.session_id, messages)
            self.working.push(stored)
            self.working.fit(int(RECALL_SHARE * self.config.context_budget))
            return stored

    def search(self, query: str, k: int = 10, since: datetime | None = None, until: datetime | None = None, *,
               retrievers: Collection[str] | None = None) -> list[Hit]:
        """Hybrid recall over everything this user said (tiers/recall/); each hit names the
        retrievers that found it. `since`/`until` filter; time named in the query is a boost."""
        return self.store.search(self.tenant_id, self.user_id, query, k, since, until, retrievers=retrievers)

    def context(self, query: str) -> Context:
        """The prompt a turn with `query` would use now; nothing is stored or evicted."""
        with self._lock:
            self.sync()
            return self._prepare(clean_text(query, "query"), persist=False)[0]

    def memories(self, status: str | None = None) -> list[Memory]:
        """Facts and insights with their sources (message ids), status and successor."""
        return self.store.list_memories(self.tenant_id, self.user_id, status)

    def correct_memory(self, memory_id: int, text: str) -> Memory:
        """The user's correction of a memory: a new memory with the same sources supersedes
        the old one, which stays in the archive linked to it."""
        return self.store.correct_memory(self.tenant_id, self.user_id, memory_id, text)

    def delete_memory(self, memory_id: int) -> None:
        """Delete a memory for good (the user asked to forget it)."""
        self.store.delete_memory(self.tenant_id, self.user_id, memory_id)

    def forget(self) -> None:
        """Delete this user's data in every tier: archive rows, recall vectors, and cached KV
        (through the store's forget hooks). The session starts afresh afterwards."""
        with self._lock:
            if self.store.archive.user_exists(self.tenant_id, self.user_id):
                self.store.delete_user(self.tenant_id, self.user_id)
            reuse = getattr(self.engine, "chunk_reuse", None)
            if reuse is not None:
                # chunk KV is namespaced by tenant, so the user's chunks go with the tenant's:
                # it is a cache, dropping too much only costs a prefill
                reuse.drop_namespace(self.tenant_id)
            self.last_turn = None
            self._open(None)


def preview_context(store: MemoryStore, engine, config: Config, tenant_id: str, user_id: str, query: str) -> Context:
    """The prompt a turn with `query` would be given now in the user's latest session, for
    callers without a session object (the REST and MCP context endpoints). Nothing is stored:
    a user without a session gets one inside a transaction that is rolled back."""

    def build() -> Context:
        return AgentSession(user_id, tenant_id=tenant_id, session_id=sid, config=config, engine=engine,
                            store=store).context(query)

    sid = store.latest_session(tenant_id, user_id)
    if sid is not None:
        return build()
    try:
        with store.archive.tx():
            raise _Preview(build())
    except _Preview as done:
        return done.context


class _Preview(Exception):
    def __init__(self, context: Context):
        super().__init__("preview")
        self.context = context


def _segment_trace(ctx: Context, stats) -> list[dict]:
    per_seg = list(getattr(stats, "segments", None) or [])
    out = []
    for i, s in enumerate(ctx.segments):
        info = per_seg[i] if i < len(per_seg) else {}
        kv = info.get("how") or info.get("kv") or "prefilled"
        out.append({"tier": s.tier, "text": s.text, "tokens": s.tokens, "ref": s.ref, "kv": kv,
                    "recomputed": int(info.get("recomputed", 0))})
        if "kv_pin" in info:  # a tool call's pin kept this chunk (held), or pressure broke it (evicted)
            out[-1]["kv_pin"] = info["kv_pin"]
    return out


def ends_in_tool_call(reply: str, result=None) -> bool:
    """Whether a turn's reply is a tool call: it opens with the `<tool_call>` tag the chat
    API asks the embedded model to write (api/reply_format.py), or a chat engine's provider
    returned calls of its own."""
    return reply.lstrip().startswith(TOOL_CALL_OPEN) or bool(getattr(result, "tool_calls", None))


def _memories_trace(ctx: Context) -> list[dict]:
    return [{"ref": h.ref, "id": h.id, "kind": h.kind, "text": h.text, "score": round(h.score, 4),
             "time": h.time.isoformat(), "source_ids": h.source_ids} for h in ctx.memories]
