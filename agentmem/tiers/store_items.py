"""A framework's namespaced key-value store in the archive (table `store_items`): JSON values
under (namespace, key), each linked to the memory that holds its searchable text, if it has
one. LangGraph's `BaseStore` adapter (integrations/langgraph.py) is the caller; these
functions know namespaces only as their labels joined by `SEP`, and never write memories
themselves: the caller writes an item and its memory in one transaction (`Archive.tx`).

Every item has its user (the caller derives it from the namespace), so deleting a user or
tenant deletes its items with its memories.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, func, or_, select

from .archive import Archive
from .schema import StoreItemRow, from_db_time, to_db_time

SEP = "."  # LangGraph refuses labels holding it, so a joined namespace splits back exactly


@dataclass(frozen=True)
class StoreItem:
    user_id: str
    namespace: str
    key: str
    value: dict
    memory_id: int | None
    created_at: datetime
    updated_at: datetime


def get(archive: Archive, tenant_id: str, user_id: str, namespace: str, key: str) -> StoreItem | None:
    with archive.tx() as s:
        row = s.get(StoreItemRow, (tenant_id, user_id, namespace, key))
        return None if row is None else _item(row)


def under(archive: Archive, tenant_id: str, prefix: str, user_id: str | None = None) -> list[StoreItem]:
    """The items in namespace `prefix` and in every namespace below it ("" = all of the
    tenant's), oldest first. `user_id`: only that user's, when the prefix already names it."""
    q = select(StoreItemRow).where(StoreItemRow.tenant_id == tenant_id, *_below(prefix))
    if user_id is not None:
        q = q.where(StoreItemRow.user_id == user_id)
    with archive.tx() as s:
        rows = s.scalars(q.order_by(StoreItemRow.created_at, StoreItemRow.namespace, StoreItemRow.key))
        return [_item(r) for r in rows]


def namespaces(archive: Archive, tenant_id: str, prefix: str = "") -> list[str]:
    """The namespaces holding at least one item, in `prefix` or below it."""
    q = select(StoreItemRow.namespace).where(StoreItemRow.tenant_id == tenant_id, *_below(prefix)).distinct()
    with archive.tx() as s:
        return list(s.scalars(q))


def put(archive: Archive, tenant_id: str, user_id: str, namespace: str, key: str, value: dict,
        memory_id: int | None, at: datetime) -> None:
    """Insert the item, or replace its value and memory; an update keeps its `created_at`."""
    with archive.tx() as s:
        row = s.get(StoreItemRow, (tenant_id, user_id, namespace, key))
        if row is None:
            s.add(StoreItemRow(tenant_id=tenant_id, user_id=user_id, namespace=namespace, key=key, value=value,
                               memory_id=memory_id, created_at=to_db_time(at), updated_at=to_db_time(at)))
        else:
            row.value, row.memory_id, row.updated_at = value, memory_id, to_db_time(at)
        s.flush()


def remove(archive: Archive, tenant_id: str, user_id: str, namespace: str, key: str) -> None:
    with archive.tx() as s:
        s.execute(delete(StoreItemRow).where(StoreItemRow.tenant_id == tenant_id, StoreItemRow.user_id == user_id,
                                             StoreItemRow.namespace == namespace, StoreItemRow.key == key))


def _below(prefix: str) -> tuple:
    """The namespace `prefix` and those under it, compared whole labels at a time and case
    sensitively (SQLite's LIKE ignores ASCII case, so no LIKE)."""
    if not prefix:
        return ()
    below = prefix + SEP
    return (or_(StoreItemRow.namespace == prefix,
                func.substr(StoreItemRow.namespace, 1, len(below)) == below),)


def _item(row: StoreItemRow) -> StoreItem:
    return StoreItem(user_id=row.user_id, namespace=row.namespace, key=row.key, value=row.value,
                     memory_id=row.memory_id, created_at=from_db_time(row.created_at),
                     updated_at=from_db_time(row.updated_at))
