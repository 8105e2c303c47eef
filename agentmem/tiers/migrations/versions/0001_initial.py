"""initial archive schema

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = sa.String(64)
NAME = sa.String(200)


def _now() -> sa.Column:
    return sa.Column("created_at", sa.DateTime(), nullable=False)


def upgrade() -> None:
    op.create_table("tenants", sa.Column("id", ID, primary_key=True), sa.Column("name", NAME, nullable=False), _now())
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", ID, sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True),
        sa.Column("key_hash", sa.String(128), nullable=False, unique=True),
        sa.Column("name", NAME, nullable=False),
        _now(),
    )
    op.create_table(
        "users",
        sa.Column("tenant_id", ID, sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("id", NAME, primary_key=True),
        _now(),
    )
    op.create_table(
        "agents",
        sa.Column("tenant_id", ID, primary_key=True),
        sa.Column("user_id", NAME, primary_key=True),
        sa.Column("id", NAME, primary_key=True),
        sa.Column("persona", sa.Text(), nullable=False),
        _now(),
    )
    op.create_table(
        "sessions",
        sa.Column("id", ID, primary_key=True),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("user_id", NAME, nullable=False),
        sa.Column("agent_id", NAME, nullable=False),
        _now(),
    )
    op.create_index("ix_sessions_scope", "sessions", ["tenant_id", "user_id"])
    op.create_table(
        "messages",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("user_id", NAME, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        _now(),
        sa.Column("event_time", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_messages_scope", "messages", ["tenant_id", "user_id", "id"])
    op.create_index("ix_messages_session", "messages", ["session_id", "id"])
    op.create_table(
        "memories",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("user_id", NAME, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("compressed_text", sa.Text(), nullable=True),
        sa.Column("importance", sa.Float(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("superseded_by", sa.Integer(), nullable=True),
        sa.Column("source_ids", sa.JSON(), nullable=False),
        sa.Column("event_time", sa.DateTime(), nullable=True),
        _now(),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_memories_scope", "memories", ["tenant_id", "user_id", "status"])
    op.create_table(
        "summaries",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("user_id", NAME, nullable=False),
        sa.Column("session_id", ID, nullable=False, index=True),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("upto_message_id", sa.Integer(), nullable=False),
        _now(),
    )
    op.create_table(
        "core_blocks",
        sa.Column("tenant_id", ID, primary_key=True),
        sa.Column("user_id", NAME, primary_key=True),
        sa.Column("label", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("char_limit", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )
    op.create_table(
        "core_block_edits",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("user_id", NAME, nullable=False),
        sa.Column("label", sa.String(64), nullable=False),
        sa.Column("old_value", sa.Text(), nullable=False),
        sa.Column("new_value", sa.Text(), nullable=False),
        _now(),
    )
    op.create_index("ix_core_block_edits_scope", "core_block_edits", ["tenant_id", "user_id", "label"])
    op.create_table(
        "turns",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("user_id", NAME, nullable=False),
        sa.Column("session_id", ID, nullable=False),
        sa.Column("trace", sa.JSON(), nullable=False),
        _now(),
    )
    op.create_index("ix_turns_scope", "turns", ["tenant_id", "user_id", "session_id"])


def downgrade() -> None:
    for table in ("turns", "core_block_edits", "core_blocks", "summaries", "memories", "messages", "sessions",
                  "agents", "users", "api_keys", "tenants"):
        op.drop_table(table)
