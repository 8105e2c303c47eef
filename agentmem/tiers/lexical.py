"""Lexical retrieval from the archive's own database: SQLite FTS5 (bm25, porter stemmer) or
PostgreSQL full-text search (`websearch_to_tsquery` per word, a GIN index, and a bm25-like
score computed in the statement, `_pg_bm25`), created by
migration 0007 and kept in step by the database in the same transaction as every write.

Queries are built from plain words only (`query.content_terms`), each quoted, so no input
(quotes, `*`, `NEAR`, `:`, `-`) is ever read as query syntax. Any word may match (OR): recall
wants the turn that shares two of five words with the question, ranked by the index.
Every query is scoped by tenant and user in SQL.

Very common words are left out of a SQLite query (`_drop_common`): a word that more than
COMMON_SHARE of the index's rows and more than COMMON_MIN_ROWS rows hold ("days", "right",
"week", "home" in a 100,000-turn history) made FTS5 rank every row that holds it, 8-12 ms a
word at 100,000 turns, where a rare word takes under 1 ms; bm25 gives such a word little weight
anyway. Below COMMON_MIN_ROWS matching rows nothing is dropped, so small histories rank as
before; if every word is common, the rarest stays. The counts come from FTS5's own vocabulary
(fts5vocab, migration 0008), read for the query's Porter stems.
"""

from __future__ import annotations

import time
from datetime import datetime
from functools import lru_cache

from nltk.stem.porter import PorterStemmer
from sqlalchemy import text

# The DDL of migration 0007 (which imports it). Frozen: a change needs a new migration.
# Messages index their text and `keys` (captions), memories their text; memories leave the
# index only when deleted (superseded ones are filtered out by status, as in every query).
_SPECS = {  # fts table -> (content table, indexed columns)
    "message_fts": ("messages", ("text", "keys")),
    "memory_fts": ("memories", ("text",)),
}


def _sqlite_ddl(fts: str) -> tuple[str, tuple[str, ...]]:
    table, cols = _SPECS[fts]
    names = ", ".join(cols)
    new = ", ".join(f"coalesce(new.{c}, '')" for c in cols)
    old = ", ".join(f"coalesce(old.{c}, '')" for c in cols)
    create = (f"CREATE VIRTUAL TABLE {fts} USING fts5({names}, content='{table}', content_rowid='id', "
              "tokenize='porter unicode61 remove_diacritics 2')")
    triggers = (
        f"CREATE TRIGGER {fts}_ai AFTER INSERT ON {table} BEGIN "
        f"INSERT INTO {fts}(rowid, {names}) VALUES (new.id, {new}); END",
        f"CREATE TRIGGER {fts}_ad AFTER DELETE ON {table} BEGIN "
        f"INSERT INTO {fts}({fts}, rowid, {names}) VALUES ('delete', old.id, {old}); END",
        f"CREATE TRIGGER {fts}_au AFTER UPDATE OF {names} ON {table} BEGIN "
        f"INSERT INTO {fts}({fts}, rowid, {names}) VALUES ('delete', old.id, {old}); "
        f"INSERT INTO {fts}(rowid, {names}) VALUES (new.id, {new}); END",
    )
    return create, triggers


SQLITE_DDL = {fts: _sqlite_ddl(fts) for fts in _SPECS}
PG_DDL = (
    """ALTER TABLE messages ADD COLUMN search_tsv tsvector GENERATED ALWAYS AS (
        setweight(to_tsvector('english', coalesce(text, '')), 'A') ||
        setweight(to_tsvector('english', coalesce(keys, '')), 'B')) STORED""",
    "CREATE INDEX ix_messages_search_tsv ON messages USING gin (search_tsv)",
    """ALTER TABLE memories ADD COLUMN search_tsv tsvector GENERATED ALWAYS AS (
        to_tsvector('english', coalesce(text, ''))) STORED""",
    "CREATE INDEX ix_memories_search_tsv ON memories USING gin (search_tsv)",
)
_BM25_WEIGHTS = {"message_fts": "1.0, 0.35", "memory_fts": "1.0"}
# Migration 0008's (frozen): the vocabulary of message_fts, one row per term with its row count
SQLITE_VOCAB_DDL = "CREATE VIRTUAL TABLE message_fts_vocab USING fts5vocab(message_fts, 'row')"

