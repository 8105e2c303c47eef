"""full-text index over messages and memories: a `name` (speaker) and `keys` column on messages,
and the database's own full-text search, kept in step by the database itself

SQLite: FTS5 tables with external content (the text is stored once, in its table), the
porter stemmer, and triggers that keep them in step inside every transaction that writes.
PostgreSQL: stored generated `tsvector` columns (message text weighted A, keys B) with GIN
indexes. Both are filled for existing rows here: FTS5 by its 'rebuild' command, the
generated columns by PostgreSQL as they are added. The statements live in
`agentmem.tiers.lexical`, frozen there for this revision.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

from agentmem.tiers.lexical import PG_DDL, SQLITE_DDL, rebuild

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("name", sa.String(200), nullable=True))
        batch.add_column(sa.Column("keys", sa.Text(), nullable=True))
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        for fts, (create, triggers) in SQLITE_DDL.items():
            for stmt in (create, *triggers, rebuild(fts)):
                op.execute(stmt)
    elif dialect == "postgresql":
        for stmt in PG_DDL:
            op.execute(stmt)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        for fts in SQLITE_DDL:
            for suffix in ("ai", "ad", "au"):
                op.execute(f"DROP TRIGGER IF EXISTS {fts}_{suffix}")
            op.execute(f"DROP TABLE IF EXISTS {fts}")
    elif dialect == "postgresql":
        for table in ("messages", "memories"):
            op.execute(f"DROP INDEX IF EXISTS ix_{table}_search_tsv")
            op.execute(f"ALTER TABLE {table} DROP COLUMN IF EXISTS search_tsv")
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("keys")
        batch.drop_column("name")
