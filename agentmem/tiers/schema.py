"""SQL tables of the archive (SQLAlchemy 2 ORM). The Alembic migrations under `migrations/`
create exactly these; a change here needs a new revision there.

Every row carries its tenant and user: tenancy is a hard partition and every query filters
on it. Times are stored as naive UTC (SQLite has no time zones) and returned aware.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from . import ids as row_ids
from .records import InvalidInput
from .sizes import (
    ID_CHARS,
    IDEMPOTENCY_KEY_CHARS,
    ITEM_KEY_CHARS,
    KIND_CHARS,
    LABEL_CHARS,
    MAX_TIME,
    MIN_TIME,
    NAME_CHARS,
    NAMESPACE_CHARS,
    ROLE_CHARS,
    SESSION_ID_CHARS,
)

ID = String(ID_CHARS)
NAME = String(NAME_CHARS)
SESSION_ID = String(SESSION_ID_CHARS)
ROW_ID = BigInteger().with_variant(Integer(), "sqlite")  # SQLite: INTEGER PRIMARY KEY is the 64-bit rowid


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def to_db_time(t: datetime | None) -> datetime | None:
    """Aware -> naive UTC; naive is taken as UTC already. A time whose UTC form falls outside
    `MIN_TIME`..`MAX_TIME` is refused (year 1 at +05:00 is in year 0 in UTC)."""
    if t is None:
        return None
    try:
        aware = t if t.tzinfo is not None else t.replace(tzinfo=UTC)
        if not MIN_TIME <= aware <= MAX_TIME:
            raise OverflowError
        return aware.astimezone(UTC).replace(tzinfo=None)
    except OverflowError:
        raise InvalidInput(f"time {t.isoformat()} is outside {MIN_TIME.date()}..{MAX_TIME.date()} (UTC)") from None


def from_db_time(t: datetime | None) -> datetime | None:
    return None if t is None else t.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    pass


# Full-text search objects that migration 0007 creates and the database maintains itself
# (tiers/lexical.py): no ORM model maps them, so schema comparisons leave them out.
FULLTEXT_OBJECTS = ("message_fts", "memory_fts", "search_tsv", "ix_messages_search_tsv", "ix_memories_search_tsv")


def include_object(obj, name: str | None, type_: str, reflected: bool, compare_to) -> bool:
    """Alembic's filter: everything but the full-text objects above."""
    return not (name or "").startswith(FULLTEXT_OBJECTS)


def new_row_id(context) -> int:
    """The id of a new message, memory or turn (tiers/ids.py), made on the inserting
    connection so that the database's counter advances inside the same transaction."""
    return row_ids.maker(context.connection.engine).make(row_ids.next_counter(context.connection))


class RowIdSecretRow(Base):
    """The key of the row-id permutation, made once per database (every replica shares it)."""

    __tablename__ = "row_id_secret"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    secret: Mapped[bytes] = mapped_column(LargeBinary(32))


class RowIdCounterRow(Base):
    """SQLite's row-id counter (PostgreSQL uses the sequence `row_id_seq` instead)."""

    __tablename__ = "row_id_counter"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    n: Mapped[int] = mapped_column(BigInteger)


