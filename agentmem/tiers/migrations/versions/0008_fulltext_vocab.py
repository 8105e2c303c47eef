"""SQLite: a read-only view of the message full-text index's vocabulary (fts5vocab), so that a
query can see how many rows each of its words matches before it runs (lexical.py drops the
very common ones). Nothing is stored: FTS5 reads it from the index itself. PostgreSQL: nothing.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

from alembic import op

from agentmem.tiers.lexical import SQLITE_VOCAB_DDL

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute(SQLITE_VOCAB_DDL)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TABLE IF EXISTS message_fts_vocab")
