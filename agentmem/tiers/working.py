"""The working context of one session: core memory blocks, the recent message queue and a
running summary, kept inside a token budget measured with the engine's own tokenizer.

When the prompt would pass `evict_trigger` of the budget, the oldest turns leave the queue
(they stay in the archive and in recall) and are folded into the summary. Eviction goes down
to `EVICT_TARGET` of the budget, not just under the trigger, so it happens rarely: between
evictions the summary text does not change and its KV can be reused turn after turn.

The summary is extractive and deterministic: the first sentence of each evicted user
message, oldest lines dropped when it outgrows its share. A 135M model cannot be trusted
to summarise (it invents facts), and a deterministic summary keeps its tokens stable.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy.exc import IntegrityError

from .records import CoreBlock, Message
from .store import MemoryStore

EVICT_TARGET = 0.6  # of the budget, after an eviction
SUMMARY_SHARE = 0.15  # of the budget the summary may use
LINE_CHARS = 200  # one summary line quotes at most this much of a message
DEFAULT_BLOCKS = {
    # kept plain on purpose: SmolLM2-135M answers worse when told it is a "memory assistant"
    "persona": "You are a helpful assistant.",
    "human": "",
}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def summary_line(message: Message) -> str:
    """One deterministic line for an evicted message: its date and first sentence."""
    text = " ".join(message.text.split())
    first = _SENTENCE_END.split(text, maxsplit=1)[0]
    if len(first) > LINE_CHARS:
        first = first[:LINE_CHARS].rsplit(" ", 1)[0] + " ..."
    return f"- {message.time:%Y-%m-%d} {message.role}: {first}"


@dataclass
class WorkingContext:
    store: MemoryStore
    tenant_id: str
    user_id: str
    session_id: str
    count_tokens: Callable[[str], int]
    budget: int
    evict_trigger: float = 0.9
    queue: list[Message] = field(default_factory=list)
    summary: str = ""
    summary_upto: int = 0
    evictions: int = 0
    persist: bool = True  # False for a dry run (AgentSession.context): nothing is written
    count_many: Callable[[list[str]], list[int]] | None = None  # batched counter (fast tokenizer)
    _tokens: dict[int, int] = field(default_factory=dict)
    _line_tokens: dict[str, int] = field(default_factory=dict)

    @classmethod
    def open(cls, store: MemoryStore, tenant_id: str, user_id: str, session_id: str,
             count_tokens: Callable[[str], int], budget: int, evict_trigger: float = 0.9,
             count_many: Callable[[list[str]], list[int]] | None = None) -> WorkingContext:
        """Load a session's state: its latest summary and the messages after it."""
        if not 0.0 < evict_trigger <= 1.0:
            raise ValueError(f"evict_trigger must be in (0, 1], got {evict_trigger}")
        wc = cls(store, tenant_id, user_id, session_id, count_tokens, budget, evict_trigger, count_many=count_many)
        s = store.archive.latest_summary(tenant_id, user_id, session_id)
        if s is not None:
            wc.summary, wc.summary_upto = s.text, s.upto_message_id
        wc.queue = store.archive.messages(tenant_id, user_id, session_id=session_id, after_id=wc.summary_upto)
        return wc

    def core_blocks(self) -> list[CoreBlock]:
        """This user's core blocks; the defaults are written on first use."""
        blocks = self.store.core_blocks(self.tenant_id, self.user_id)
        missing = [label for label in DEFAULT_BLOCKS if label not in {b.label for b in blocks}]
        if missing and not self.persist:
            return blocks + [CoreBlock(label, DEFAULT_BLOCKS[label], 0, None) for label in missing]
        for label in missing:
            try:
                self.store.set_core_block(self.tenant_id, self.user_id, label, DEFAULT_BLOCKS[label])
            except IntegrityError:  # another session of this user wrote the default first
                pass
        return self.store.core_blocks(self.tenant_id, self.user_id) if missing else blocks

    def push(self, messages: list[Message]) -> None:
        self.queue.extend(messages)

    def _count(self, texts: list[str]) -> list[int]:
        if self.count_many is not None and len(texts) > 1:
            return list(self.count_many(texts))
        return [self.count_tokens(t) for t in texts]

    def message_tokens(self, m: Message) -> int:
        if m.id not in self._tokens:
            self._tokens[m.id] = self.count_tokens(m.text)
        return self._tokens[m.id]

    def queue_tokens(self) -> int:
        """Tokens of the queued messages, each counted once, new ones in one batch."""
        new = [m for m in self.queue if m.id not in self._tokens]
        if new:
            self._tokens.update(zip((m.id for m in new), self._count([m.text for m in new]), strict=True))
        return sum(self._tokens[m.id] for m in self.queue)

    def fit(self, other_tokens: int, keep_last: int = 1) -> list[Message]:
        """Evict the oldest turns if `other_tokens` plus the queue passes the trigger; the
        last `keep_last` messages (the new user turn) always stay. Returns what was evicted."""
        total = other_tokens + self.queue_tokens()
        if total <= self.evict_trigger * self.budget:
            return []
        target = EVICT_TARGET * self.budget
        evicted: list[Message] = []
        while len(self.queue) > keep_last and total > target:
            evicted.append(self.queue.pop(0))
            total -= self._tokens[evicted[-1].id]
        # never split a user turn from its reply: a leading assistant message goes too
        while len(self.queue) > keep_last and self.queue[0].role == "assistant":
            evicted.append(self.queue.pop(0))
        if evicted:
            self._fold(evicted)
        return evicted

    def _fold(self, evicted: list[Message]) -> None:
        lines = [ln for ln in self.summary.splitlines() if ln]
        lines += [summary_line(m) for m in evicted if m.role == "user"]
        cap = int(SUMMARY_SHARE * self.budget)
        # newest lines first until the cap: each line counted once (+1 for its newline), in a
        # batch; the sum stands for the joined text's count (a cap, not an exact budget)
        uncounted = [ln for ln in lines if ln not in self._line_tokens]
        self._line_tokens.update(zip(uncounted, self._count(uncounted), strict=True))
        kept, used = [], 0
        for ln in reversed(lines):
            used += self._line_tokens[ln] + 1
            if kept and used > cap:
                break
            kept.append(ln)
        lines = kept[::-1]
        self._line_tokens = {ln: self._line_tokens[ln] for ln in lines}
        self.summary = "\n".join(lines)
        self.summary_upto = evicted[-1].id
        self.evictions += 1
        if self.persist:
            self.store.archive.save_summary(self.tenant_id, self.user_id, self.session_id, self.summary, self.summary_upto)
