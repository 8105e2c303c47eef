"""agent frameworks' own records: a session's item log (OpenAI Agents SDK) and a
namespaced key-value store (LangGraph), each linked to the message or memory that makes
it searchable

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "session_items",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("user_id", sa.String(200), nullable=False),
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("item", sa.JSON(), nullable=False),
        sa.Column("message_id", ROW_ID, nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_session_items_scope", "session_items", ["tenant_id", "user_id", "session_id", "id"])
    op.create_table(
        "store_items",
        sa.Column("tenant_id", sa.String(64), primary_key=True),
        sa.Column("user_id", sa.String(200), primary_key=True),
        sa.Column("namespace", sa.String(512), primary_key=True),
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("value", sa.JSON(), nullable=False),
        sa.Column("memory_id", ROW_ID, nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_store_items_memory", "store_items", ["tenant_id", "user_id", "memory_id"])


def downgrade() -> None:
    op.drop_index("ix_store_items_memory", "store_items")
    op.drop_table("store_items")
    op.drop_index("ix_session_items_scope", "session_items")
    op.drop_table("session_items")