COMMON_SHARE = 0.01  # a word in more than this share of the indexed rows ...
COMMON_MIN_ROWS = 1000  # ... and in more than this many rows is left out of the query
_ROWS_TTL_S = 60.0  # how long the count of indexed rows is reused
_rows_cache: dict[int, tuple[float, int]] = {}  # id(engine) -> (time, rows)
_porter = PorterStemmer(mode=PorterStemmer.ORIGINAL_ALGORITHM)  # FTS5's porter is the original


@lru_cache(maxsize=65536)
def _stem(word: str) -> str:
    return _porter.stem(word.lower())


def _indexed_rows(s) -> int:
    key = id(s.get_bind())
    hit = _rows_cache.get(key)
    if hit is not None and time.monotonic() - hit[0] < _ROWS_TTL_S:
        return hit[1]
    n = int(s.execute(text("SELECT count(*) FROM messages")).scalar() or 0)
    _rows_cache[key] = (time.monotonic(), n)
    return n


def _drop_common(s, terms: list[str]) -> list[str]:
    """`terms` without the very common words (see the module docstring); the rarest word stays
    when all are common. A word whose stem the vocabulary does not know is kept."""
    rows = _indexed_rows(s)
    if rows <= COMMON_MIN_ROWS:
        return terms
    cap = max(COMMON_MIN_ROWS, COMMON_SHARE * rows)
    stems = {t: _stem(t) for t in terms}
    params = {f"s{i}": stem for i, stem in enumerate(sorted(set(stems.values())))}
    names = list(params)
    try:
        counts = dict(s.execute(text(f"SELECT term, doc FROM message_fts_vocab WHERE term IN "
                                     f"({', '.join(':' + n for n in names)})"), params).all())
    except Exception:  # a store from before migration 0008 that was not upgraded: keep every word
        return terms
    kept = [t for t in terms if counts.get(stems[t], 0) <= cap]
    return kept or [min(terms, key=lambda t: counts.get(stems[t], 0))]


def rebuild(fts: str) -> str:
    return f"INSERT INTO {fts}({fts}) VALUES ('rebuild')"


def _fts5_query(terms: list[str]) -> str:
    return " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)


BM25_K1, BM25_B = 1.2, 0.75  # PostgreSQL's ranking, as FTS5's bm25() sets them
PG_KEYS_WEIGHT = 0.35  # a word found only in a message's captions (`keys`), as _BM25_WEIGHTS


def _pg_bm25(terms: list[str], table: str, extra: str, weighted: bool, params: dict, rows: int | None = None) -> str:
    """PostgreSQL's statement for the BM25 ranking FTS5 gives. `ts_rank_cd` weighs
    every word alike, with no inverse document frequency: "today" counted as much as "cello",
    and the full-text ranking alone found 0.597 of the second hand-written set's evidence where
    FTS5's bm25 finds 0.647. Here each query word that a row holds adds its idf over this
    user's rows, ln(1 + (N - df + 0.5) / (df + 0.5)) (df counted among the rows the query
    matches), a word found only in the captions PG_KEYS_WEIGHT of it, and the sum is scaled by
    the row's length against the matched rows' mean as bm25 does for a word said once
    ((k1 + 1) / (1 + k1 (1 - b + b len / avg)); chat turns rarely say a word twice). Each word
    is its own `websearch_to_tsquery` (plain words, never query syntax); a stop word of
    PostgreSQL's English dictionary matches nothing. N is `rows` where the caller knows it (the
    recall index holds the user's count); counting it here reads every index entry of the user,
    10 ms at 10,000 messages on a table not yet vacuumed."""
    n = len(terms)
    for i, t in enumerate(terms):
        params[f"t{i}"] = t.replace('"', "").replace("-", " ")
    queries = ", ".join(f"websearch_to_tsquery('english', :t{i}) AS q{i}" for i in range(n))
    anyq = " || ".join(f"q.q{i}" for i in range(n))
    # the text is weight A, the captions B (migration 0007): the text's own lexemes are filtered
    # out once a row (`a`), not once per word; memories index their text alone
    text_only = "ts_filter(m.search_tsv, '{a}')" if weighted else "m.search_tsv"
    flags = ", ".join(f"CASE WHEN r.a @@ q.q{i} THEN 1.0 WHEN r.v @@ q.q{i} THEN {PG_KEYS_WEIGHT} ELSE 0.0 END "
                      f"AS f{i}" for i in range(n))
    dfs = ", ".join(f"count(*) FILTER (WHERE f{i} > 0) AS d{i}" for i in range(n))
    if rows is not None:
        params["rows"] = max(int(rows), 1)
        count = "greatest(CAST(:rows AS bigint), count(*))"  # never fewer than the rows matched
    else:
        count = f"(SELECT count(*) FROM {table} WHERE tenant_id = :tenant AND user_id = :user)"
    idf = " + ".join(f"h.f{i} * ln(1 + (st.n - st.d{i} + 0.5) / (st.d{i} + 0.5))" for i in range(n))
    return (f"WITH q AS (SELECT {queries}), "
            f"matched AS (SELECT m.id, m.search_tsv AS v, {text_only} AS a FROM {table} m, q "
            f"WHERE m.search_tsv @@ ({anyq}) AND m.tenant_id = :tenant AND m.user_id = :user{extra}), "
            f"hits AS (SELECT r.id, length(r.v) AS len, {flags} FROM matched r, q), "
            f"st AS (SELECT {count} AS n, "
            f"greatest(avg(len), 1) AS avglen, {dfs} FROM hits) "
            f"SELECT h.id, ({idf}) * {BM25_K1 + 1} / (1 + {BM25_K1} * (1 - {BM25_B} + {BM25_B} * h.len / st.avglen)) "
            "AS score FROM hits h, st ORDER BY score DESC, h.id DESC LIMIT :limit")


