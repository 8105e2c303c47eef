"""The size limits of stored fields, in one place: the SQL columns are declared from these
and the REST schemas validate against the same numbers, so input the API accepts always
fits the database (PostgreSQL enforces VARCHAR lengths; SQLite does not, which is how a
mismatch once hid until PostgreSQL raised on it). Times are bounded so that converting any
accepted offset to UTC stays inside the datetime range."""

from __future__ import annotations

from datetime import UTC, datetime

ID_CHARS = 64  # server-made ids (tenants)
SESSION_ID_CHARS = 128  # client-chosen session ids
USER_ID_CHARS = 128  # client-chosen user ids (the column is wider, see NAME_CHARS)
NAME_CHARS = 200  # tenant, agent and user names
KIND_CHARS = 32  # memory kind
LABEL_CHARS = 64  # core block label
ROLE_CHARS = 16
IDEMPOTENCY_KEY_CHARS = 255
NAMESPACE_CHARS = 512  # a framework store's namespace path, its labels joined (integrations/langgraph.py)
ITEM_KEY_CHARS = 255  # a framework store's item key
MAX_BLOCK_LIMIT = 100_000  # characters a core block may be limited to

# a time is stored as naive UTC; these bounds leave room for any UTC offset (+-1 day)
MIN_TIME = datetime(1, 1, 2, tzinfo=UTC)
MAX_TIME = datetime(9999, 12, 30, tzinfo=UTC)
