"""Pages of a listing: `limit` (a default, a maximum) and an opaque `cursor`.

Every listing endpoint answers `{"object": "list", "data": [...], "next_cursor": ...}`:
`next_cursor` is null on the last page, else the value to pass as `cursor` for the next one.
Pages follow a stable order (users and core blocks by id or label, sessions by creation
time then id, messages and memories by id; turns newest page first), keyed on the last row
returned, so rows added or deleted meanwhile never shift a page: walking every page sees
each row that existed throughout exactly once.

A cursor is base64url JSON naming its listing and the last key; one from another listing,
or one not made here, is a 400 `invalid_cursor`. A limit outside 1..`MAX_LIMIT` is a 400
`invalid_limit` naming `limit`.
"""

from __future__ import annotations

import base64
import binascii
import json

from .errors import ApiError

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


def page_limit(limit: int | None, default: int = DEFAULT_LIMIT, maximum: int = MAX_LIMIT) -> int:
    if limit is None:
        return default
    if not 1 <= limit <= maximum:
        raise ApiError(400, f"limit must be 1-{maximum}, got {limit}", code="invalid_limit", param="limit")
    return limit


def encode_cursor(listing: str, key: list) -> str:
    raw = json.dumps([listing, *key], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_cursor(cursor: str | None, listing: str, types: tuple[type, ...]) -> list | None:
    """The key `cursor` carries (None when no cursor was given); a cursor that is not one of
    `listing`'s, with a key of `types`, is a 400."""
    if cursor is None:
        return None
    if len(cursor) > 512:
        bad_cursor(listing)
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        value = json.loads(raw)
    except (binascii.Error, ValueError):
        value = None
    if (not isinstance(value, list) or len(value) != len(types) + 1 or value[0] != listing
            or not all(isinstance(v, t) and not isinstance(v, bool) for v, t in zip(value[1:], types, strict=True))):
        bad_cursor(listing)
    return value[1:]


def bad_cursor(listing: str):
    raise ApiError(400, f"cursor is not a cursor of this listing ({listing}): pass a next_cursor it returned",
                   code="invalid_cursor", param="cursor")


def page(items: list, limit: int, listing: str, key) -> dict:
    """`items`: up to `limit` + 1 rows in order (the extra one only says a next page exists);
    `key(item)`: the item's cursor key."""
    more = len(items) > limit
    items = items[:limit]
    return {"object": "list", "data": [i.to_dict() for i in items],
            "next_cursor": encode_cursor(listing, key(items[-1])) if more and items else None}
