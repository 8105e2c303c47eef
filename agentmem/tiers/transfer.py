"""A user's memory as one JSON document, out and back in: a faithful, idempotent round trip.

`export_doc` writes sessions, messages, memories and core blocks with their ids, texts and
times. `import_doc` reads such a document back:

- validated whole before any work: `ExportDoc` (version, types, id ranges, unique ids,
  every reference to a session, message or memory inside the document), with count limits
  read first, so an oversized document is refused before its rows are looked at;
- faithful: session ids, every text and every time (`created_at`, `updated_at`,
  `event_time`) are kept. Row ids are kept too where they are free in this database; where
  any is taken (the same document imported under another user of the same database) that
  table's rows get new ids, in the document's order, and every reference (memory sources,
  supersession) follows. The ids that changed are returned (`id_map`);
- idempotent: a session that already holds the document's messages is left as it is (one
  that holds them and then more, or other ones, is a conflict), a memory already present
  (same kind, text and creation time) is matched rather than added, a core block with the
  same value is not rewritten. Importing a document twice changes nothing the second time;
- atomic: one transaction, all of it or nothing.

The core block's `version` (an optimistic-concurrency token of this database) is not part of
the document: a block starts at its first version wherever it is imported.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from sqlalchemy import func, select

from . import ids as row_ids
from . import records as R
from .schema import (
    CoreBlockEditRow,
    CoreBlockRow,
    MemoryRow,
    MessageRow,
    SessionRow,
    from_db_time,
    to_db_time,
    utcnow,
)
from .scope import check_id
from .sizes import KIND_CHARS, LABEL_CHARS, MAX_BLOCK_LIMIT, NAME_CHARS

EXPORT_VERSION = 1
RowId = Annotated[StrictInt, Field(ge=1, le=2**63 - 1)]


def _clean(value: str) -> str:
    from .archive import clean_text

    return clean_text(value, "text", allow_empty=True)  # a lone surrogate or a NUL: refused


Text = Annotated[StrictStr, AfterValidator(_clean)]  # every text of the document is checked


def _storable_time(t: datetime) -> datetime:
    to_db_time(t)  # InvalidInput (a ValueError) when its UTC form is out of range: the error names the field
    return t


Time = Annotated[datetime, AfterValidator(_storable_time)]


class DocSession(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: Text
    agent_id: Text = Field("default", max_length=NAME_CHARS)
    created_at: Time


class DocMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: RowId
    session_id: Text
    role: Literal["system", "user", "assistant", "tool"]
    text: Text
    created_at: Time
    event_time: Time | None = None
    compressed_text: Text | None = None
    name: Text | None = Field(None, max_length=NAME_CHARS)
    keys: Text | None = None


class DocMemory(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: RowId
    kind: Text = Field("fact", min_length=1, max_length=KIND_CHARS)
    text: Text = Field(min_length=1)
    compressed_text: Text | None = None
    importance: float = Field(0.5, ge=0.0, le=1.0)
    status: Literal["active", "superseded"] = "active"
    superseded_by: RowId | None = None
    source_ids: list[RowId] = []
    event_time: Time | None = None
    created_at: Time
    updated_at: Time | None = None


class DocBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    label: Text = Field(min_length=1, max_length=LABEL_CHARS, pattern=r"^[A-Za-z0-9_-]+$")
    value: Text
    limit: StrictInt = Field(2000, ge=1, le=MAX_BLOCK_LIMIT)
    updated_at: Time | None = None


class ExportDoc(BaseModel):
    model_config = ConfigDict(extra="ignore")
    version: Literal[1]
    user_id: Text | None = None
    sessions: list[DocSession]
    messages: list[DocMessage]
    memories: list[DocMemory]
    core_blocks: list[DocBlock]


COUNTED = ("sessions", "messages", "memories", "core_blocks")


def check_counts(doc: object, limits: dict[str, int]) -> None:
    """The cheap checks, before any row is read: an object of this version with every list
    present, none longer than its limit (InvalidInput naming the first that is)."""
    if not isinstance(doc, dict):
        raise R.InvalidInput("an export document is a JSON object")
    if doc.get("version") != EXPORT_VERSION:
        raise _bad(f"not an agentmem export (version {EXPORT_VERSION}), got version {doc.get('version')!r}",
                   "version")
    for key in COUNTED:
        if not isinstance(doc.get(key), list):
            raise _bad(f"{key} must be a list (an export has sessions, messages, memories and core_blocks)", key)
        if key in limits and len(doc[key]) > limits[key]:
            raise _bad(f"{key} has {len(doc[key])} entries; an import takes at most {limits[key]}", key,
                       "import_too_large")


class InvalidExport(R.InvalidInput):
    def __init__(self, message: str, param: str | None, code: str = "invalid_export"):
        super().__init__(message)
        self.param, self.code = param, code


def _bad(message: str, param: str | None, code: str = "invalid_export") -> InvalidExport:
    return InvalidExport(message, param, code)


def parse(doc: dict) -> ExportDoc:
    """The document validated, references included (InvalidExport naming the first problem)."""
    try:
        d = ExportDoc.model_validate(doc)
    except ValidationError as exc:
        e = exc.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        raise _bad(f"{where}: {e['msg']}", where) from None
    sessions = set()
    for i, s in enumerate(d.sessions):
        if s.id in sessions:
            raise _bad(f"session {s.id!r} is listed twice", f"sessions.{i}.id")
        sessions.add(s.id)
    messages = set()
    for i, m in enumerate(d.messages):
        if m.id in messages:
            raise _bad(f"message id {m.id} is used twice", f"messages.{i}.id")
        if m.session_id not in sessions:
            raise _bad(f"message {m.id} names session {m.session_id!r}, which is not in sessions",
                       f"messages.{i}.session_id")
        messages.add(m.id)
    memories = {m.id for m in d.memories}
    if len(memories) < len(d.memories):
        raise _bad("a memory id is used twice", "memories")
    for i, m in enumerate(d.memories):
        missing = [s for s in m.source_ids if s not in messages]
        if missing:
            raise _bad(f"memory {m.id} cites message {missing[0]}, which is not in messages", f"memories.{i}.source_ids")
        if m.superseded_by is not None and (m.superseded_by not in memories or m.superseded_by == m.id):
            raise _bad(f"memory {m.id} is superseded by {m.superseded_by}, which is not another memory of the document",
                       f"memories.{i}.superseded_by")
        if m.superseded_by is not None and m.status != "superseded":
            raise _bad(f"memory {m.id} has superseded_by but status {m.status!r}", f"memories.{i}.status")
    if len({b.label for b in d.core_blocks}) < len(d.core_blocks):
        raise _bad("a core block label is used twice", "core_blocks")
    return d


def export_doc(archive, tenant_id: str, user_id: str) -> dict:
    if not archive.user_exists(tenant_id, user_id):
        raise R.NotFound(f"user {user_id!r} not found")
    blocks = [b.to_dict() for b in archive.core_blocks(tenant_id, user_id)]
    for b in blocks:
        b.pop("version", None)
    return {"version": EXPORT_VERSION, "user_id": user_id,
            "sessions": [s.to_dict() for s in archive.list_sessions(tenant_id, user_id)],
            "messages": [m.to_dict() for m in archive.messages(tenant_id, user_id)],
            "memories": [m.to_dict() for m in archive.list_memories(tenant_id, user_id)],
            "core_blocks": blocks}


def _free_ids(s, table, wanted: list[int]) -> bool:
    """Whether none of `wanted` is a row of `table` yet (in batches: SQLite binds <= 32k)."""
    for i in range(0, len(wanted), 1000):
        if s.scalar(select(func.count()).select_from(table).where(table.id.in_(wanted[i:i + 1000]))):
            return False
    return True


def _same(row: MessageRow, m: DocMessage) -> bool:
    return (row.role, row.text, from_db_time(row.created_at), from_db_time(row.event_time)) == (
        m.role, m.text, _utc(m.created_at), _utc(m.event_time))


def _utc(t: datetime | None) -> datetime | None:
    return from_db_time(to_db_time(t))


def import_doc(archive, tenant_id: str, user_id: str, d: ExportDoc) -> dict:
    """Load a parsed document under (tenant_id, user_id); see the module docstring."""
    check_id(user_id, "user_id")
    for i, sess in enumerate(d.sessions):
        check_id(sess.id, f"sessions.{i}.id", "session_id")
    by_session: dict[str, list[DocMessage]] = {}
    for m in d.messages:
        by_session.setdefault(m.session_id, []).append(m)
    msg_map: dict[int, int] = {}
    mem_map: dict[int, int] = {}
    created = {"sessions": 0, "messages": 0, "memories": 0, "core_blocks": 0}
    maker = row_ids.maker(archive.engine)
    with archive.tx() as s:
        archive._user_in(s, tenant_id, user_id)
        new_msgs: list[DocMessage] = []
        for sess in d.sessions:
            row = s.get(SessionRow, (tenant_id, user_id, sess.id))
            mine = by_session.get(sess.id, [])
            if row is None:
                s.add(SessionRow(id=sess.id, tenant_id=tenant_id, user_id=user_id, agent_id=sess.agent_id,
                                 created_at=to_db_time(sess.created_at)))
                created["sessions"] += 1
                new_msgs += mine
                continue
            have = list(s.scalars(select(MessageRow).where(
                MessageRow.tenant_id == tenant_id, MessageRow.user_id == user_id, MessageRow.session_id == sess.id)
                .order_by(MessageRow.id).limit(len(mine))))
            # the document's messages already there (an import done before, or a conversation
            # that went on since: both are the same messages), then the ones still to add
            if not all(_same(r, m) for r, m in zip(have, mine, strict=False)):
                raise R.Conflict(f"session {sess.id!r} already holds other messages; import it under another user "
                                 "or delete the session first")
            msg_map.update({m.id: r.id for m, r in zip(mine, have, strict=False)})
            new_msgs += mine[len(have):]
        keep = _free_ids(s, MessageRow, [m.id for m in new_msgs])
        s.flush()
        for m in new_msgs:
            row = MessageRow(tenant_id=tenant_id, user_id=user_id, session_id=m.session_id, role=m.role, text=m.text,
                             created_at=to_db_time(m.created_at), event_time=to_db_time(m.event_time),
                             compressed_text=m.compressed_text, name=m.name, keys=m.keys)
            if keep:
                row.id = m.id
            s.add(row)
            s.flush()
            msg_map[m.id] = row.id
        created["messages"] = len(new_msgs)
        existing = {(r.kind, r.text, from_db_time(r.created_at)): r.id for r in s.scalars(select(MemoryRow).where(
            MemoryRow.tenant_id == tenant_id, MemoryRow.user_id == user_id))}
        new_mems = []
        for m in d.memories:
            found = existing.get((m.kind, m.text, _utc(m.created_at)))
            if found is not None:
                mem_map[m.id] = found
            else:
                new_mems.append(m)
        keep = _free_ids(s, MemoryRow, [m.id for m in new_mems])
        rows = []
        for m in new_mems:
            row = MemoryRow(tenant_id=tenant_id, user_id=user_id, kind=m.kind, text=m.text,
                            compressed_text=m.compressed_text, importance=m.importance, status=m.status,
                            source_ids=[msg_map[i] for i in m.source_ids], event_time=to_db_time(m.event_time),
                            created_at=to_db_time(m.created_at), updated_at=to_db_time(m.updated_at or m.created_at))
            if keep:
                row.id = m.id
            s.add(row)
            s.flush()
            mem_map[m.id] = row.id
            rows.append((row, m))
        for row, m in rows:
            row.superseded_by = None if m.superseded_by is None else mem_map[m.superseded_by]
        created["memories"] = len(new_mems)
        for b in d.core_blocks:
            row = s.get(CoreBlockRow, (tenant_id, user_id, b.label))
            if row is not None and row.value == b.value and row.char_limit == b.limit:
                continue
            if len(b.value) > b.limit:
                raise _bad(f"core block {b.label!r} is limited to {b.limit} characters, got {len(b.value)}",
                           "core_blocks")
            when = to_db_time(b.updated_at) or utcnow()
            if row is None:
                row = CoreBlockRow(tenant_id=tenant_id, user_id=user_id, label=b.label, value="", char_limit=b.limit)
                s.add(row)
            s.add(CoreBlockEditRow(tenant_id=tenant_id, user_id=user_id, label=b.label, old_value=row.value,
                                   new_value=b.value))
            row.value, row.char_limit, row.updated_at = b.value, b.limit, when
            created["core_blocks"] += 1
        s.flush()
    top = max([*msg_map.values(), *mem_map.values()], default=0)
    maker.observe(top)
    changed = {"messages": {str(k): v for k, v in msg_map.items() if k != v},
               "memories": {str(k): v for k, v in mem_map.items() if k != v}}
    return {"created": created, "unchanged": not any(created.values()), "id_map": changed}
