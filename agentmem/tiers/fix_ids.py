"""Users and sessions stored before ids were checked (`tiers/scope.py`) may hold ids no URL
can carry (`a/b`, `..`, a space): they can be listed but not read, exported or deleted
through the API. `fix_ids` finds them and renames each to an id in the alphabet (the old
one with every other character as `_`, a letter-or-digit start, and `-` plus 8 hex digits
of the old id's sha256, so two old ids never meet), or deletes them. The mapping is
returned, so the caller can tell the clients that used the old ids.

A renamed user keeps every row (messages, memories, core blocks, traces, sessions); its
recall index is dropped and rebuilt from the archive on next use, and its default
conversation follows it (`default_session_id` of the new id). Run it with the service
stopped: a running server's cached sessions still name the old ids. `agentmem tenant
fix-ids` is the command.
"""

from __future__ import annotations

import hashlib
import re

from sqlalchemy import select, update

from .archive import _USER_TABLES
from .schema import (
    IdempotencyRow,
    MessageRow,
    SessionItemRow,
    SessionRow,
    SummaryRow,
    TenantRow,
    TurnRow,
    UserRow,
)
from .scope import addressable
from .sizes import SESSION_ID_CHARS, USER_ID_CHARS

_SESSION_TABLES = (MessageRow, SummaryRow, TurnRow, SessionItemRow)
_OUTSIDE = re.compile(r"[^A-Za-z0-9_.@:-]")


def safe_id(old: str, max_chars: int, taken: set[str]) -> str:
    """An id in the alphabet for `old`, not in `taken`."""
    base = _OUTSIDE.sub("_", old)
    if not base or not re.match(r"[A-Za-z0-9_]", base[0]):
        base = "_" + base
    digest = hashlib.sha256(old.encode("utf-8", "surrogatepass")).hexdigest()
    for n in range(8, len(digest) + 1, 4):
        new = base[:max_chars - n - 1] + "-" + digest[:n]
        if new not in taken:
            return new
    raise RuntimeError(f"no free id for {old!r}")  # 2**256 ids taken


def find(store, tenant_id: str | None = None) -> dict[str, list[dict]]:
    """Users and sessions whose ids are outside the alphabet, of one tenant or all."""
    with store.archive.tx() as s:
        tenants = [tenant_id] if tenant_id else list(s.scalars(select(TenantRow.id).order_by(TenantRow.id)))
        users, sessions = [], []
        for t in tenants:
            for uid in s.scalars(select(UserRow.id).where(UserRow.tenant_id == t).order_by(UserRow.id)):
                if not addressable(uid, USER_ID_CHARS):
                    users.append({"tenant_id": t, "old": uid})
            for uid, sid in s.execute(select(SessionRow.user_id, SessionRow.id).where(SessionRow.tenant_id == t)
                                      .order_by(SessionRow.user_id, SessionRow.id)):
                if not addressable(sid, SESSION_ID_CHARS):
                    sessions.append({"tenant_id": t, "user_id": uid, "old": sid})
    return {"users": users, "sessions": sessions}


def fix_ids(store, tenant_id: str | None = None, delete: bool = False, dry_run: bool = False) -> dict:
    """Rename (or with `delete`, delete) every user and session outside the alphabet; with
    `dry_run` only say what would change. Returns {"users": [{tenant_id, old, new}],
    "sessions": [{tenant_id, user_id, old, new}], "deleted", "dry_run"} (`new` is None for a
    deletion; a session's `user_id` is its user's id after the renaming)."""
    from .store import default_session_id

    found = find(store, tenant_id)
    users, sessions = found["users"], found["sessions"]
    gone = {(u["tenant_id"], u["old"]) for u in users}
    if delete:  # a deleted user's sessions go with it
        sessions = [x for x in sessions if (x["tenant_id"], x["user_id"]) not in gone]
    with store.archive.tx() as s:
        renamed: dict[tuple[str, str], str] = {}
        for u in users:
            if delete:
                u["new"] = None
                continue
            taken = set(s.scalars(select(UserRow.id).where(UserRow.tenant_id == u["tenant_id"])))
            u["new"] = safe_id(u["old"], USER_ID_CHARS, taken | set(renamed.values()))
            renamed[(u["tenant_id"], u["old"])] = u["new"]
        chosen: set[tuple[str, str, str]] = set()
        for x in sessions:
            x["user_id"] = renamed.get((x["tenant_id"], x["user_id"]), x["user_id"])
            if delete:
                x["new"] = None
                continue
            old_user = next((o for (t, o), n in renamed.items() if t == x["tenant_id"] and n == x["user_id"]),
                            x["user_id"])
            taken = set(s.scalars(select(SessionRow.id).where(SessionRow.tenant_id == x["tenant_id"],
                                                              SessionRow.user_id == old_user)))
            taken |= {sid for t, uid, sid in chosen if (t, uid) == (x["tenant_id"], x["user_id"])}
            x["new"] = safe_id(x["old"], SESSION_ID_CHARS, taken)
            chosen.add((x["tenant_id"], x["user_id"], x["new"]))
    out = {"users": users, "sessions": sessions, "deleted": delete, "dry_run": dry_run}
    if dry_run:
        return out
    for u in users:
        if delete:
            store.delete_user(u["tenant_id"], u["old"])
        else:
            _rename_user(store, u["tenant_id"], u["old"], u["new"], default_session_id)
    for x in sessions:
        _session(store, x["tenant_id"], x["user_id"], x["old"], x["new"])
    return out


def _rename_user(store, tenant_id: str, old: str, new: str, default_session_id) -> None:
    with store.archive.tx() as s:
        for table in (*_USER_TABLES, IdempotencyRow):
            s.execute(update(table).where(table.tenant_id == tenant_id, table.user_id == old).values(user_id=new))
        s.execute(update(UserRow).where(UserRow.tenant_id == tenant_id, UserRow.id == old).values(id=new))
        was, now = default_session_id(tenant_id, old), default_session_id(tenant_id, new)
        s.execute(update(SessionRow).where(SessionRow.tenant_id == tenant_id, SessionRow.user_id == new,
                                           SessionRow.id == was).values(id=now))
        for table in _SESSION_TABLES:
            s.execute(update(table).where(table.tenant_id == tenant_id, table.user_id == new,
                                          table.session_id == was).values(session_id=now))
    store.recall.drop(tenant_id, old)  # rebuilt under the new id from the archive on next use
    store.recall.drop(tenant_id, new)
    for hook in store.forget_hooks:
        hook(tenant_id, old)


def _session(store, tenant_id: str, user_id: str, old: str, new: str | None) -> None:
    """Rename a session (every row naming it follows), or with `new` None delete it and its rows."""
    from sqlalchemy import delete as sql_delete

    with store.archive.tx() as s:
        for table in _SESSION_TABLES:
            where = (table.tenant_id == tenant_id, table.user_id == user_id, table.session_id == old)
            s.execute(sql_delete(table).where(*where) if new is None
                      else update(table).where(*where).values(session_id=new))
        where = (SessionRow.tenant_id == tenant_id, SessionRow.user_id == user_id, SessionRow.id == old)
        s.execute(sql_delete(SessionRow).where(*where) if new is None else update(SessionRow).where(*where).values(id=new))
    if new is None:
        store.archive._scrub()
    store.recall.drop(tenant_id, user_id)
