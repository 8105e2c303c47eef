"""SQL tables of the archive (SQLAlchemy 2 ORM). The Alembic migrations under `migrations/`
create exactly these; a change here needs a new revision there.

Every row carries its tenant and user: tenancy is a hard partition and every query filters
on it. Times are stored as naive UTC (SQLite has no time zones) and returned aware.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

ID = String(64)
NAME = String(200)


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def to_db_time(t: datetime | None) -> datetime | None:
    """Aware -> naive UTC; naive is taken as UTC already."""
    if t is None:
        return None
    if t.tzinfo is not None:
        t = t.astimezone(UTC).replace(tzinfo=None)
    return t


def from_db_time(t: datetime | None) -> datetime | None:
    return None if t is None else t.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    pass


# Full-text search objects that migration 0006 creates and the database maintains itself
# (tiers/lexical.py): no ORM model maps them, so schema comparisons leave them out.
FULLTEXT_OBJECTS = ("message_fts", "memory_fts", "search_tsv", "ix_messages_search_tsv", "ix_memories_search_tsv")


def include_object(obj, name: str | None, type_: str, reflected: bool, compare_to) -> bool:
    """Alembic's filter: everything but the full-text objects above."""
    return not (name or "").startswith(FULLTEXT_OBJECTS)


class TenantRow(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(NAME)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKeyRow(Base):
    __tablename__ = "api_keys"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ID, ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(128), unique=True)
    name: Mapped[str] = mapped_column(NAME, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class UserRow(Base):
    __tablename__ = "users"
    tenant_id: Mapped[str] = mapped_column(ID, ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    id: Mapped[str] = mapped_column(NAME, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class AgentRow(Base):
    """An agent persona a user talks to; sessions belong to one. The default agent is 'default'."""

    __tablename__ = "agents"
    tenant_id: Mapped[str] = mapped_column(ID, primary_key=True)
    user_id: Mapped[str] = mapped_column(NAME, primary_key=True)
    id: Mapped[str] = mapped_column(NAME, primary_key=True)
    persona: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class SessionRow(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    user_id: Mapped[str] = mapped_column(NAME)
    agent_id: Mapped[str] = mapped_column(NAME, default="default")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_sessions_scope", "tenant_id", "user_id"),)


class MessageRow(Base):
    __tablename__ = "messages"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    user_id: Mapped[str] = mapped_column(NAME)
    session_id: Mapped[str] = mapped_column(ID)
    role: Mapped[str] = mapped_column(String(16))
    text: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    event_time: Mapped[datetime | None] = mapped_column(nullable=True)
    compressed_text: Mapped[str | None] = mapped_column(Text, nullable=True)  # set once by reflection
    # who said it, when the conversation names its speakers (OpenAI's `name`); None: the role
    name: Mapped[str | None] = mapped_column(NAME, nullable=True)
    # what the full-text index reads besides `text`: speaker, date words, attachment captions,
    # the turn it answers (tiers/keys.py). Never shown; the prompt always gets `text` itself.
    keys: Mapped[str | None] = mapped_column(Text, nullable=True)
    __table_args__ = (
        Index("ix_messages_scope", "tenant_id", "user_id", "id"),
        Index("ix_messages_session", "session_id", "id"),
    )


class MemoryRow(Base):
    """A fact or insight about the user (written by reflection or by hand)."""

    __tablename__ = "memories"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    user_id: Mapped[str] = mapped_column(NAME)
    kind: Mapped[str] = mapped_column(String(32), default="fact")
    text: Mapped[str] = mapped_column(Text)
    compressed_text: Mapped[str | None] = mapped_column(Text, nullable=True)
    importance: Mapped[float] = mapped_column(Float, default=0.5)
    status: Mapped[str] = mapped_column(String(16), default="active")
    superseded_by: Mapped[int | None] = mapped_column(Integer, nullable=True)
    source_ids: Mapped[list] = mapped_column(JSON, default=list)
    event_time: Mapped[datetime | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_memories_scope", "tenant_id", "user_id", "status"),)


class SummaryRow(Base):
    """Running summary of a session; a new row per update keeps its history."""

    __tablename__ = "summaries"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    user_id: Mapped[str] = mapped_column(NAME)
    session_id: Mapped[str] = mapped_column(ID, index=True)
    text: Mapped[str] = mapped_column(Text)
    upto_message_id: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class CoreBlockRow(Base):
    __tablename__ = "core_blocks"
    tenant_id: Mapped[str] = mapped_column(ID, primary_key=True)
    user_id: Mapped[str] = mapped_column(NAME, primary_key=True)
    label: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text, default="")
    char_limit: Mapped[int] = mapped_column(Integer, default=2000)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class CoreBlockEditRow(Base):
    __tablename__ = "core_block_edits"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    user_id: Mapped[str] = mapped_column(NAME)
    label: Mapped[str] = mapped_column(String(64))
    old_value: Mapped[str] = mapped_column(Text)
    new_value: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_core_block_edits_scope", "tenant_id", "user_id", "label"),)


class TurnRow(Base):
    """Trace of one turn: what went into the prompt, KV per segment, timings."""

    __tablename__ = "turns"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    user_id: Mapped[str] = mapped_column(NAME)
    session_id: Mapped[str] = mapped_column(ID)
    trace: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_turns_scope", "tenant_id", "user_id", "session_id"),)
