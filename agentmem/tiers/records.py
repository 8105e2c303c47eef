"""Plain records returned by the memory store. Callers never see ORM rows: these are
detached, immutable, and serialise with `to_dict()` (times as ISO-8601 UTC)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import datetime


class NotFound(LookupError):
    """The id does not exist in this tenant and user's scope (another tenant's id looks the same)."""


class InvalidInput(ValueError):
    """Input the memory cannot store: empty text, invalid UTF-8, NUL characters, bad labels."""


class Conflict(RuntimeError):
    """A write based on a version that another writer has already replaced (a 409)."""


def _plain(value):
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _Record:
    def to_dict(self) -> dict:
        return {k: _plain(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Tenant(_Record):
    id: str
    name: str
    created_at: datetime


@dataclass(frozen=True)
class User(_Record):
    id: str
    tenant_id: str
    created_at: datetime


@dataclass(frozen=True)
class SessionInfo(_Record):
    id: str
    user_id: str
    agent_id: str
    created_at: datetime
    message_count: int = 0


@dataclass(frozen=True)
class Message(_Record):
    id: int
    session_id: str
    role: str
    text: str
    created_at: datetime
    event_time: datetime | None = None
    compressed_text: str | None = None  # LLMLingua-compressed, written once by reflection
    name: str | None = None  # the speaker, when the conversation names them
    keys: str | None = None  # captions and attachment text it carries: indexed, and shown after the text

    @property
    def time(self) -> datetime:
        """When it happened: the event time if the caller gave one, else when it was stored."""
        return self.event_time or self.created_at


SENTENCE_BREAK = re.compile(r"(?<=[.!?…])\s+(?=\S)|\n+")


def only_asks(text: str) -> bool:
    """A turn that only asks ("Read anything good lately?"): a question, one sentence."""
    text = text.strip()
    return text.endswith("?") and len([p for p in SENTENCE_BREAK.split(text) if p.strip()]) == 1


def own_reply(role: str, name: str | None) -> bool:
    """Whether a turn is the assistant's own reply: an assistant turn with no speaker's name (an
    imported conversation's named speakers are people's words). Recall weighs such turns down,
    and the prompt never shows them as notes."""
    return role == "assistant" and not name


@dataclass(frozen=True)
class MessageMeta:
    """What ranking reads of a candidate message, without its text."""

    id: int
    session_id: str
    role: str
    name: str | None
    time: datetime


@dataclass(frozen=True)
class Memory(_Record):
    id: int
    user_id: str
    kind: str
    text: str
    compressed_text: str | None
    importance: float
    status: str
    superseded_by: int | None
    source_ids: list[int]
    event_time: datetime | None
    created_at: datetime
    updated_at: datetime

    @property
    def time(self) -> datetime:
        return self.event_time or self.created_at


@dataclass(frozen=True)
class CoreBlock(_Record):
    label: str
    value: str
    limit: int
    updated_at: datetime
    version: int = 0  # the row version an edit must name to replace this value

    @property
    def id(self) -> str:
        return self.label


@dataclass(frozen=True)
class CoreBlockEdit(_Record):
    id: int
    label: str
    old_value: str
    new_value: str
    created_at: datetime


@dataclass(frozen=True)
class Summary(_Record):
    id: int
    session_id: str
    text: str
    upto_message_id: int
    created_at: datetime


@dataclass(frozen=True)
class Turn(_Record):
    id: int
    session_id: str
    trace: dict
    created_at: datetime


@dataclass(frozen=True)
class Hit(_Record):
    """One recall result. `kind` is 'message' or the memory kind ('fact', 'insight', ...);
    `id` is the message or memory row id; `source_ids` the messages it rests on."""

    id: int
    kind: str
    text: str
    score: float
    similarity: float
    time: datetime
    source_ids: list[int] = field(default_factory=list)
    role: str = ""
    session_id: str = ""
    importance: float = 0.5
    chunk: int = 0  # which piece of a message too long to embed whole
    compressed_text: str | None = None  # a memory's compressed form, what the prompt shows
    retrievers: list[str] = field(default_factory=list)  # which retrievers found it: dense, context, lexical, facts, time (the search inside the time the query names), person, neighbour (only the turn beside a top hit)
    name: str | None = None  # a message's speaker, when known
    # a short reply's question, or a question's reply: the neighbour turn that makes it make
    # sense ("The cello!" after "What did you end up buying?"), as 'asked by NAME: "..."' text
    context: str | None = None
    # a message's captions and attachment text (`Message.keys`): the fact an "ok look 😍" with a
    # photo states is in its caption, so the prompt shows it after the text
    keys: str | None = None

    @property
    def ref(self) -> str:
        base = f"{'message' if self.kind == 'message' else 'memory'}:{self.id}"
        return f"{base}#{self.chunk}" if self.chunk else base