class TenantRow(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(NAME)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class DeletedTenantRow(Base):
    """A deleted tenant's id, kept so that nothing (a write racing the deletion, background
    reflection, a stale key cache) can recreate it through `ensure_tenant`."""

    __tablename__ = "deleted_tenants"
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    deleted_at: Mapped[datetime] = mapped_column(default=utcnow)


class IdempotencyRow(Base):
    """A POST's Idempotency-Key: claimed (status None) while the first request runs, then
    its 2xx answer, replayed to retries for a day."""

    __tablename__ = "idempotency_keys"
    tenant_id: Mapped[str] = mapped_column(ID, primary_key=True)
    key: Mapped[str] = mapped_column(String(IDEMPOTENCY_KEY_CHARS), primary_key=True)
    user_id: Mapped[str | None] = mapped_column(NAME, nullable=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    status: Mapped[int | None] = mapped_column(Integer, nullable=True)
    content_type: Mapped[str | None] = mapped_column(String(128), nullable=True)
    body: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
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
    """Session ids are the client's to choose, so they are scoped by tenant and user: two
    tenants may both have a `support-1`, and neither can learn of the other's."""

    __tablename__ = "sessions"
    tenant_id: Mapped[str] = mapped_column(ID, primary_key=True)
    user_id: Mapped[str] = mapped_column(NAME, primary_key=True)
    id: Mapped[str] = mapped_column(SESSION_ID, primary_key=True)
    agent_id: Mapped[str] = mapped_column(NAME, default="default")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_sessions_scope", "tenant_id", "user_id"),)


class MessageRow(Base):
    __tablename__ = "messages"
    id: Mapped[int] = mapped_column(ROW_ID, primary_key=True, autoincrement=False, default=new_row_id)
    tenant_id: Mapped[str] = mapped_column(ID)
    user_id: Mapped[str] = mapped_column(NAME)
    session_id: Mapped[str] = mapped_column(SESSION_ID)
    role: Mapped[str] = mapped_column(String(ROLE_CHARS))
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
    id: Mapped[int] = mapped_column(ROW_ID, primary_key=True, autoincrement=False, default=new_row_id)
    tenant_id: Mapped[str] = mapped_column(ID)
    user_id: Mapped[str] = mapped_column(NAME)
    kind: Mapped[str] = mapped_column(String(KIND_CHARS), default="fact")
    text: Mapped[str] = mapped_column(Text)
    compressed_text: Mapped[str | None] = mapped_column(Text, nullable=True)
    importance: Mapped[float] = mapped_column(Float, default=0.5)
    status: Mapped[str] = mapped_column(String(16), default="active")
    superseded_by: Mapped[int | None] = mapped_column(ROW_ID, nullable=True)
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
    session_id: Mapped[str] = mapped_column(SESSION_ID, index=True)
    text: Mapped[str] = mapped_column(Text)
    upto_message_id: Mapped[int] = mapped_column(ROW_ID)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class CoreBlockRow(Base):
    __tablename__ = "core_blocks"
    tenant_id: Mapped[str] = mapped_column(ID, primary_key=True)
    user_id: Mapped[str] = mapped_column(NAME, primary_key=True)
    label: Mapped[str] = mapped_column(String(LABEL_CHARS), primary_key=True)
    value: Mapped[str] = mapped_column(Text, default="")
    char_limit: Mapped[int] = mapped_column(Integer, default=2000)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    # row version: every UPDATE checks it, so two replicas' concurrent edits cannot both win
    version: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    __mapper_args__ = {"version_id_col": version}


class CoreBlockEditRow(Base):
    __tablename__ = "core_block_edits"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    user_id: Mapped[str] = mapped_column(NAME)
    label: Mapped[str] = mapped_column(String(LABEL_CHARS))
    old_value: Mapped[str] = mapped_column(Text)
    new_value: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_core_block_edits_scope", "tenant_id", "user_id", "label"),)


class TurnRow(Base):
    """Trace of one turn: what went into the prompt, KV per segment, timings."""

    __tablename__ = "turns"
    id: Mapped[int] = mapped_column(ROW_ID, primary_key=True, autoincrement=False, default=new_row_id)
    tenant_id: Mapped[str] = mapped_column(ID)
    user_id: Mapped[str] = mapped_column(NAME)
    session_id: Mapped[str] = mapped_column(SESSION_ID)
    trace: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_turns_scope", "tenant_id", "user_id", "session_id"),)


class SessionItemRow(Base):
    """One item of an agent framework's session log, exactly as the framework gave it (the
    OpenAI Agents SDK's input items: messages, function calls and their outputs), in order.
    Its readable text, where it has one, is also an archive message (`message_id`), so what
    an agent's session said becomes the user's searchable memory."""

    __tablename__ = "session_items"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    user_id: Mapped[str] = mapped_column(NAME)
    session_id: Mapped[str] = mapped_column(SESSION_ID)
    item: Mapped[dict] = mapped_column(JSON)
    message_id: Mapped[int | None] = mapped_column(ROW_ID, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_session_items_scope", "tenant_id", "user_id", "session_id", "id"),)


class StoreItemRow(Base):
    """A key-value item of an agent framework's store (LangGraph's BaseStore), under a
    namespace path. Its searchable text is a memory of the user (`memory_id`), so the
    store's search is agentmem's hybrid recall."""

    __tablename__ = "store_items"
    tenant_id: Mapped[str] = mapped_column(ID, primary_key=True)
    user_id: Mapped[str] = mapped_column(NAME, primary_key=True)
    namespace: Mapped[str] = mapped_column(String(NAMESPACE_CHARS), primary_key=True)
    key: Mapped[str] = mapped_column(String(ITEM_KEY_CHARS), primary_key=True)
    value: Mapped[dict] = mapped_column(JSON)
    memory_id: Mapped[int | None] = mapped_column(ROW_ID, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    __table_args__ = (Index("ix_store_items_memory", "tenant_id", "user_id", "memory_id"),)
