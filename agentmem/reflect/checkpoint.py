"""Where reflection stopped, per user, in the archive's own database.

The checkpoint is an optimisation, not the guarantee: every write reflection makes is
idempotent (a fact already stored from the same message is not stored again), so a crash
between a write and the checkpoint only means some messages are read twice. The row lives
in the same SQL database as the archive, so every replica sees it.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import BigInteger, Column, DateTime, MetaData, String, Table, and_, delete, func, select

from ..tiers.schema import MessageRow, from_db_time

_meta = MetaData()
reflect_state = Table(
    "reflect_state",
    _meta,
    Column("tenant_id", String(64), primary_key=True),
    Column("user_id", String(255), primary_key=True),
    Column("last_message_id", BigInteger, nullable=False, default=0),  # message ids are 64-bit (tiers/ids.py)
    Column("updated_at", DateTime, nullable=False),
)


class Checkpoints:
    def __init__(self, sql_engine):
        self.sql = sql_engine
        _meta.create_all(sql_engine, checkfirst=True)

    def get(self, tenant_id: str, user_id: str) -> int:
        with self.sql.connect() as c:
            row = c.execute(
                select(reflect_state.c.last_message_id).where(
                    reflect_state.c.tenant_id == tenant_id, reflect_state.c.user_id == user_id
                )
            ).first()
        return int(row[0]) if row else 0

    def set(self, tenant_id: str, user_id: str, last_message_id: int) -> None:
        now = datetime.now(UTC).replace(tzinfo=None)
        with self.sql.begin() as c:
            where = (reflect_state.c.tenant_id == tenant_id) & (reflect_state.c.user_id == user_id)
            if c.execute(select(reflect_state.c.user_id).where(where)).first():
                c.execute(
                    reflect_state.update()
                    .where(where)
                    .values(last_message_id=last_message_id, updated_at=now)
                )
            else:
                c.execute(
                    reflect_state.insert().values(
                        tenant_id=tenant_id, user_id=user_id, last_message_id=last_message_id, updated_at=now
                    )
                )

    def backlog(self) -> list[tuple[str, str, int, datetime]]:
        """(tenant, user, user turns after the checkpoint, time of the newest of them) for
        every user with unreflected turns: one grouped query, whoever wrote the turns."""
        m = MessageRow.__table__
        joined = m.outerjoin(
            reflect_state, and_(reflect_state.c.tenant_id == m.c.tenant_id, reflect_state.c.user_id == m.c.user_id)
        )
        q = (
            select(m.c.tenant_id, m.c.user_id, func.count(), func.max(m.c.created_at))
            .select_from(joined)
            .where(m.c.role == "user", m.c.id > func.coalesce(reflect_state.c.last_message_id, 0))
            .group_by(m.c.tenant_id, m.c.user_id)
        )
        with self.sql.connect() as c:
            return [(t, u, int(n), from_db_time(last)) for t, u, n, last in c.execute(q)]

    def forget(self, tenant_id: str, user_id: str | None = None) -> None:
        """Drop the checkpoint of a deleted user (or every user of a deleted tenant)."""
        where = reflect_state.c.tenant_id == tenant_id
        if user_id is not None:
            where = where & (reflect_state.c.user_id == user_id)
        with self.sql.begin() as c:
            c.execute(delete(reflect_state).where(where))
