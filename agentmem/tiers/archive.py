"""The archive: every message, memory, summary, core block and turn trace, in SQL.

It is the source of truth of the memory: the recall index and the working context are
caches of it. SQLite (WAL, one file under the data dir) is the embedded default; any
SQLAlchemy URL works, PostgreSQL being the multi-replica deployment. The schema is brought
to the newest Alembic revision when the archive opens.
"""

from __future__ import annotations

import fcntl
import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import create_engine, delete, event, func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError

from . import ids as row_ids
from . import lexical
from . import records as R
from .keys import attachment_text, message_text, prefix_name, transcript_speakers
from .records import Conflict, InvalidInput, MessageMeta, NotFound
from .schema import (
    AgentRow,
    ApiKeyRow,
    CoreBlockEditRow,
    CoreBlockRow,
    DeletedTenantRow,
    IdempotencyRow,
    MemoryRow,
    MessageRow,
    RowIdSecretRow,
    SessionItemRow,
    SessionRow,
    StoreItemRow,
    SummaryRow,
    TenantRow,
    TurnRow,
    UserRow,
    from_db_time,
    to_db_time,
    utcnow,
)
from .scope import check_id
from .sizes import KIND_CHARS, LABEL_CHARS, MAX_BLOCK_LIMIT, NAME_CHARS
from .timeparse import parse_timestamp

ROLES = ("system", "user", "assistant", "tool")
MEMORY_STATUSES = ("active", "superseded")
IDEMPOTENCY_TTL = timedelta(days=1)
IDEMPOTENCY_RUN_TIMEOUT = timedelta(minutes=10)  # a claim older than this was abandoned by a dead process
DEFAULT_BLOCK_LIMIT = 2000  # characters; MemGPT's default core block size
_MIGRATIONS = Path(__file__).parent / "migrations"
_PG_MIGRATION_LOCK = 0x61676D656D  # any constant shared by every agentmem process
_USER_TABLES = (MessageRow, MemoryRow, SummaryRow, CoreBlockRow, CoreBlockEditRow, TurnRow, SessionRow, AgentRow,
                SessionItemRow, StoreItemRow)


def clean_text(text: str | bytes, what: str = "text", allow_empty: bool = False) -> str:
    """Validate text before it reaches SQL: bytes must be UTF-8, no NULs (PostgreSQL rejects
    them), no lone surrogates, and not blank unless allowed."""
    if isinstance(text, bytes | bytearray):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidInput(f"{what} is not valid UTF-8: {e}") from None
    if not isinstance(text, str):
        raise InvalidInput(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"{what} contains characters that are not valid UTF-8 (lone surrogates)") from None
    if "\x00" in text:
        raise InvalidInput(f"{what} contains a NUL character")
    if not allow_empty and not text.strip():
        raise InvalidInput(f"{what} is empty")
    return text


def _scope_id(value: str, what: str, max_chars: int = NAME_CHARS) -> str:
    value = clean_text(value, what)
    if len(value) > max_chars:
        raise InvalidInput(f"{what} is longer than {max_chars} characters")
    return value


def migrate(connection, revision: str = "head") -> None:
    """Bring the schema to `revision` (Alembic, on an open connection)."""
    from alembic import command
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.attributes["connection"] = connection
    command.upgrade(cfg, revision)