def _filters(exclude: list[int], since, until, timed: bool, speakers: list[str] | None = None) -> tuple[str, dict]:
    sql, params = "", {}
    if speakers is not None:
        names = [f"n{i}" for i in range(len(speakers))]
        sql += f" AND m.name IN ({', '.join(':' + n for n in names)})" if names else " AND 1 = 0"
        params.update(zip(names, speakers, strict=True))
    if exclude:
        names = [f"x{i}" for i in range(len(exclude))]
        sql += f" AND m.id NOT IN ({', '.join(':' + n for n in names)})"
        params.update(zip(names, exclude, strict=True))
    when = "coalesce(m.event_time, m.created_at)"
    if since is not None and timed:
        sql += f" AND {when} >= :since"
        params["since"] = since
    if until is not None and timed:
        sql += f" AND {when} <= :until"
        params["until"] = until
    return sql, params


def search(s, tenant_id: str, user_id: str, terms: list[str], limit: int, exclude: list[int],
           since: datetime | None, until: datetime | None, what: str = "messages",
           speakers: list[str] | None = None, rows: int | None = None) -> list[tuple[int, float]]:
    """(row id, score) of `what` ("messages" or active "memories"), best first; scores are
    larger-is-better on both databases. `speakers`: only messages by these names."""
    if not terms or limit <= 0:
        return []
    fts = "message_fts" if what == "messages" else "memory_fts"
    table = _SPECS[fts][0]
    extra, params = _filters(exclude if what == "messages" else [], since, until, timed=True,
                             speakers=speakers if what == "messages" else None)
    if what == "memories":
        extra += " AND m.status = 'active'"
    params.update(tenant=tenant_id, user=user_id, limit=limit)
    dialect = s.get_bind().dialect.name
    if dialect == "sqlite":
        params["q"] = _fts5_query(_drop_common(s, terms) if fts == "message_fts" else terms)
        w = _BM25_WEIGHTS[fts]
        sql = (f"SELECT m.id, -bm25({fts}, {w}) AS score FROM {fts} JOIN {table} m "
               f"ON m.id = {fts}.rowid WHERE {fts} MATCH :q AND m.tenant_id = :tenant "
               f"AND m.user_id = :user{extra} ORDER BY bm25({fts}, {w}) LIMIT :limit")
    elif dialect == "postgresql":
        sql = _pg_bm25(terms, table, extra, weighted=fts == "message_fts", params=params, rows=rows)
    else:
        return []
    return [(int(i), float(score)) for i, score in s.execute(text(sql), params)]


def ensure_index(conn) -> None:
    """Re-create missing SQLite full-text tables or triggers (a later rebuild of a table drops
    its triggers) and rebuild that index from its table: it must never silently fall behind."""
    if conn.dialect.name != "sqlite":
        return
    have = {r[0] for r in conn.execute(text("SELECT name FROM sqlite_master WHERE type IN ('trigger', 'table')"))}
    for fts, (create, triggers) in SQLITE_DDL.items():
        missing = [t for t in triggers if t.split()[2] not in have]
        if fts in have and not missing:
            continue
        if fts not in have:
            conn.execute(text(create))
        for stmt in missing:
            conn.execute(text(stmt))
        conn.execute(text(rebuild(fts)))
