"""The one alphabet of user, session and tenant ids, checked wherever an id comes in.

An id names a path segment (`/v1/users/{user_id}/sessions/{session_id}/...`), a query value
and an MCP argument, so it must survive every one of them unchanged. Servers and proxies
decode `%2F` and normalise `.` and `..` before routing, and a form-encoded query reads `+`
as a space: an id holding any of those could be stored but never addressed again, not even
to delete it. So an id is 1-128 of `A-Z a-z 0-9 _ - . @ :`, starting with a letter, digit
or `_` (never `.` or `..`): e-mail addresses, UUIDs, `tenant:user` keys all fit.

Users stored before this check may hold other ids; `agentmem tenant fix-ids` finds them and
renames (or deletes) them so that every user can be deleted through the API.
"""

from __future__ import annotations

import re

from .records import InvalidInput
from .sizes import SESSION_ID_CHARS, USER_ID_CHARS

ID_CHARS_TEXT = "letters, digits, '_', '-', '.', '@' or ':', starting with a letter, digit or '_'"
_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@:-]*")
_MAX = {"user_id": USER_ID_CHARS, "session_id": SESSION_ID_CHARS}


class InvalidId(InvalidInput):
    """An id outside the alphabet; `param` names the field (the REST answer's `param`)."""

    code = "invalid_id"

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def addressable(value: object, max_chars: int = USER_ID_CHARS) -> bool:
    return isinstance(value, str) and len(value) <= max_chars and _ID.fullmatch(value) is not None


def check_id(value: object, param: str, kind: str | None = None) -> str:
    """`value` if it is a valid id, else InvalidId naming `param`. `kind` (user_id,
    session_id, tenant_id; default: `param`'s last part) picks the length limit."""
    kind = kind or param.rsplit(".", 1)[-1]
    limit = _MAX.get(kind, USER_ID_CHARS)
    if not isinstance(value, str):
        raise InvalidId(f"{param} must be a string, got {type(value).__name__}", param)
    if not addressable(value, limit):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise InvalidId(f"{param} must be 1-{limit} {ID_CHARS_TEXT}; got {shown!r}", param)
    return value
