"""An agent framework's session log in the archive (table `session_items`): the items exactly
as the framework gave them, oldest first, each linked to the archive message that holds its
readable text, if it has one. The items are the framework's; the messages are the user's
memory, so writing or removing an item writes or removes its message in the same transaction.

The OpenAI Agents SDK adapter (integrations/openai_agents.py) is the caller; these functions
know nothing of its item types, only JSON and the message each item maps to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sqlalchemy import delete, select

from .archive import Archive, clean_text
from .records import InvalidInput
from .schema import MessageRow, SessionItemRow


def check_item(value, where: str = "item") -> None:
    """An item must be plain JSON that every backend stores as given: strings free of NULs
    and lone surrogates (PostgreSQL rejects both), finite numbers (JSON has no NaN)."""
    if isinstance(value, dict):
        for key, v in value.items():
            if not isinstance(key, str):
                raise InvalidInput(f"{where}: keys must be strings, got {key!r}")
            clean_text(key, f"{where} key", allow_empty=True)
            check_item(v, f"{where}.{key}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_item(v, f"{where}[{i}]")
    elif isinstance(value, str):
        clean_text(value, where, allow_empty=True)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(f"{where} is not a finite number")
    elif not (value is None or isinstance(value, bool | int)):
        raise InvalidInput(f"{where} must be JSON (dict, list, string, number, bool, null), got {type(value).__name__}")


def append(archive: Archive, tenant_id: str, user_id: str, session_id: str,
           entries: Sequence[tuple[dict, dict | None]]) -> None:
    """Store items in order, each with the archive message (a role/content dict) its text
    becomes, or None; the session is opened (and the user made) as any first write does."""
    for i, (item, _message) in enumerate(entries):
        if not isinstance(item, dict):
            raise InvalidInput(f"item {i} must be a dict, got {type(item).__name__}")
        check_item(item, f"item {i}")
    with archive.tx() as s:
        archive.open_session(tenant_id, user_id, session_id)
        messages = [m for _item, m in entries if m is not None]
        stored = iter(archive.append_messages(tenant_id, user_id, session_id, messages) if messages else ())
        s.add_all([SessionItemRow(tenant_id=tenant_id, user_id=user_id, session_id=session_id, item=item,
                                  message_id=None if m is None else next(stored).id) for item, m in entries])


def items(archive: Archive, tenant_id: str, user_id: str, session_id: str, limit: int | None = None) -> list[dict]:
    """The session's items, oldest first; `limit`: only the newest that many."""
    q = select(SessionItemRow.item).where(*_scope(tenant_id, user_id, session_id))
    with archive.tx() as s:
        if limit is None:
            return list(s.scalars(q.order_by(SessionItemRow.id)))
        return list(s.scalars(q.order_by(SessionItemRow.id.desc()).limit(limit)))[::-1]


def pop(archive: Archive, tenant_id: str, user_id: str, session_id: str) -> dict | None:
    """Remove the newest item (and its message) and return it; None when there is none. A
    concurrent pop that took the same row first makes this one take the next."""
    while True:
        with archive.tx() as s:
            row = s.execute(select(SessionItemRow.id, SessionItemRow.item, SessionItemRow.message_id)
                            .where(*_scope(tenant_id, user_id, session_id))
                            .order_by(SessionItemRow.id.desc()).limit(1)).first()
            if row is None:
                return None
            if s.execute(delete(SessionItemRow).where(SessionItemRow.id == row.id)).rowcount == 1:
                if row.message_id is not None:
                    _delete_messages(s, tenant_id, user_id, [row.message_id])
                return row.item


def clear(archive: Archive, tenant_id: str, user_id: str, session_id: str) -> None:
    """Remove all of the session's items and their messages."""
    scope = _scope(tenant_id, user_id, session_id)
    with archive.tx() as s:
        _delete_messages(s, tenant_id, user_id, select(SessionItemRow.message_id).where(*scope))
        s.execute(delete(SessionItemRow).where(*scope))


def _scope(tenant_id: str, user_id: str, session_id: str) -> tuple:
    return (SessionItemRow.tenant_id == tenant_id, SessionItemRow.user_id == user_id,
            SessionItemRow.session_id == session_id)


def _delete_messages(s, tenant_id: str, user_id: str, ids) -> None:
    """`ids`: a list, or a select of them (a whole session's, however many)."""
    s.execute(delete(MessageRow).where(MessageRow.tenant_id == tenant_id, MessageRow.user_id == user_id,
                                       MessageRow.id.in_(ids)).execution_options(synchronize_session=False))