@contextmanager
def _migration_lock(engine) -> Iterator[None]:
    """Serialise schema upgrades across processes: replicas starting together on one
    PostgreSQL, or two processes opening a new SQLite file, must not both create the tables.
    SQLite: a lock file beside the database; PostgreSQL: an advisory lock (held by the
    migrating transaction itself, see `Archive.__init__`)."""
    db = engine.url.database
    if engine.dialect.name != "sqlite" or not db or db == ":memory:" or db.startswith("file:"):
        yield
        return
    with open(f"{db}.migrate-lock", "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# arms of one neighbour statement's UNION ALL (SQLite allows 500 by default; each arm binds 2
# parameters, far under its 32,766)
NEIGHBOUR_BATCH = 200


class Archive:
    def __init__(self, url: str, sync: str = "normal"):
        """`sync`: SQLite's synchronous mode, "normal" or "full" (power-loss durable)."""
        if sync not in ("normal", "full"):
            raise ValueError(f"db sync must be 'normal' or 'full', got {sync!r}")
        self.url = url
        sqlite = url.startswith("sqlite")
        self.engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30} if sqlite else {},
                                    pool_pre_ping=not sqlite)
        if sqlite:
            _private_file(self.engine.url.database)
            event.listen(self.engine, "connect", lambda conn, _: _sqlite_pragmas(conn, sync))
        with _migration_lock(self.engine), self.engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("select pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
            migrate(conn)
            lexical.ensure_index(conn)
        with self.engine.connect() as conn:
            secret = conn.execute(select(RowIdSecretRow.secret).where(RowIdSecretRow.id == 1)).scalar_one()
            floor = max(conn.scalar(select(func.coalesce(func.max(t.id), 0))) for t in (MessageRow, MemoryRow, TurnRow))
        row_ids.register(self.engine, row_ids.IdMaker(bytes(secret), int(floor)))
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._current: ContextVar[Session | None] = ContextVar(f"archive_tx_{id(self)}", default=None)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def tx(self) -> Iterator[Session]:
        """A transaction, committed when the block ends. Nested in another `tx` of the same
        thread it joins that one, so several archive calls (an import's sessions, messages,
        memories and blocks) commit together or not at all."""
        outer = self._current.get()
        if outer is not None:
            yield outer
            return
        with self._sessions() as s, s.begin():
            token = self._current.set(s)
            try:
                yield s
            finally:
                self._current.reset(token)

    # --- tenants and keys --------------------------------------------------------------------
    def ensure_tenant(self, tenant_id: str, name: str | None = None) -> None:
        """Create the tenant unless it exists; a deleted tenant is never recreated (NotFound)."""
        tenant_id = _scope_id(tenant_id, "tenant_id")
        with self.tx() as s:
            self._tenant_in(s, tenant_id, name)

    def _tenant_in(self, s: Session, tenant_id: str, name: str | None = None) -> None:
        if s.get(TenantRow, tenant_id) is not None:
            return
        if s.get(DeletedTenantRow, tenant_id) is not None:
            raise NotFound(f"tenant {tenant_id!r} not found")
        _add_once(s, TenantRow(id=check_id(tenant_id, "tenant_id"), name=name or tenant_id))

    def create_tenant(self, name: str) -> str:
        name = _scope_id(name, "tenant name")
        tenant_id = uuid.uuid4().hex
        with self.tx() as s:
            s.add(TenantRow(id=tenant_id, name=name))
        return tenant_id

    def list_tenants(self) -> list[R.Tenant]:
        with self.tx() as s:
            rows = s.scalars(select(TenantRow).order_by(TenantRow.created_at, TenantRow.id))
            return [R.Tenant(id=r.id, name=r.name, created_at=from_db_time(r.created_at)) for r in rows]

    def delete_tenant(self, tenant_id: str) -> None:
        with self.tx() as s:
            if s.get(TenantRow, tenant_id, with_for_update=True) is None:  # writers wait (_hold)
                raise NotFound(f"tenant {tenant_id!r} not found")
            for table in (*_USER_TABLES, IdempotencyRow, ApiKeyRow, UserRow):
                s.execute(delete(table).where(table.tenant_id == tenant_id))
            s.execute(delete(TenantRow).where(TenantRow.id == tenant_id))
            s.add(DeletedTenantRow(id=tenant_id))
        self._scrub()

    def add_api_key(self, tenant_id: str, key_hash: str, name: str = "") -> None:
        with self.tx() as s:
            if s.get(TenantRow, tenant_id) is None:
                raise NotFound(f"tenant {tenant_id!r} not found")
            s.add(ApiKeyRow(tenant_id=tenant_id, key_hash=key_hash, name=name))

    def tenant_for_key_hash(self, key_hash: str) -> str | None:
        with self.tx() as s:
            return s.scalar(select(ApiKeyRow.tenant_id).where(ApiKeyRow.key_hash == key_hash))

    # --- idempotency keys ---------------------------------------------------------------------
    def claim_idempotency_key(self, tenant_id: str, key: str, fingerprint: str,
                              user_id: str | None) -> tuple[str, tuple[int, str, bytes] | None]:
        """("new", None): the caller runs the request and then finishes or releases the key;
        ("done", (status, content_type, body)): replay that; ("busy", None): the first
        request still runs; ("mismatch", None): the key belongs to another request."""
        try:
            return self._claim(tenant_id, key, fingerprint, user_id)
        except IntegrityError:  # SQLite: another request claimed it between our read and insert
            return self._claim(tenant_id, key, fingerprint, user_id)

    def _claim(self, tenant_id: str, key: str, fingerprint: str,
               user_id: str | None) -> tuple[str, tuple[int, str, bytes] | None]:
        now = utcnow()
        with self.tx() as s:
            row = s.get(IdempotencyRow, (tenant_id, key))
            stale = row is not None and (now - row.created_at > IDEMPOTENCY_TTL
                                         or (row.status is None and now - row.created_at > IDEMPOTENCY_RUN_TIMEOUT))
            if stale:
                s.delete(row)
                s.flush()
                row = None
            if row is None:
                claim = IdempotencyRow(tenant_id=tenant_id, key=key, fingerprint=fingerprint,
                                       user_id=user_id if user_id and len(user_id) <= NAME_CHARS else None)
                if _add_once(s, claim):
                    return "new", None
                row = s.get(IdempotencyRow, (tenant_id, key))
            if row.fingerprint != fingerprint:
                return "mismatch", None
            if row.status is None:
                return "busy", None
            return "done", (row.status, row.content_type or "application/json", bytes(row.body or b""))

    def finish_idempotency_key(self, tenant_id: str, key: str, status: int, content_type: str, body: bytes) -> None:
        with self.tx() as s:
            row = s.get(IdempotencyRow, (tenant_id, key))
            if row is not None:
                row.status, row.content_type, row.body = status, content_type, body

    def release_idempotency_key(self, tenant_id: str, key: str) -> None:
        with self.tx() as s:
            s.execute(delete(IdempotencyRow).where(IdempotencyRow.tenant_id == tenant_id, IdempotencyRow.key == key,
                                                   IdempotencyRow.status.is_(None)))

    # --- users and sessions -----------------------------------------------------------------
    def ensure_user(self, tenant_id: str, user_id: str) -> None:
        with self.tx() as s:
            self._user_in(s, tenant_id, user_id)

    def _user_in(self, s: Session, tenant_id: str, user_id: str, create: bool = True) -> str:
        """The user inside a write's own transaction, so that a write that fails leaves no
        user (or tenant) behind. `create=False` (background work such as reflection) never
        brings back a user deleted meanwhile."""
        user_id = clean_text(user_id, "user_id")
        self._hold(s, tenant_id, user_id)
        if s.get(UserRow, (tenant_id, user_id)) is not None:
            return user_id  # a user stored before ids were checked stays usable (tenant fix-ids)
        if not create:
            raise NotFound(f"user {user_id!r} not found")
        check_id(user_id, "user_id")
        self._tenant_in(s, _scope_id(tenant_id, "tenant_id"))
        _add_once(s, UserRow(tenant_id=tenant_id, id=user_id))
        return user_id

    def _hold(self, s: Session, tenant_id: str, user_id: str) -> None:
        """Before a write checks that its user (or tenant) is there: hold what a deletion needs,
        so the check and the write are one step against a concurrent delete. Otherwise a
        delete committed between them leaves the write's rows behind, orphans of a deleted
        user or tenant. SQLite: take the write lock now (a write statement that changes
        nothing), so what the check reads is the newest state and no deletion commits before
        this transaction does. PostgreSQL: share-lock the tenant and user rows, which a
        deletion locks for update first; its deletes then see this write's rows."""
        if s.bind.dialect.name == "sqlite":
            s.execute(text("UPDATE tenants SET id = id WHERE 0"))
            return
        s.execute(select(TenantRow.id).where(TenantRow.id == tenant_id).with_for_update(read=True))
        s.execute(select(UserRow.id).where(UserRow.tenant_id == tenant_id, UserRow.id == user_id)
                  .with_for_update(read=True))

    def user_exists(self, tenant_id: str, user_id: str) -> bool:
        with self.tx() as s:
            return s.get(UserRow, (tenant_id, user_id)) is not None

    def list_users(self, tenant_id: str, after: str | None = None, limit: int | None = None) -> list[R.User]:
        """By id; `after`/`limit`: the page of at most `limit` users with ids after `after`."""
        q = select(UserRow).where(UserRow.tenant_id == tenant_id)
        if after is not None:
            q = q.where(UserRow.id > after)
        with self.tx() as s:
            rows = s.scalars(q.order_by(UserRow.id).limit(limit))
            return [R.User(id=r.id, tenant_id=r.tenant_id, created_at=from_db_time(r.created_at)) for r in rows]

    def delete_user(self, tenant_id: str, user_id: str) -> None:
        with self.tx() as s:
            if s.get(UserRow, (tenant_id, user_id), with_for_update=True) is None:  # writers wait (_hold)
                raise NotFound(f"user {user_id!r} not found")
            for table in (*_USER_TABLES, IdempotencyRow):
                s.execute(delete(table).where(table.tenant_id == tenant_id, table.user_id == user_id))
            s.execute(delete(UserRow).where(UserRow.tenant_id == tenant_id, UserRow.id == user_id))
        self._scrub()

    def _scrub(self) -> None:
        """After a deletion, leave no copy of the deleted text in the files: full-text index
        segments still holding it are merged away, and the WAL (where the rows' last
        versions live) is checkpointed into the database (whose freed bytes `secure_delete`
        zeroed) and truncated. PostgreSQL: its own VACUUM reclaims dead tuples."""
        if self.engine.dialect.name != "sqlite" or self._current.get() is not None:
            return
        self.purge_fulltext()
        with self.engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")

    def open_session(self, tenant_id: str, user_id: str, session_id: str | None = None,
                     agent_id: str = "default") -> R.SessionInfo:
        """Resume `session_id` (it must be this user's) or start a new one."""
        if session_id is not None:
            session_id = clean_text(session_id, "session_id")
        with self.tx() as s:
            self._user_in(s, tenant_id, user_id)
            if session_id is not None:
                row = s.get(SessionRow, (tenant_id, user_id, session_id))
                if row is not None:
                    return self._session_info(s, row)
                check_id(session_id, "session_id")
            row = SessionRow(id=session_id or uuid.uuid4().hex, tenant_id=tenant_id,
                             user_id=user_id, agent_id=agent_id)
            s.add(row)
            s.flush()
            return self._session_info(s, row)

    def session_tail(self, tenant_id: str, user_id: str, session_id: str, after_id: int) -> tuple[int, int] | None:
        """(how many, newest id) of a session's messages after `after_id`, from the index on
        (session_id, id), so it costs what follows `after_id`, not the whole session; None
        when the session does not exist (its user was deleted)."""
        with self.tx() as s:
            if s.get(SessionRow, (tenant_id, user_id, session_id)) is None:
                return None
            n, top = s.execute(select(func.count(), func.max(MessageRow.id)).where(
                MessageRow.session_id == session_id, MessageRow.id > after_id,
                MessageRow.tenant_id == tenant_id, MessageRow.user_id == user_id)).one()
            return int(n or 0), int(top or 0)

    def list_sessions(self, tenant_id: str, user_id: str, after: tuple[datetime, str] | None = None,
                      limit: int | None = None) -> list[R.SessionInfo]:
        """By (created_at, id); `after`: the page after that (created_at, id), at most `limit`.
        The page's message counts come from one grouped count."""
        q = select(SessionRow).where(SessionRow.tenant_id == tenant_id, SessionRow.user_id == user_id)
        if after is not None:
            at, sid = to_db_time(after[0]), after[1]
            q = q.where((SessionRow.created_at > at) | ((SessionRow.created_at == at) & (SessionRow.id > sid)))
        with self.tx() as s:
            rows = list(s.scalars(q.order_by(SessionRow.created_at, SessionRow.id).limit(limit)))
            counts: dict[str, int] = {}
            ids = [r.id for r in rows]
            for i in range(0, len(ids), 500):
                counts.update(s.execute(select(MessageRow.session_id, func.count()).where(
                    MessageRow.tenant_id == tenant_id, MessageRow.user_id == user_id,
                    MessageRow.session_id.in_(ids[i:i + 500])).group_by(MessageRow.session_id)).all())
            return [R.SessionInfo(id=r.id, user_id=r.user_id, agent_id=r.agent_id, created_at=from_db_time(r.created_at),
                                  message_count=int(counts.get(r.id, 0))) for r in rows]

    def latest_session(self, tenant_id: str, user_id: str, prefer: str | None = None) -> str | None:
        """`prefer` when the user has that session, else the newest one's id: one indexed
        lookup, where `list_sessions` counts every session's messages."""
        with self.tx() as s:
            if prefer is not None and s.get(SessionRow, (tenant_id, user_id, prefer)) is not None:
                return prefer
            return s.scalar(select(SessionRow.id).where(SessionRow.tenant_id == tenant_id, SessionRow.user_id == user_id)
                            .order_by(SessionRow.created_at.desc(), SessionRow.id.desc()).limit(1))

    def _session_info(self, s: Session, row: SessionRow) -> R.SessionInfo:
        n = s.scalar(select(func.count()).select_from(MessageRow).where(
            MessageRow.tenant_id == row.tenant_id, MessageRow.user_id == row.user_id, MessageRow.session_id == row.id))
        return R.SessionInfo(id=row.id, user_id=row.user_id, agent_id=row.agent_id,
                             created_at=from_db_time(row.created_at), message_count=int(n or 0))

    def _check_session(self, s: Session, tenant_id: str, user_id: str, session_id: str) -> None:
        if s.get(SessionRow, (tenant_id, user_id, session_id)) is None:
            raise NotFound(f"session {session_id!r} not found")

    # --- messages ----------------------------------------------------------------------------
    def append_messages(self, tenant_id: str, user_id: str, session_id: str, messages: Iterable[dict]) -> list[R.Message]:
        """Store messages in one transaction; committed when this returns (durable first)."""
        rows, extras = [], []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InvalidInput(f"message {i} must be a dict with 'role' and 'content'")
            role = m.get("role")
            if role not in ROLES:
                raise InvalidInput(f"message {i}: role must be one of {ROLES}, got {role!r}")
            text = clean_text(message_text(m.get("content", m.get("text"))), f"message {i} content")
            created = _as_time(m.get("created_at"), f"message {i} created_at")
            name = m.get("name", m.get("speaker"))
            if name is not None:
                name = _scope_id(name, f"message {i} name")
            rows.append(MessageRow(tenant_id=tenant_id, user_id=user_id, session_id=session_id, role=role, text=text,
                                   created_at=to_db_time(created) or utcnow(), name=name,
                                   event_time=to_db_time(_as_time(m.get("event_time"), f"message {i} event_time"))))
            extras.append(attachment_text(m, f"message {i}"))
        for row, extra in zip(rows, extras, strict=True):
            row.keys = extra or None
        unnamed = bool(rows) and all(row.name is None for row in rows)
        if unnamed:  # a transcript flattened to role/content
            for row, name in zip(rows, transcript_speakers([row.text for row in rows]), strict=True):
                row.name = name
        with self.tx() as s:
            self._hold(s, tenant_id, user_id)
            self._check_session(s, tenant_id, user_id, session_id)
            if unnamed and all(row.name is None for row in rows):
                self._known_prefixes(s, tenant_id, user_id, rows)
            s.add_all(rows)
            s.flush()
            return [_message(r) for r in rows]

    @staticmethod
    def _known_prefixes(s: Session, tenant_id: str, user_id: str, rows: list[MessageRow]) -> None:
        """A batch too small (or too mixed) to read as a transcript by itself, such as a
        flattened transcript imported one message at a time: a "Name: " prefix names its
        speaker when this user already has messages by that name (from an earlier transcript
        batch or a `name` field); "Paris: day 3" stays text."""
        names = [prefix_name(row.text) for row in rows]
        known = {n for n in set(names) - {None} if s.scalar(select(MessageRow.id).where(
            MessageRow.tenant_id == tenant_id, MessageRow.user_id == user_id, MessageRow.name == n).limit(1))
            is not None}
        for row, name in zip(rows, names, strict=True):
            if name in known:
                row.name = name

    def messages(self, tenant_id: str, user_id: str, session_id: str | None = None, after_id: int = 0,
                 ids: Iterable[int] | None = None, limit: int | None = None) -> list[R.Message]:
        q = select(MessageRow).where(MessageRow.tenant_id == tenant_id, MessageRow.user_id == user_id,
                                     MessageRow.id > after_id)
        if session_id is not None:
            q = q.where(MessageRow.session_id == session_id)
        if ids is not None:
            q = q.where(MessageRow.id.in_(list(ids)))
        with self.tx() as s:
            if session_id is not None:
                self._check_session(s, tenant_id, user_id, session_id)
            return [_message(r) for r in s.scalars(q.order_by(MessageRow.id).limit(limit))]

    def iter_messages(self, tenant_id: str, user_id: str, after_id: int = 0,
                      batch: int = 2000) -> Iterator[list[R.Message]]:
        """The user's messages after `after_id`, oldest first, a bounded batch at a time."""
        while True:
            with self.tx() as s:
                rows = [_message(r) for r in s.scalars(
                    select(MessageRow).where(MessageRow.tenant_id == tenant_id, MessageRow.user_id == user_id,
                                             MessageRow.id > after_id).order_by(MessageRow.id).limit(batch))]
            if not rows:
                return
            yield rows
            after_id = rows[-1].id

    def message_ids(self, tenant_id: str, user_id: str) -> list[int]:
        with self.tx() as s:
            return list(s.scalars(select(MessageRow.id).where(MessageRow.tenant_id == tenant_id,
                                                               MessageRow.user_id == user_id)))

    def message_stats(self, tenant_id: str, user_id: str) -> tuple[int, int]:
        """(count, newest id) of the user's messages. The count reads every row of the user's
        index entries: the recall index checks it only now and then (`message_bounds` on
        every use)."""
        with self.tx() as s:
            n, top = s.execute(select(func.count(), func.max(MessageRow.id)).where(
                MessageRow.tenant_id == tenant_id, MessageRow.user_id == user_id)).one()
            return int(n or 0), int(top or 0)

    def message_bounds(self, tenant_id: str, user_id: str, after_id: int) -> tuple[int, int, int]:
        """(oldest id, newest id, how many after `after_id`) of the user's messages: each a
        walk down the index on (tenant, user, id) to one end or over the ids after `after_id`,
        so the cost does not grow with the history (0, 0, 0: none)."""
        scope = (MessageRow.tenant_id == tenant_id, MessageRow.user_id == user_id)
        # one statement of three scalar subqueries, each planned as it was alone (SQLite's
        # min/max walk to one end of the index, PostgreSQL's index-only scans): every search
        # asks this, and on PostgreSQL each statement is a round trip
        q = select(select(func.min(MessageRow.id)).where(*scope).scalar_subquery(),
                   select(func.max(MessageRow.id)).where(*scope).scalar_subquery(),
                   select(func.count()).select_from(MessageRow).where(*scope, MessageRow.id > after_id)
                   .scalar_subquery())
        with self.tx() as s:
            low, top, recent = s.execute(q).one()
            return int(low or 0), int(top or 0), int(recent or 0)

    def message_meta(self, tenant_id: str, user_id: str, ids: Iterable[int]) -> dict[int, MessageMeta]:
        """What ranking needs of candidate messages (no text): session, role, speaker, time."""
        ids = list(ids)
        if not ids:
            return {}
        with self.tx() as s:
            rows = s.execute(select(MessageRow.id, MessageRow.session_id, MessageRow.role, MessageRow.name,
                                    MessageRow.created_at, MessageRow.event_time)
                             .where(MessageRow.tenant_id == tenant_id, MessageRow.user_id == user_id,
                                    MessageRow.id.in_(ids)))
            return {int(i): MessageMeta(int(i), sid, role, name, from_db_time(ev or cr))
                    for i, sid, role, name, cr, ev in rows}

    def turns_before(self, tenant_id: str, user_id: str, first: dict[str, int]) -> dict[str, R.Message]:
        """For each session id, the message just before message id `first[session]` in it."""
        near = self.neighbours(tenant_id, user_id, [(before, sid, -1) for sid, before in first.items()])
        return {sid: near[before] for sid, before in first.items() if before in near}

    def neighbour_ids(self, tenant_id: str, user_id: str, wanted: Iterable[tuple[int, str, int]]
                      ) -> dict[tuple[int, int], int]:
        """For each (message id, session id, step): the id of the message just before it in its
        session (step -1) or just after it (step +1), keyed (message id, step); one statement for
        all of them, a scalar subquery each that walks the index from the message and stops at
        the first row of its session (ORDER BY .. LIMIT 1: SQLite's max() with a WHERE read every
        earlier row). Written as SQL text: SQLAlchemy compiling 40 subqueries took 6 ms against
        their 2.5 to run (10,000 messages, SQLite)."""
        wanted = list(dict.fromkeys(wanted))
        out: dict[tuple[int, int], int] = {}
        table = MessageRow.__tablename__
        for i in range(0, len(wanted), NEIGHBOUR_BATCH):
            part = wanted[i:i + NEIGHBOUR_BATCH]
            params: dict[str, object] = {"t": tenant_id, "u": user_id}
            arms = []
            for j, (mid, session_id, step) in enumerate(part):
                params[f"s{j}"], params[f"m{j}"] = session_id, int(mid)
                op, order = ("<", "DESC") if step < 0 else (">", "ASC")
                arms.append(f"SELECT {j} AS j, (SELECT id FROM {table} WHERE tenant_id = :t AND user_id = :u"
                            f" AND session_id = :s{j} AND id {op} :m{j} ORDER BY id {order} LIMIT 1) AS n")
            with self.tx() as s:
                rows = s.execute(text(" UNION ALL ".join(arms)), params).all()
            for j, n in rows:
                if n is not None:
                    mid, _sid, step = part[j]
                    out[(mid, step)] = int(n)
        return out

    def neighbours(self, tenant_id: str, user_id: str, wanted: Iterable[tuple[int, str, int]]) -> dict[int, R.Message]:
        """For each (message id, session id, step): the message just before it in its session
        (step -1: the turn it answers) or just after it (step +1: the turn that answers it).
        Two queries whatever the count (`neighbour_ids`, then the rows)."""
        near = self.neighbour_ids(tenant_id, user_id, wanted)
        rows = {m.id: m for m in self.messages(tenant_id, user_id, ids=sorted(set(near.values())))} if near else {}
        return {mid: rows[n] for (mid, _step), n in near.items() if n in rows}

    def lexical_search(self, tenant_id: str, user_id: str, terms: list[str], limit: int = 50,
                       exclude: Iterable[int] = (), since: datetime | None = None,
                       until: datetime | None = None, what: str = "messages",
                       speakers: list[str] | None = None, rows: int | None = None) -> list[tuple[int, float]]:
        """(id, score) of messages (or active memories, `what="memories"`) from the database's
        own full-text index, best first: FTS5's bm25 on SQLite, bm25 computed over the GIN
        index's matches on PostgreSQL. `terms` are plain words (`query.content_terms`); any of
        them may match. `speakers`: only messages by these names (None: anyone's). `rows`: how
        many the user has, where the caller knows (PostgreSQL's idf; else counted)."""
        if what not in ("messages", "memories"):
            raise ValueError(f"what must be 'messages' or 'memories', got {what!r}")
        with self.tx() as s:
            return lexical.search(s, tenant_id, user_id, terms, limit, list(exclude), to_db_time(since),
                                  to_db_time(until), what, speakers, rows)

    def purge_fulltext(self) -> None:
        """Merge the full-text indexes so deleted rows' terms leave their pages (SQLite keeps
        them in older segments until a merge); PostgreSQL's GIN drops them with the row."""
        if self.engine.dialect.name == "sqlite":
            with self.engine.begin() as c:
                have = {r[0] for r in c.execute(text("SELECT name FROM sqlite_master WHERE type = 'table'"))}
                for fts in lexical.SQLITE_DDL:
                    if fts in have:
                        c.execute(text(f"INSERT INTO {fts}({fts}) VALUES ('optimize')"))

    def set_message_compressed(self, tenant_id: str, user_id: str, texts: dict[int, str]) -> None:
        """Store the compressed text of messages (id -> text), once, in one transaction."""
        with self.tx() as s:
            rows = s.scalars(select(MessageRow).where(MessageRow.tenant_id == tenant_id, MessageRow.user_id == user_id,
                                                      MessageRow.id.in_(list(texts))))
            for row in rows:
                row.compressed_text = clean_text(texts[row.id], "compressed text")

    # --- memories ----------------------------------------------------------------------------
    def add_memory(self, tenant_id: str, user_id: str, text: str, importance: float = 0.5,
                   source_ids: Iterable[int] = (), kind: str = "fact", event_time: datetime | None = None,
                   compressed_text: str | None = None, create_user: bool = True) -> R.Memory:
        with self.tx() as s:
            self._user_in(s, tenant_id, user_id, create_user)
            row = self._memory_new(tenant_id, user_id, text, importance, source_ids, kind, event_time,
                                   compressed_text)
            s.add(row)
            s.flush()
            return _memory(row)

    @staticmethod
    def _memory_new(tenant_id: str, user_id: str, text: str, importance, source_ids: Iterable[int], kind: str,
                    event_time, compressed_text: str | None) -> MemoryRow:
        """A validated memory row (nothing is written)."""
        kind = _scope_id(kind, "kind", KIND_CHARS)
        if compressed_text is not None:
            compressed_text = clean_text(compressed_text, "compressed text")
        try:
            sources = [int(i) for i in source_ids]
        except (TypeError, ValueError, OverflowError):
            raise InvalidInput("source_ids must be message ids") from None
        return MemoryRow(tenant_id=tenant_id, user_id=user_id, kind=kind, text=clean_text(text, "memory text"),
                         compressed_text=compressed_text, importance=_importance(importance), status="active",
                         source_ids=sources, event_time=to_db_time(_as_time(event_time, "event_time")))

    def list_memories(self, tenant_id: str, user_id: str, status: str | None = None,
                      kind: str | None = None, after_id: int = 0, limit: int | None = None) -> list[R.Memory]:
        if status is not None and status not in MEMORY_STATUSES:
            raise InvalidInput(f"status must be one of {MEMORY_STATUSES}, got {status!r}")
        q = select(MemoryRow).where(MemoryRow.tenant_id == tenant_id, MemoryRow.user_id == user_id,
                                    MemoryRow.id > after_id)
        if status is not None:
            q = q.where(MemoryRow.status == status)
        if kind is not None:
            q = q.where(MemoryRow.kind == kind)
        with self.tx() as s:
            return [_memory(r) for r in s.scalars(q.order_by(MemoryRow.id).limit(limit))]

    def get_memory(self, tenant_id: str, user_id: str, memory_id: int) -> R.Memory:
        with self.tx() as s:
            return _memory(self._memory_row(s, tenant_id, user_id, memory_id))

    def update_memory(self, tenant_id: str, user_id: str, memory_id: int, text: str | None = None, *,
                      compressed_text: str | None = None, importance: float | None = None,
                      status: str | None = None, superseded_by: int | None = None) -> R.Memory:
        """Change a memory. A new `text` drops the stale `compressed_text` unless one is given."""
        with self.tx() as s:
            row = self._memory_row(s, tenant_id, user_id, memory_id)
            if text is not None:
                row.text = clean_text(text, "memory text")
                row.compressed_text = None
            if compressed_text is not None:
                row.compressed_text = clean_text(compressed_text, "compressed text")
            if importance is not None:
                row.importance = _importance(importance)
            if status is not None:
                if status not in MEMORY_STATUSES:
                    raise InvalidInput(f"status must be one of {MEMORY_STATUSES}, got {status!r}")
                row.status = status
            if superseded_by is not None:
                self._memory_row(s, tenant_id, user_id, superseded_by)
                row.superseded_by, row.status = superseded_by, "superseded"
            row.updated_at = utcnow()
            s.flush()
            return _memory(row)

    def delete_memory(self, tenant_id: str, user_id: str, memory_id: int) -> None:
        with self.tx() as s:
            s.delete(self._memory_row(s, tenant_id, user_id, memory_id))
        self._scrub()

    def memory_versions(self, tenant_id: str, user_id: str) -> dict[int, datetime]:
        """id -> updated_at of every memory: what the recall index checks its freshness against."""
        with self.tx() as s:
            rows = s.execute(select(MemoryRow.id, MemoryRow.updated_at).where(MemoryRow.tenant_id == tenant_id,
                                                                              MemoryRow.user_id == user_id))
            return {int(i): t for i, t in rows}

    def memories_by_id(self, tenant_id: str, user_id: str, ids: Iterable[int]) -> dict[int, R.Memory]:
        with self.tx() as s:
            q = select(MemoryRow).where(MemoryRow.tenant_id == tenant_id, MemoryRow.user_id == user_id,
                                        MemoryRow.id.in_(list(ids)))
            return {r.id: _memory(r) for r in s.scalars(q)}

    def _memory_row(self, s: Session, tenant_id: str, user_id: str, memory_id) -> MemoryRow:
        try:
            memory_id = int(memory_id)
        except (TypeError, ValueError):
            raise NotFound(f"memory {memory_id!r} not found") from None
        row = s.get(MemoryRow, memory_id)
        if row is None or (row.tenant_id, row.user_id) != (tenant_id, user_id):
            raise NotFound(f"memory {memory_id!r} not found")
        return row

    # --- core memory blocks ------------------------------------------------------------------
    def core_blocks(self, tenant_id: str, user_id: str, after: str | None = None,
                    limit: int | None = None) -> list[R.CoreBlock]:
        q = select(CoreBlockRow).where(CoreBlockRow.tenant_id == tenant_id, CoreBlockRow.user_id == user_id)
        if after is not None:
            q = q.where(CoreBlockRow.label > after)
        with self.tx() as s:
            rows = s.scalars(q.order_by(CoreBlockRow.label).limit(limit))
            return [R.CoreBlock(label=r.label, value=r.value, limit=r.char_limit, updated_at=from_db_time(r.updated_at),
                                version=r.version) for r in rows]

    def set_core_block(self, tenant_id: str, user_id: str, label: str, value: str,
                       limit: int | None = None, create_user: bool = True,
                       expected_version: int | None = None) -> R.CoreBlock:
        """Set a block's value, keeping the old one in the edit history. Over the block's
        size limit is an error, not a silent cut: the caller decides what to drop.
        `expected_version` (0: the block must not exist yet) makes the edit conditional on
        the version the caller read; a concurrent edit in between (another replica) raises
        `Conflict` then, and without it the edit is applied again on top of the other one:
        never silently lost."""
        try:
            with self.tx() as s:
                self._user_in(s, tenant_id, user_id, create_user)
                return self._set_block_in(s, tenant_id, user_id, label, value, limit, expected_version)
        except (StaleDataError, IntegrityError):
            if expected_version is not None:
                raise Conflict(f"block {label!r} was changed by another writer; read it again") from None
            with self.tx() as s:
                self._user_in(s, tenant_id, user_id, create_user)
                return self._set_block_in(s, tenant_id, user_id, label, value, limit)

    def _set_block_in(self, s: Session, tenant_id: str, user_id: str, label: str, value: str,
                      limit: int | None, expected_version: int | None = None) -> R.CoreBlock:
        label = clean_text(label, "block label")
        if len(label) > LABEL_CHARS or not label.replace("_", "").replace("-", "").isalnum():
            raise InvalidInput(f"block label must be up to {LABEL_CHARS} letters, digits, '_' or '-', got {label!r}")
        value = clean_text(value, "block value", allow_empty=True)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or not 1 <= limit <= MAX_BLOCK_LIMIT):
            raise InvalidInput(f"block limit must be an integer in [1, {MAX_BLOCK_LIMIT}], got {limit!r}")
        row = s.get(CoreBlockRow, (tenant_id, user_id, label))
        current = row.version if row is not None else 0
        if expected_version is not None and expected_version != current:
            raise Conflict(f"block {label!r} is at version {current}, not {expected_version}; read it again")
        if row is None:
            row = CoreBlockRow(tenant_id=tenant_id, user_id=user_id, label=label, value="",
                               char_limit=limit or DEFAULT_BLOCK_LIMIT)
            s.add(row)
        if limit is not None:
            row.char_limit = int(limit)
        if len(value) > row.char_limit:
            raise InvalidInput(f"block {label!r} is limited to {row.char_limit} characters, got {len(value)}")
        if value != row.value:
            s.add(CoreBlockEditRow(tenant_id=tenant_id, user_id=user_id, label=label, old_value=row.value,
                                   new_value=value))
            row.value, row.updated_at = value, utcnow()
        s.flush()
        return R.CoreBlock(label=row.label, value=row.value, limit=row.char_limit,
                           updated_at=from_db_time(row.updated_at), version=row.version)

    def core_block_history(self, tenant_id: str, user_id: str, label: str | None = None) -> list[R.CoreBlockEdit]:
        q = select(CoreBlockEditRow).where(CoreBlockEditRow.tenant_id == tenant_id, CoreBlockEditRow.user_id == user_id)
        if label is not None:
            q = q.where(CoreBlockEditRow.label == label)
        with self.tx() as s:
            return [R.CoreBlockEdit(id=r.id, label=r.label, old_value=r.old_value, new_value=r.new_value,
                                    created_at=from_db_time(r.created_at))
                    for r in s.scalars(q.order_by(CoreBlockEditRow.id))]

    # --- summaries and turns -----------------------------------------------------------------
    def latest_summary(self, tenant_id: str, user_id: str, session_id: str) -> R.Summary | None:
        with self.tx() as s:
            row = s.scalars(select(SummaryRow).where(SummaryRow.tenant_id == tenant_id, SummaryRow.user_id == user_id,
                                                     SummaryRow.session_id == session_id)
                            .order_by(SummaryRow.id.desc()).limit(1)).first()
            return None if row is None else _summary(row)

    def save_summary(self, tenant_id: str, user_id: str, session_id: str, text: str, upto_message_id: int) -> R.Summary:
        with self.tx() as s:
            self._hold(s, tenant_id, user_id)
            self._check_session(s, tenant_id, user_id, session_id)
            row = SummaryRow(tenant_id=tenant_id, user_id=user_id, session_id=session_id, text=text,
                             upto_message_id=upto_message_id)
            s.add(row)
            s.flush()
            return _summary(row)

    def record_turn(self, tenant_id: str, user_id: str, session_id: str, trace: dict) -> R.Turn:
        with self.tx() as s:
            self._hold(s, tenant_id, user_id)  # a turn that ends after its user was deleted stores nothing
            self._check_session(s, tenant_id, user_id, session_id)
            row = TurnRow(tenant_id=tenant_id, user_id=user_id, session_id=session_id, trace=trace)
            s.add(row)
            s.flush()
            return R.Turn(id=row.id, session_id=row.session_id, trace=row.trace, created_at=from_db_time(row.created_at))

    def looped_replies(self, tenant_id: str, user_id: str) -> set[int]:
        """Ids of the user's stored replies that the engine's loop detector cut (their turn's
        finish_reason is "repetition"): recall ranks them lower."""
        return self.looped_since(tenant_id, user_id)[0]

    def looped_since(self, tenant_id: str, user_id: str, after_turn: int = 0) -> tuple[set[int], int]:
        """`looped_replies` for the turns recorded after turn id `after_turn`, and the newest
        turn id seen: recall keeps the set and asks only for what is new."""
        reason = TurnRow.trace[("stats", "finish_reason")].as_string()
        scope = (TurnRow.tenant_id == tenant_id, TurnRow.user_id == user_id, TurnRow.id > after_turn)
        with self.tx() as s:
            top = s.scalar(select(func.max(TurnRow.id)).where(*scope))
            if top is None:
                return set(), after_turn
            traces = s.scalars(select(TurnRow.trace).where(*scope, TurnRow.id <= top, reason == "repetition"))
            return {t["message_ids"][-1] for t in traces if len(t.get("message_ids", [])) > 1}, int(top)

    def turns(self, tenant_id: str, user_id: str, session_id: str | None = None, limit: int = 50,
              before_id: int | None = None) -> list[R.Turn]:
        """The newest `limit` turns (before turn `before_id` if given), oldest first."""
        q = select(TurnRow).where(TurnRow.tenant_id == tenant_id, TurnRow.user_id == user_id)
        if before_id is not None:
            q = q.where(TurnRow.id < before_id)
        if session_id is not None:
            q = q.where(TurnRow.session_id == session_id)
        with self.tx() as s:
            rows = list(s.scalars(q.order_by(TurnRow.id.desc()).limit(limit)))
            return [R.Turn(id=r.id, session_id=r.session_id, trace=r.trace, created_at=from_db_time(r.created_at)) for r in reversed(rows)]


