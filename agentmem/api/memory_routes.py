"""Memory, session and trace endpoints, all under `/v1` and all scoped to the caller's tenant.

Paths name a user (`/v1/users/{user_id}/...`); a user, session or memory id of another
tenant answers 404 with the same body as a missing one, because every store call carries the
caller's tenant. Reads of a user that does not exist are 404; writes create the user.
"""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Body, Depends, Path, Query, Request, Response

from ..tiers.records import NotFound
from ..tiers.scope import InvalidId, check_id
from ..tiers.sizes import KIND_CHARS, LABEL_CHARS
from ..tiers.transfer import check_counts
from .deps import Caller, caller, services
from .errors import ApiError
from .inputs import check_ids
from .pages import DEFAULT_LIMIT, MAX_LIMIT, bad_cursor, decode_cursor, encode_cursor, page, page_limit
from .schemas import ContextIn, CoreBlockIn, MemoryIn, MemoryPatch, MessagesIn, SearchIn, storable


def _ids(request: Request) -> None:
    """Every user and session id a path or query names is in the id alphabet (tiers/scope.py),
    or a 400 naming it: an id that could not round-trip through a URL is never accepted."""
    for where in (request.path_params, request.query_params):
        for name in ("user_id", "session_id"):
            value = where.get(name)
            if value is not None:
                try:
                    check_id(value, name)
                except InvalidId as exc:
                    raise ApiError(400, str(exc), code="invalid_id", param=name) from None


router = APIRouter(prefix="/v1", tags=["memory"], dependencies=[Depends(_ids)])

UserId = Path(description="the user id, as given in chat `user`: 1-128 of A-Z a-z 0-9 _ - . @ :")
MemoryId = Path(ge=1, le=2**63 - 1, description="a memory id (from listing or adding memories)")
Limit = Query(None, description=f"page size, 1-{MAX_LIMIT} (default {DEFAULT_LIMIT}); over it is a 400")
Cursor = Query(None, description="the `next_cursor` of the previous page (opaque)")
TURNS_LIMIT = 50


def _user(svc, tenant_id: str, user_id: str) -> None:
    if not svc.store.archive.user_exists(tenant_id, user_id):
        raise NotFound(f"user {user_id!r} not found")


