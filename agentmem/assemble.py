"""Prompt assembly: the working context and recalled memories, as ordered `Segment`s.

Order: one system message holding the persona, the core blocks and the running summary,
then the recent turns (only when the session's earlier replies are in the prompt; otherwise
recent messages are recalled like older ones), then the new user turn: the recalled
memories as notes, followed by the question, then the generation prefix. Measured on `agentmem bench memory`, SmolLM2-135M
answers from notes placed right before the question far more often than from notes in the
system message, where it rather copies its own previous answer; and everything before the
notes is a prefix that stays the same from turn to turn, so its KV is reused exactly.

Each piece is its own segment with its own KV: a recalled memory is a segment whose text
depends only on the memory itself (its date, who said it, its stored or compressed text),
never on the turn, so the same memory gives the same tokens every time it is recalled and
its cached KV can be reused or blended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .compress.policy import BudgetPolicy
from .engine import Segment
from .tiers.keys import unprefixed
from .tiers.records import CoreBlock, Hit, Message, only_asks, own_reply

RECALL_SHARE = 0.35  # of the budget the recalled memories may use
MIN_SIMILARITY = 0.1  # below this, a hit that only embeddings found is noise, not memory
KEYS_CHARS = 300  # of a recalled message's captions and attachment text, shown after it
# A turn asks recall for the notes it may show and half as many again, for repeats and weak
# matches, leaving out the assistant's own replies (found by search, never shown: in bench
# memory's 8-fact workload ten replies saying "a good way to spend the day" had left "Which
# town is home for me these days?" without a note). One search: asking again for more when
# repeats left too few doubled context() at 100,000 messages for a note or two.
NOTE_MARGIN = 1.5
TURN_SHARE = 0.25  # a single message longer than this share of the budget is cut to it
RECALL_HEADER = "Notes from our earlier conversations (newer notes replace older ones):\n"
QUESTION_HEADER = "\nUsing these notes, answer: "
SUMMARY_HEADER = "Summary of the earlier part of this conversation:\n"


@dataclass
class ContextSegment:
    tier: str  # system | core | summary | recall | turn | user | generation
    text: str
    tokens: int
    ref: str | None = None
    memory_ids: list[str] = field(default_factory=list)
    cacheable: bool = True

    def to_dict(self) -> dict:
        return {"tier": self.tier, "text": self.text, "tokens": self.tokens, "ref": self.ref,
                "memory_ids": list(self.memory_ids), "cacheable": self.cacheable}


@dataclass
class Context:
    """The prompt one turn would use, with where each piece came from."""

    segments: list[ContextSegment]
    memories: list[Hit]
    namespace: str = ""

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.segments)

    @property
    def prompt(self) -> list[Segment]:
        return [Segment(s.text, cacheable=s.cacheable, tier=s.tier, ref=s.ref, namespace=self.namespace)
                for s in self.segments]

    def tokens_by_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.segments:
            out[s.tier] = out.get(s.tier, 0) + s.tokens
        return out

    def to_dict(self) -> dict:
        return {"total_tokens": self.total_tokens, "tokens_by_tier": self.tokens_by_tier(),
                "segments": [s.to_dict() for s in self.segments],
                "memories": [h.to_dict() | {"ref": h.ref} for h in self.memories]}


def memory_line(hit: Hit, compressed: bool = False) -> str:
    """A recalled memory as prompt text: stable across turns (no rank, no score). With
    `compressed`, its stored compressed text where it has one."""
    text = " ".join(((compressed and hit.compressed_text) or hit.text).split())
    if hit.kind == "message":
        text = unprefixed(text, hit.name)  # "Caroline said: ..." once, not "Caroline said: "Caroline: ...""
        who = f"{hit.name} said" if hit.name else "you said" if hit.role == "assistant" else "I said"
        context = f" ({hit.context})" if hit.context else ""  # the turn a short reply answers, or a question's answer
        shown = f" [attachment: {' '.join(hit.keys.split())[:KEYS_CHARS]}]" if hit.keys else ""  # a photo's caption
        return f'- {hit.time:%Y-%m-%d} {who}: "{text}"{shown}{context}\n'
    return f"- {hit.time:%Y-%m-%d} {hit.kind}: {text}\n"


def weak(hit: Hit) -> bool:
    """Only a weak embedding match: noise, not memory."""
    return hit.similarity < MIN_SIMILARITY and not {"lexical", "facts"} & set(hit.retrievers)


def note_hits(hits: list[Hit]) -> list[Hit]:
    """The hits that may become notes in a prompt, best first."""
    out, seen = [], set()
    for h in hits:
        said = " ".join(h.text.split()).lower()
        if said in seen:  # the same words said twice are one note
            continue
        if weak(h):
            continue  # only a weak embedding match: noise
        if h.kind == "message" and h.role == "user" and not h.name and not h.context and only_asks(h.text):
            # the user's own question with nothing beside it ("What am I allergic to?") says no
            # fact, and a note of it matches the question asked now word for word
            continue
        if h.kind == "message" and own_reply(h.role, h.name):
            # the small model's own earlier replies are unreliable, and as notes it copies
            # them word for word instead of answering (seen in the demo); search still finds
            # them. A named speaker's turn (an imported conversation) is a person's words.
            continue
        seen.add(said)
        out.append(h)
    return out


class Assembler:
    """Builds a `Context` with the engine's chat format and token counter."""

    def __init__(self, engine, budget: int, policy: BudgetPolicy | None = None):
        self.engine = engine
        self.budget = budget
        self.policy = policy or BudgetPolicy()
        self.sys_open, self.sys_close = engine.chat.wraps["system"]
        self.user_open, self.user_close = engine.chat.wraps["user"]

    def count(self, text: str) -> int:
        return self.engine.count_tokens(text)

    def clip(self, text: str, tokens: int) -> str:
        """Keep the last `tokens` tokens of an over-long message (its question is usually last)."""
        ids = self.engine.encode(text)
        return text if len(ids) <= tokens else "... " + self.engine.decode(ids[-tokens:])

    def _seg(self, tier: str, text: str, ref: str | None = None, cacheable: bool = True,
             memory_ids: list[str] | None = None) -> ContextSegment:
        return ContextSegment(tier, text, self.count(text), ref, memory_ids or [], cacheable)

    def fixed(self, blocks: list[CoreBlock], user_text: str) -> list[ContextSegment]:
        """Segments every prompt has whatever the history: system, core, user turn, prefix."""
        persona = next((b.value for b in blocks if b.label == "persona"), "")
        segs = [self._seg("system", f"{self.sys_open}{persona}\n", ref="core:persona")]
        for b in blocks:
            if b.label != "persona" and b.value.strip():
                segs.append(self._seg("core", f"[{b.label}]\n{b.value.strip()}\n", ref=f"core:{b.label}"))
        segs.append(self._seg("system", self.sys_close, ref="system:close"))
        segs.append(self._seg("user", self.engine.format_message("user", self.clip(user_text, self.turn_cap))))
        segs.append(self._seg("generation", self.engine.chat.generation_prefix, cacheable=False))
        return segs

    @property
    def turn_cap(self) -> int:
        return max(16, int(TURN_SHARE * self.budget))

    def select_memories(self, hits: list[Hit], limit: int | None = None) -> list[tuple[Hit, ContextSegment]]:
        """Best-scored hits first until the recall share is used (or `limit` notes are
        chosen; `hits` may hold more, for those filtered out), then shown the most relevant
        last, next to the question: the small model reads what is nearest the question best.
        Measured on bench memory's 8-fact workload (6 users, 48 questions, 3 sampling seeds,
        SmolLM2-135M bf16): 0.236 answer accuracy oldest first, 0.340 most relevant last (the
        header no longer says "oldest first"). A changed fact still reads in the order it
        changed where recency lifted the newer statement's score; every note carries its date.
        The budget policy picks, per tier,
        the original or the stored compressed texts: originals while they fit (compression
        costs the 135M model accuracy), compressed ones, cheapest tier first, when they do not."""
        room = int(RECALL_SHARE * self.budget) - self.count(self.user_open + RECALL_HEADER + QUESTION_HEADER)
        cands = []
        for h in note_hits(hits)[:limit]:
            tier = self.policy_tier(h)
            lines = (memory_line(h), memory_line(h, compressed=True))
            n_orig = self.count(lines[0])
            cands.append((h, tier, lines, [n_orig, n_orig if lines[1] == lines[0] else self.count(lines[1])]))
        original: dict[str, int] = {}
        compressed: dict[str, int] = {}
        for _, tier, _, (n_orig, n_comp) in cands:
            original[tier] = original.get(tier, 0) + n_orig
            compressed[tier] = compressed.get(tier, 0) + n_comp
        use = self.policy.plan(original, compressed, max(room, 1)).use_compressed if cands else {}
        chosen = []
        for h, tier, lines, tokens in cands:
            i = int(use.get(tier, False))
            if tokens[i] <= room:
                chosen.append((h, ContextSegment("recall", lines[i], tokens[i], h.ref, [h.ref])))
                room -= tokens[i]
        chosen.sort(key=lambda hs: (hs[0].score, hs[0].time, hs[0].ref))
        return chosen

    def policy_tier(self, hit: Hit) -> str:
        """The budget policy's tier of a recalled item: messages are `recall`, memories their kind."""
        return hit.kind if hit.kind != "message" and hit.kind in self.policy.rates else "recall"

    def add_system(self, ctx: Context, text: str) -> Context:
        """`text` appended to the system message for one turn (tool definitions), as its own
        segment so the persona's and the core blocks' KV stay reusable."""
        at = next(i for i, s in enumerate(ctx.segments) if s.ref == "system:close")
        ctx.segments.insert(at, self._seg("system", text.rstrip("\n") + "\n", ref="system:turn"))
        return ctx

    def build(self, blocks: list[CoreBlock], summary: str, memories: list[tuple[Hit, ContextSegment]],
              recent: list[Message], user_text: str, namespace: str = "") -> Context:
        fixed = self.fixed(blocks, user_text)
        head, close, tail = fixed[:-3], fixed[-3], fixed[-2:]
        segs = list(head)
        if summary:
            segs.append(self._seg("summary", f"{SUMMARY_HEADER}{summary}\n", ref="summary"))
        segs.append(close)
        for m in recent:
            segs.append(self._seg("turn", self.engine.format_message(m.role, self.clip(m.text, self.turn_cap)),
                                  ref=f"message:{m.id}"))
        if memories:
            segs.append(self._seg("recall", self.user_open + RECALL_HEADER, ref="recall:header"))
            segs += [seg for _, seg in memories]
            segs.append(self._seg("user", QUESTION_HEADER + self.clip(user_text, self.turn_cap) + self.user_close,
                                  ref="user:question"))
            return Context(segs + tail[1:], [h for h, _ in memories], namespace)
        segs += tail
        return Context(segs, [h for h, _ in memories], namespace)