def _sqlite_pragmas(dbapi_conn, sync: str) -> None:
    """WAL; `secure_delete` zeroes deleted rows' bytes so a forgotten user's words do not
    stay in free pages (the WAL is checkpointed after each deletion, see `_scrub`)."""
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA synchronous={sync.upper()}")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA secure_delete=ON")
    cur.close()


def _private_file(db: str | None) -> None:
    """Create the SQLite file 0600 before SQLite does (its -wal and -shm files take the
    database file's mode)."""
    if not db or db == ":memory:" or db.startswith("file:"):
        return
    fd = os.open(db, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    os.chmod(db, 0o600)


def _as_time(value, what: str) -> datetime | None:
    """A datetime, an ISO-8601 string, unix seconds, or a date with its month in words and its
    year ("1:56 pm on 8 May, 2023", as conversation datasets write them); naive times are UTC."""
    if value is None or isinstance(value, datetime):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, UTC)
        except (OverflowError, OSError, ValueError):
            raise InvalidInput(f"{what} is out of range as unix seconds: {value!r}") from None
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            pass
        if len(value) <= 100 and (got := parse_timestamp(value)) is not None:
            return got
        raise InvalidInput(f"{what} is not a time (ISO-8601, unix seconds, or a date with its month in words and "
                           f"its year): {value!r}")
    raise InvalidInput(f"{what} must be a datetime, an ISO-8601 string or unix seconds")