# --- tenant and users ---------------------------------------------------------------------
@router.get("/tenant")
def get_tenant(who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """The caller's tenant."""
    t = next((t for t in svc.store.list_tenants() if t.id == who.tenant_id), None)
    if t is None:
        raise NotFound("tenant not found")
    return t.to_dict()


@router.delete("/tenant")
def delete_tenant(who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """Delete the caller's tenant: every user's rows, vectors and cached KV, and its keys."""
    svc.store.delete_tenant(who.tenant_id)
    return {"id": who.tenant_id, "deleted": True}


@router.get("/users")
def list_users(limit: int | None = Limit, cursor: str | None = Cursor, who: Caller = Depends(caller),
               svc=Depends(services)) -> dict:
    """The tenant's users by id, a page at a time (`limit`, `cursor` -> `next_cursor`)."""
    n = page_limit(limit)
    after = decode_cursor(cursor, "users", (str,))
    return page(svc.store.list_users(who.tenant_id, after[0] if after else None, n + 1), n, "users", lambda u: [u.id])


@router.delete("/users/{user_id}")
def delete_user(user_id: str = UserId, who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """Delete a user in every tier: archive rows, recall vectors, cached KV."""
    svc.store.delete_user(who.tenant_id, user_id)
    return {"id": user_id, "deleted": True}


# --- memories -----------------------------------------------------------------------------
@router.get("/users/{user_id}/memories")
def list_memories(user_id: str = UserId, status: str | None = Query(None, description="active | superseded | all"),
                  kind: str | None = Query(None, max_length=KIND_CHARS), limit: int | None = Limit,
                  cursor: str | None = Cursor, who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """Facts and insights with their status and links (source message ids, superseded_by), by id."""
    n = page_limit(limit)
    after = decode_cursor(cursor, "memories", (int,))
    _user(svc, who.tenant_id, user_id)
    rows = svc.store.list_memories(who.tenant_id, user_id, None if status == "all" else status, kind,
                                   after[0] if after else 0, n + 1)
    return page(rows, n, "memories", lambda m: [m.id])


@router.post("/users/{user_id}/memories", status_code=201)
def add_memory(body: MemoryIn, user_id: str = UserId, who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    _check_len(svc, body.text, "text")
    with svc.slots.hold(who.tenant_id):
        return svc.store.add_memory(who.tenant_id, user_id, body.text, body.importance, kind=body.kind,
                                    event_time=body.event_time).to_dict()


@router.get("/users/{user_id}/memories/{memory_id}")
def get_memory(memory_id: int = MemoryId, user_id: str = UserId, who: Caller = Depends(caller),
               svc=Depends(services)) -> dict:
    return svc.store.get_memory(who.tenant_id, user_id, memory_id).to_dict()


@router.patch("/users/{user_id}/memories/{memory_id}")
def update_memory(body: MemoryPatch, memory_id: int = MemoryId, user_id: str = UserId,
                  who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """Correct a memory's text (its compressed form is dropped) or importance."""
    if body.text is not None:
        _check_len(svc, body.text, "text")
    fields = {"importance": body.importance} if body.importance is not None else {}
    return svc.store.update_memory(who.tenant_id, user_id, memory_id, body.text, **fields).to_dict()


@router.delete("/users/{user_id}/memories/{memory_id}")
def delete_memory(memory_id: int = MemoryId, user_id: str = UserId, who: Caller = Depends(caller),
                  svc=Depends(services)) -> dict:
    svc.store.delete_memory(who.tenant_id, user_id, memory_id)
    return {"id": memory_id, "deleted": True}


@router.post("/users/{user_id}/search")
def search(body: SearchIn, user_id: str = UserId, who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """Recall: messages and memories ranked by similarity x recency x importance."""
    _check_len(svc, body.query, "query")
    _user(svc, who.tenant_id, user_id)
    with svc.slots.hold(who.tenant_id):
        hits = svc.store.search(who.tenant_id, user_id, body.query, body.k, body.since, body.until)
    return {"object": "list", "data": [h.to_dict() | {"ref": h.ref} for h in hits]}


@router.post("/users/{user_id}/context")
def context(body: ContextIn, user_id: str = UserId, who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """The prompt a chat turn with `query` would be given now, segment by segment; nothing is stored."""
    from ..session import preview_context

    _check_len(svc, body.query, "query")
    _user(svc, who.tenant_id, user_id)
    return preview_context(svc.store, svc.engine(), svc.config, who.tenant_id, user_id, body.query).to_dict()


# --- core memory ----------------------------------------------------------------------------
@router.get("/users/{user_id}/core")
def core_blocks(user_id: str = UserId, limit: int | None = Limit, cursor: str | None = Cursor,
                who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """The user's core blocks by label."""
    n = page_limit(limit)
    after = decode_cursor(cursor, "core", (str,))
    _user(svc, who.tenant_id, user_id)
    return page(svc.store.core_blocks(who.tenant_id, user_id, after[0] if after else None, n + 1), n, "core",
                lambda b: [b.label])


@router.put("/users/{user_id}/core/{label}")
def set_core_block(body: CoreBlockIn, user_id: str = UserId, label: str = Path(min_length=1, max_length=LABEL_CHARS),
                   who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    _check_len(svc, body.value, "value")
    return svc.store.set_core_block(who.tenant_id, user_id, label, body.value, body.limit,
                                    expected_version=body.version).to_dict()


# --- sessions, messages, traces --------------------------------------------------------------
@router.get("/users/{user_id}/sessions")
def list_sessions(user_id: str = UserId, limit: int | None = Limit, cursor: str | None = Cursor,
                  who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """The user's sessions, oldest first (by creation time, then id)."""
    n = page_limit(limit)
    after = decode_cursor(cursor, "sessions", (str, str))
    key = None
    if after:
        try:
            key = (datetime.fromisoformat(after[0]), after[1])
        except ValueError:
            bad_cursor("sessions")
    _user(svc, who.tenant_id, user_id)
    return page(svc.store.list_sessions(who.tenant_id, user_id, key, n + 1), n, "sessions",
                lambda s: [s.created_at.isoformat(), s.id])


@router.get("/users/{user_id}/sessions/{session_id}/messages")
def session_messages(session_id: str = Path(description="a session id"), user_id: str = UserId,
                     limit: int | None = Limit, cursor: str | None = Cursor, who: Caller = Depends(caller),
                     svc=Depends(services)) -> dict:
    """The session's messages, oldest first (by id)."""
    n = page_limit(limit)
    after = decode_cursor(cursor, "messages", (int,))
    rows = svc.store.session_messages(who.tenant_id, user_id, session_id, after[0] if after else 0, n + 1)
    return page(rows, n, "messages", lambda m: [m.id])


@router.post("/users/{user_id}/messages", status_code=201)
def add_messages(body: MessagesIn, user_id: str = UserId, who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """Store history without generating; committed (durable) before this answers."""
    for i, m in enumerate(body.messages):  # all checked before the session is opened: a refusal stores nothing
        storable(m.content, f"messages.{i}.content")
        _check_len(svc, m.content, f"messages.{i}.content")
    if body.session_id is not None:
        check_ids(None, body.session_id)
    if len(body.messages) > svc.limits.max_messages:
        raise ApiError(400, f"at most {svc.limits.max_messages} messages per request", code="too_many_messages",
                       param="messages")
    with svc.slots.hold(who.tenant_id):
        sid = body.session_id or svc.store.latest_session(who.tenant_id, user_id)
        info = svc.store.open_session(who.tenant_id, user_id, sid)
        stored = svc.store.add_messages(who.tenant_id, user_id, info.id,
                                        [m.model_dump(exclude_none=True) for m in body.messages])
    return {"session_id": info.id, "object": "list", "data": [m.to_dict() for m in stored]}


@router.get("/users/{user_id}/turns")
def turns(user_id: str = UserId, session_id: str | None = Query(None),
          limit: int | None = Query(None, description=f"page size, 1-{MAX_LIMIT} (default {TURNS_LIMIT})"),
          cursor: str | None = Cursor, who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """Per-turn traces: prompt segments by tier with tokens and KV fate (reused / blended /
    prefilled), memories used, TTFT and token counts. The first page holds the newest turns,
    each page oldest first; `next_cursor` goes back to older ones."""
    n = page_limit(limit, TURNS_LIMIT)
    before = decode_cursor(cursor, "turns", (int,))
    _user(svc, who.tenant_id, user_id)
    rows = svc.store.turns(who.tenant_id, user_id, session_id, n + 1, before[0] if before else None)
    more, rows = len(rows) > n, rows[-n:]
    return {"object": "list", "data": [t.to_dict() for t in rows],
            "next_cursor": encode_cursor("turns", [rows[0].id]) if more else None}


@router.get("/stats/cache")
def cache_stats(who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """The tenant's recent turns as a time series of cache hit ratio and TTFT (since start)."""
    points = svc.metrics.series(who.tenant_id)
    prompt = sum(p["prompt_tokens"] for p in points)
    reused = sum(p["reused_tokens"] for p in points)
    return {"object": "list", "data": points, "cache_hit_ratio": reused / prompt if prompt else 0.0}


# --- export / import ----------------------------------------------------------------------
@router.get("/users/{user_id}/export")
def export_user(user_id: str = UserId, who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """The user's whole memory as one JSON document (sessions, messages, memories, core blocks)."""
    return svc.store.export_user(who.tenant_id, user_id)


@router.post("/users/{user_id}/import", status_code=201,
             responses={200: {"description": "the document was there already: nothing changed"}})
def import_user(response: Response, doc: dict = Body(..., description="a document from GET .../export"),
                user_id: str = UserId, who: Caller = Depends(caller), svc=Depends(services)) -> dict:
    """All or nothing, faithful (ids, texts and times kept; the ids that had to change are in
    `id_map`) and idempotent: importing the same document again changes nothing and answers
    200. Counts are checked before any row is read, texts against the live endpoints' limits."""
    lim = svc.limits
    limits = {"sessions": lim.max_import_sessions, "messages": lim.max_import_messages,
              "memories": lim.max_import_memories, "core_blocks": lim.max_import_blocks}
    check_counts(doc, limits)
    for key, field in (("messages", "text"), ("memories", "text"), ("memories", "compressed_text")):
        for i, row in enumerate(doc[key]):
            if isinstance(row, dict) and isinstance(row.get(field), str):
                _check_len(svc, row[field], f"{key}.{i}.{field}")
    with svc.slots.hold(who.tenant_id):
        out = svc.store.import_user(who.tenant_id, user_id, doc, limits)
    if out["unchanged"]:
        response.status_code = 200
    return out


def _check_len(svc, value: str, param: str) -> None:
    if len(value) > svc.limits.max_message_chars:
        raise ApiError(400, f"{param} is longer than {svc.limits.max_message_chars} characters",
                       code="message_too_long", param=param)
