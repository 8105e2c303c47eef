"""partitioned ids: sessions keyed by (tenant, user, id), so two tenants may use the same
session id and neither learns of the other's; messages, memories and turns get server ids
that reveal no counts and are never reused (tiers/ids.py), from a per-database secret and
counter. Existing rows and their ids are kept as they are: old ids stay valid (they are
smaller than every new one, so ordering by id still follows insertion).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

import secrets

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

ROW_IDS = (("messages", "id", False), ("memories", "id", False), ("turns", "id", False),
           ("memories", "superseded_by", True), ("summaries", "upto_message_id", False))
SESSION_COLUMNS = ("tenant_id", "user_id", "id", "agent_id", "created_at")


def _sessions(name: str, key: list[str], pk_name: str) -> None:
    op.create_table(
        name,
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("user_id", sa.String(200), nullable=False),
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("agent_id", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint(*key, name=pk_name),
    )


def _rekey_sessions(key: list[str], pk_name: str) -> None:
    """Copy sessions into a table with the new primary key (portable: no ALTER of an unnamed
    constraint). PostgreSQL keeps a constraint's name across the rename, hence one name per
    direction."""
    op.drop_index("ix_sessions_scope", table_name="sessions")
    _sessions("sessions_rekeyed", key, pk_name)
    cols = ", ".join(SESSION_COLUMNS)
    op.execute(f"insert into sessions_rekeyed ({cols}) select {cols} from sessions")
    op.drop_table("sessions")
    op.rename_table("sessions_rekeyed", "sessions")
    op.create_index("ix_sessions_scope", "sessions", ["tenant_id", "user_id"])


def upgrade() -> None:
    _rekey_sessions(["tenant_id", "user_id", "id"], "pk_sessions_scoped")
    secret_table = op.create_table("row_id_secret", sa.Column("id", sa.Integer(), primary_key=True),
                                   sa.Column("secret", sa.LargeBinary(32), nullable=False))
    op.bulk_insert(secret_table, [{"id": 1, "secret": secrets.token_bytes(32)}])
    counter = op.create_table("row_id_counter", sa.Column("id", sa.Integer(), primary_key=True),
                              sa.Column("n", sa.BigInteger(), nullable=False))
    op.bulk_insert(counter, [{"id": 1, "n": 0}])
    if op.get_bind().dialect.name != "sqlite":  # SQLite's INTEGER is 64-bit already
        op.execute("create sequence row_id_seq owned by row_id_counter.n")  # dropped with its table
        for table, column, nullable in ROW_IDS:
            op.alter_column(table, column, type_=sa.BigInteger(), existing_type=sa.Integer(),
                            existing_nullable=nullable)


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        for table, column, nullable in ROW_IDS:
            op.alter_column(table, column, type_=sa.Integer(), existing_type=sa.BigInteger(),
                            existing_nullable=nullable)
        op.execute("drop sequence row_id_seq")
    op.drop_table("row_id_counter")
    op.drop_table("row_id_secret")
    _rekey_sessions(["id"], "pk_sessions_global")
