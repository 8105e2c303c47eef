"""full-text index over messages: a `name` (speaker) and `keys` column, and the database's own
full-text search kept in step by the database itself

SQLite: an FTS5 table with external content (the text is stored once, in `messages`), the
porter stemmer, and triggers that keep it in step inside every transaction that writes a
message. PostgreSQL: a stored generated `tsvector` column (text weighted A, keys B) with a
GIN index. Both are filled for existing rows here: FTS5 by its 'rebuild' command, the
generated column by PostgreSQL as the column is added. The statements live in
`agentmem.tiers.lexical`, frozen there for this revision.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

from agentmem.tiers.lexical import PG_DDL, SQLITE_REBUILD, SQLITE_TABLE, SQLITE_TRIGGERS

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("name", sa.String(200), nullable=True))
        batch.add_column(sa.Column("keys", sa.Text(), nullable=True))
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        for stmt in (SQLITE_TABLE, *SQLITE_TRIGGERS, SQLITE_REBUILD):
            op.execute(stmt)
    elif dialect == "postgresql":
        for stmt in PG_DDL:
            op.execute(stmt)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        for name in ("message_fts_ai", "message_fts_ad", "message_fts_au"):
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
        op.execute("DROP TABLE IF EXISTS message_fts")
    elif dialect == "postgresql":
        op.execute("DROP INDEX IF EXISTS ix_messages_search_tsv")
        op.execute("ALTER TABLE messages DROP COLUMN IF EXISTS search_tsv")
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("keys")
        batch.drop_column("name")
