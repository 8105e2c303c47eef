"""session id columns sized from tiers/sizes.py (128, as the API allows), and a table of
deleted tenant ids so that none is ever recreated

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

SESSION_COLUMNS = (("sessions", "id"), ("messages", "session_id"), ("summaries", "session_id"),
                   ("turns", "session_id"))


def upgrade() -> None:
    op.create_table("deleted_tenants", sa.Column("id", sa.String(64), primary_key=True),
                    sa.Column("deleted_at", sa.DateTime(), nullable=False))
    _resize(64, 128)


def downgrade() -> None:
    _resize(128, 64)
    op.drop_table("deleted_tenants")


def _resize(old: int, new: int) -> None:
    for table, column in SESSION_COLUMNS:
        with op.batch_alter_table(table) as batch:
            batch.alter_column(column, type_=sa.String(new), existing_type=sa.String(old), existing_nullable=False)
