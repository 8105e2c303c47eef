"""Lexical retrieval from the archive's own database: SQLite FTS5 (bm25, porter stemmer) or
PostgreSQL full-text search (`websearch_to_tsquery`, `ts_rank_cd`, a GIN index), created by
migration 0003 and kept in step by the database in the same transaction as every write.

Queries are built from plain words only (`query.content_terms`), each quoted, so no input
(quotes, `*`, `NEAR`, `:`, `-`) is ever read as query syntax. Any word may match (OR): recall
wants the turn that shares two of five words with the question, ranked by the index.
Every query is scoped by tenant and user in SQL.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import text

_FTS_WEIGHTS = (1.0, 0.35)  # bm25 weights of the columns (text, keys)

# The DDL of migration 0003 (which imports it). Frozen: a change needs a new migration.
SQLITE_TABLE = """CREATE VIRTUAL TABLE message_fts USING fts5(
    text, keys, content='messages', content_rowid='id', tokenize='porter unicode61 remove_diacritics 2')"""
SQLITE_TRIGGERS = (
    """CREATE TRIGGER message_fts_ai AFTER INSERT ON messages BEGIN
        INSERT INTO message_fts(rowid, text, keys) VALUES (new.id, new.text, coalesce(new.keys, ''));
    END""",
    """CREATE TRIGGER message_fts_ad AFTER DELETE ON messages BEGIN
        INSERT INTO message_fts(message_fts, rowid, text, keys) VALUES ('delete', old.id, old.text, coalesce(old.keys, ''));
    END""",
    """CREATE TRIGGER message_fts_au AFTER UPDATE OF text, keys ON messages BEGIN
        INSERT INTO message_fts(message_fts, rowid, text, keys) VALUES ('delete', old.id, old.text, coalesce(old.keys, ''));
        INSERT INTO message_fts(rowid, text, keys) VALUES (new.id, new.text, coalesce(new.keys, ''));
    END""",
)
SQLITE_REBUILD = "INSERT INTO message_fts(message_fts) VALUES ('rebuild')"
PG_DDL = (
    """ALTER TABLE messages ADD COLUMN search_tsv tsvector GENERATED ALWAYS AS (
        setweight(to_tsvector('english', coalesce(text, '')), 'A') ||
        setweight(to_tsvector('english', coalesce(keys, '')), 'B')) STORED""",
    "CREATE INDEX ix_messages_search_tsv ON messages USING gin (search_tsv)",
)


def _fts5_query(terms: list[str]) -> str:
    return " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)


def _pg_query(terms: list[str]) -> str:
    # websearch syntax: plain words joined by "or"; quotes and '-' never reach it (terms are words)
    return " or ".join(t.replace('"', "").replace("-", " ") for t in terms)


def _filters(exclude: list[int], since, until) -> tuple[str, dict]:
    sql, params = "", {}
    if exclude:
        names = [f"x{i}" for i in range(len(exclude))]
        sql += f" AND m.id NOT IN ({', '.join(':' + n for n in names)})"
        params.update(zip(names, exclude, strict=True))
    if since is not None:
        sql += " AND coalesce(m.event_time, m.created_at) >= :since"
        params["since"] = since
    if until is not None:
        sql += " AND coalesce(m.event_time, m.created_at) <= :until"
        params["until"] = until
    return sql, params


def search(s, tenant_id: str, user_id: str, terms: list[str], limit: int, exclude: list[int],
           since: datetime | None, until: datetime | None) -> list[tuple[int, float]]:
    """(message id, score) best first; scores are larger-is-better on both databases."""
    if not terms or limit <= 0:
        return []
    extra, params = _filters(exclude, since, until)
    params.update(tenant=tenant_id, user=user_id, limit=limit)
    dialect = s.get_bind().dialect.name
    if dialect == "sqlite":
        params["q"] = _fts5_query(terms)
        w = ", ".join(str(x) for x in _FTS_WEIGHTS)
        sql = (f"SELECT m.id, -bm25(message_fts, {w}) AS score FROM message_fts JOIN messages m "
               f"ON m.id = message_fts.rowid WHERE message_fts MATCH :q AND m.tenant_id = :tenant "
               f"AND m.user_id = :user{extra} ORDER BY bm25(message_fts, {w}) LIMIT :limit")
    elif dialect == "postgresql":
        params["q"] = _pg_query(terms)
        sql = ("SELECT m.id, ts_rank_cd(m.search_tsv, q) AS score FROM messages m, "
               "websearch_to_tsquery('english', :q) q WHERE m.search_tsv @@ q AND m.tenant_id = :tenant "
               f"AND m.user_id = :user{extra} ORDER BY score DESC, m.id DESC LIMIT :limit")
    else:
        return []
    return [(int(i), float(score)) for i, score in s.execute(text(sql), params)]


def ensure_index(conn) -> None:
    """Re-create the SQLite triggers if a later table rebuild dropped them (and rebuild the
    index from the messages then): the full-text index must never silently fall behind."""
    if conn.dialect.name != "sqlite":
        return
    have = {r[0] for r in conn.execute(text("SELECT name FROM sqlite_master WHERE type IN ('trigger', 'table')"))}
    missing = [stmt for stmt in SQLITE_TRIGGERS if stmt.split()[2] not in have]
    if not missing:
        return
    if "message_fts" not in have:
        conn.execute(text(SQLITE_TABLE))
    for stmt in missing:
        conn.execute(text(stmt))
    conn.execute(text(SQLITE_REBUILD))