def _importance(value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise InvalidInput(f"importance must be a number in [0, 1], got {value!r}") from None
    if not 0.0 <= value <= 1.0:
        raise InvalidInput(f"importance must be in [0, 1], got {value}")
    return value


def _message(r: MessageRow) -> R.Message:
    return R.Message(id=r.id, session_id=r.session_id, role=r.role, text=r.text,
                     created_at=from_db_time(r.created_at), event_time=from_db_time(r.event_time),
                     compressed_text=r.compressed_text, name=r.name, keys=r.keys)


def _memory(r: MemoryRow) -> R.Memory:
    return R.Memory(id=r.id, user_id=r.user_id, kind=r.kind, text=r.text, compressed_text=r.compressed_text,
                    importance=r.importance, status=r.status, superseded_by=r.superseded_by,
                    source_ids=list(r.source_ids or []), event_time=from_db_time(r.event_time),
                    created_at=from_db_time(r.created_at), updated_at=from_db_time(r.updated_at))


def _summary(r: SummaryRow) -> R.Summary:
    return R.Summary(id=r.id, session_id=r.session_id, text=r.text, upto_message_id=r.upto_message_id,
                     created_at=from_db_time(r.created_at))


def _add_once(s: Session, row) -> bool:
    """Add a row that a concurrent transaction may be adding too (the first write of a new
    user from two requests); whether this one added it. On PostgreSQL the loser's unique
    violation is absorbed in a savepoint; SQLite serialises writers, so there is no such
    race there."""
    if s.bind.dialect.name != "postgresql":
        s.add(row)
        s.flush()
        return True
    try:
        with s.begin_nested():
            s.add(row)
    except IntegrityError:
        return False
    return True
