"""LangGraph's `BaseStore` on agentmem (`agentmem[langgraph]`).

    store = AgentmemStore("default", store=memory_store)
    graph = builder.compile(store=store)
    # in a node: runtime.store.put(("memories", user_id), "food", {"text": "Ana is vegetarian"})
    #            runtime.store.search(("memories", user_id), query="what does Ana eat?")

Namespaces and users. The store is bound to one tenant. Each namespace belongs to one of its
users: the label at `user_index`, by default 1, LangGraph's `("memories", user_id)` shape (0
for `(user_id, "memories")`, -1 for the last label). A namespace too short to have that label
belongs to the tenant's user `SHARED_USER`. Items are read by their namespace, never by user
alone, so one namespace never sees another's items whatever their users; the user decides
whose memory an item's text is, and deleting that user (`MemoryStore.delete_user`) deletes
the user's items with the rest of their memory. Another tenant's store sees none of them.

Items. An item is a row of `store_items` (tiers/store_items.py); its searchable text is a
memory of the user, of kind "store", written in the same transaction as the row, replaced
when the text changes and deleted with the item. So the user's chat recall
(`AgentSession`, the REST service) finds what a graph stored, and a search with a query is
agentmem's hybrid recall (`MemoryStore.search`: full-text and dense over the memories,
fused), which only ever sees current values. The text: `put`'s `index` (LangGraph's field
paths, "$" for the whole value) or False for none; with None, the store's `fields`, and
without those the value's strings, nested ones included, one per line (its JSON when it has
no string). All of an item's texts make one memory (LangGraph's vector stores embed each
path alone and keep the best).

Search. Without a query: the items under the prefix passing `filter`, a namespace's items
together in the order they were first put, namespaces in the order of their oldest item;
then `offset` and `limit`. With a query: those items ranked by recall, best first, each with
its recall score; after them, with score None, the ones recall did not return (not indexed,
or beyond its candidates). `filter` matches value fields exactly, nested dicts field by
field, lists element by element, and takes the operators $eq, $ne, $gt, $gte, $lt, $lte (a
field an item lacks, or one that is no number, is in no range; InMemoryStore raises there).
A search reads every item under its prefix (the filter is LangGraph's JSON semantics, run
here); with a query it asks each user's recall for as many hits as it has items plus
`MESSAGE_ROOM`, because the user's messages rank among its memories.

A batch runs as LangGraph's own stores run it: its reads see the store as it was before the
batch, then its puts are applied (the last put of a key wins) in one transaction, all or
none. The same results as `InMemoryStore` for the same operations, except: an update keeps
the item's `created_at` (as LangGraph's PostgresStore does; InMemoryStore stamps it anew);
`list_namespaces` lists namespaces holding items (InMemoryStore also lists those emptied, or
only ever read); a query is always recall's, with no index configuration to ask for it. No
TTLs (`supports_ttl` is False). `abatch` runs the batch in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import operator
import threading
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.exc import IntegrityError

from ..config import Config
from ..tiers import InvalidInput, MemoryStore, NotFound, clean_text, store_items
from ..tiers.session_items import check_item
from ..tiers.sizes import ITEM_KEY_CHARS, NAMESPACE_CHARS
from ..tiers.store_items import SEP, StoreItem
from . import require

require("langgraph", "langgraph")

from langgraph.store.base import (  # noqa: E402
    BaseStore,
    GetOp,
    InvalidNamespaceError,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    get_text_at_path,
)

SHARED_USER = "_shared"  # the user of namespaces too short to name one
MEMORY_KIND = "store"
# Store items are memories: recall's message views would only add candidates dropped here.
RETRIEVERS = ("lexical", "facts")
# Messages a recall may rank beside the user's memories: its message candidates and the turns
# next to them. Asking for this many more hits than there are items leaves every item recall
# found among them.
MESSAGE_ROOM = 300
_ORDER = {"$gt": operator.gt, "$gte": operator.ge, "$lt": operator.lt, "$lte": operator.le}


class AgentmemStore(BaseStore):
    """A LangGraph store of tenant `tenant_id`. `store`: a `MemoryStore` shared with the app;
    without one, the store opens its own from `config` and `close()` closes it.
    `user_index`: which namespace label is the user (see the module's docstring).
    `fields`: the value paths indexed when a put gives no `index`."""

    def __init__(self, tenant_id: str = "default", *, store: MemoryStore | None = None,
                 config: Config | None = None, user_index: int = 1, fields: Sequence[str] | None = None):
        self.tenant_id = clean_text(tenant_id, "tenant_id")
        self.store = store if store is not None else MemoryStore(config)
        self._owns_store = store is None
        self.user_index = user_index
        self.fields = None if fields is None else list(fields)
        self._clock = threading.Lock()
        self._last_stamp = datetime.min.replace(tzinfo=UTC)

    def close(self) -> None:
        if self._owns_store:
            self.store.close()

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        ops = list(ops)
        for op in ops:
            _check_labels(op)
        results: list[Result] = []
        puts: dict[tuple[tuple[str, ...], str], PutOp] = {}
        for op in ops:
            if isinstance(op, GetOp):
                results.append(self._get(op))
            elif isinstance(op, SearchOp):
                results.append(self._search(op))
            elif isinstance(op, ListNamespacesOp):
                results.append(self._list_namespaces(op))
            elif isinstance(op, PutOp):
                puts[(tuple(op.namespace), op.key)] = op
                results.append(None)
            else:
                raise ValueError(f"unknown store operation {type(op).__name__}")
        if puts:
            self._apply(list(puts.values()))
        return results

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        return await asyncio.to_thread(self.batch, list(ops))

    # --- reads ---------------------------------------------------------------------------------
    def _get(self, op: GetOp) -> Item | None:
        found = store_items.get(self.store.archive, self.tenant_id, self._user(op.namespace), SEP.join(op.namespace),
                                op.key)
        return None if found is None else Item(value=found.value, key=found.key, namespace=tuple(op.namespace),
                                               created_at=found.created_at, updated_at=found.updated_at)

    def _search(self, op: SearchOp) -> list[SearchItem]:
        prefix = tuple(op.namespace_prefix)
        items = _namespaces_together(store_items.under(self.store.archive, self.tenant_id, SEP.join(prefix),
                                                       self._prefix_user(prefix)))
        if op.filter:
            items = [i for i in items if all(_matches(i.value.get(k), want) for k, want in op.filter.items())]
        ranked = self._ranked(items, op.query) if op.query and op.query.strip() else [(i, None) for i in items]
        return [SearchItem(namespace=tuple(i.namespace.split(SEP)), key=i.key, value=i.value,
                           created_at=i.created_at, updated_at=i.updated_at, score=score)
                for i, score in ranked[op.offset: op.offset + op.limit]]

    def _ranked(self, items: list[StoreItem], query: str) -> list[tuple[StoreItem, float | None]]:
        """Recall's ranking of `items` (each user's recall asked once), then the rest unscored."""
        by_user: dict[str, dict[int, StoreItem]] = {}
        for i in items:
            if i.memory_id is not None:
                by_user.setdefault(i.user_id, {})[i.memory_id] = i
        scored: list[tuple[StoreItem, float]] = []
        for user, by_memory in by_user.items():
            hits = self.store.search(self.tenant_id, user, query, k=len(by_memory) + MESSAGE_ROOM,
                                     retrievers=RETRIEVERS)
            scored += [(by_memory[h.id], h.score) for h in hits if h.kind == MEMORY_KIND and h.id in by_memory]
        scored.sort(key=lambda pair: -pair[1])
        found = {(i.namespace, i.key) for i, _ in scored}
        return [*scored, *((i, None) for i in items if (i.namespace, i.key) not in found)]

    def _list_namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        conditions = tuple(op.match_conditions or ())
        literal: tuple[str, ...] = ()  # the prefix's labels before its first wildcard narrow the query
        for c in conditions:
            if c.match_type == "prefix":
                head = tuple(c.path)
                head = head[: head.index("*")] if "*" in head else head
                literal = max(literal, head, key=len)
        found = [tuple(n.split(SEP)) for n in store_items.namespaces(self.store.archive, self.tenant_id,
                                                                     SEP.join(literal))]
        found = [ns for ns in found if all(_path_matches(c, ns) for c in conditions)]
        if op.max_depth is not None:
            found = list({ns[: op.max_depth] for ns in found})
        return sorted(found)[op.offset: op.offset + op.limit]

    # --- writes --------------------------------------------------------------------------------
    def _apply(self, puts: list[PutOp]) -> None:
        """Every put in one transaction, then the recall index of each user written to. A
        concurrent writer that inserted one of the same new items first makes the whole
        batch run again, as an update of it."""
        writes = [self._checked(op) for op in puts]
        for attempt in range(2):
            try:
                with self.store.archive.tx():
                    written = [user for ns, user, key, value, text in writes if self._write(ns, user, key, value, text)]
                break
            except IntegrityError:
                if attempt:
                    raise
        for user in dict.fromkeys(written):
            self.store.recall.sync(self.tenant_id, user)

    def _checked(self, op: PutOp) -> tuple[str, str, str, dict | None, str | None]:
        """(namespace, user, key, value, text) of a put, refused before anything is written."""
        if op.value is not None and not op.namespace:
            raise InvalidNamespaceError("Namespace cannot be empty.")
        ns = SEP.join(op.namespace)
        if len(ns) > NAMESPACE_CHARS:
            raise InvalidInput(f"namespace {op.namespace} is longer than {NAMESPACE_CHARS} characters joined")
        key = clean_text(op.key, "key", allow_empty=True)
        if len(key) > ITEM_KEY_CHARS:
            raise InvalidInput(f"key is longer than {ITEM_KEY_CHARS} characters")
        if op.value is None:
            return ns, self._user(op.namespace), key, None, None
        value = dict(op.value)
        check_item(value, f"the value of {key!r}")
        return ns, self._user(op.namespace), key, value, self._text(value, op.index)

    def _write(self, ns: str, user: str, key: str, value: dict | None, text: str | None) -> bool:
        """Whether anything was written (deleting a missing item writes nothing)."""
        archive = self.store.archive
        old = store_items.get(archive, self.tenant_id, user, ns, key)
        if value is None:
            if old is None:
                return False
            store_items.remove(archive, self.tenant_id, user, ns, key)
            self._drop_memory(user, old.memory_id)
            return True
        memory_id = self._memory(user, None if old is None else old.memory_id, text)
        store_items.put(archive, self.tenant_id, user, ns, key, value, memory_id, self._stamp())
        return True

    def _memory(self, user: str, memory_id: int | None, text: str | None) -> int | None:
        """The id of the memory holding `text` (None: no text, no memory): the item's own
        memory, rewritten only when its text changed."""
        archive = self.store.archive
        if text is None:
            self._drop_memory(user, memory_id)
            return None
        if memory_id is not None:
            try:
                if archive.get_memory(self.tenant_id, user, memory_id).text != text:
                    archive.update_memory(self.tenant_id, user, memory_id, text)
                return memory_id
            except NotFound:
                pass  # deleted as a memory (the REST API's memory routes): written anew
        return archive.add_memory(self.tenant_id, user, text, kind=MEMORY_KIND).id

    def _drop_memory(self, user: str, memory_id: int | None) -> None:
        if memory_id is None:
            return
        try:
            self.store.archive.delete_memory(self.tenant_id, user, memory_id)
        except NotFound:
            pass

    def _text(self, value: dict, index: Sequence[str] | bool | None) -> str | None:
        if index is False:
            return None
        paths = self.fields if index is None else index
        if paths is None:
            texts = _strings(value) or [json.dumps(value, sort_keys=True, ensure_ascii=False)]
        else:
            texts = [t for p in paths for t in get_text_at_path(value, p)]
        return "\n".join(t for t in texts if t.strip()) or None

    def _stamp(self) -> datetime:
        """Now, but later than every earlier stamp of this store: an item's `created_at` is
        its place in the listing, and two puts may fall in the same microsecond."""
        with self._clock:
            self._last_stamp = max(datetime.now(UTC), self._last_stamp + timedelta(microseconds=1))
            return self._last_stamp

    # --- namespaces and users ------------------------------------------------------------------
    def _user(self, namespace: Sequence[str]) -> str:
        if -len(namespace) <= self.user_index < len(namespace):
            return namespace[self.user_index]
        return SHARED_USER

    def _prefix_user(self, prefix: tuple[str, ...]) -> str | None:
        """The user of every namespace under `prefix`, when the prefix names it."""
        return prefix[self.user_index] if 0 <= self.user_index < len(prefix) else None


def _check_labels(op: Op) -> None:
    """A joined namespace must split back into the same labels, so none may be empty or hold
    SEP (LangGraph's own rule; its store methods check it, but `batch` takes ops as given)."""
    if isinstance(op, GetOp | PutOp):
        paths = [op.namespace]
    elif isinstance(op, SearchOp):
        paths = [op.namespace_prefix]
    elif isinstance(op, ListNamespacesOp):
        paths = [c.path for c in op.match_conditions or ()]
    else:
        return
    for path in paths:
        for label in path:
            if not isinstance(label, str) or not label or SEP in label or "\x00" in label:
                raise InvalidNamespaceError(f"namespace label {label!r} in {tuple(path)}: labels are non-empty "
                                            f"strings without {SEP!r} or NUL")


def _namespaces_together(items: list[StoreItem]) -> list[StoreItem]:
    """Oldest-first items regrouped: a namespace's together, namespaces by their oldest item."""
    groups: dict[str, list[StoreItem]] = {}
    for i in items:
        groups.setdefault(i.namespace, []).append(i)
    return [i for group in groups.values() for i in group]


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def _matches(value: Any, want: Any) -> bool:
    """One filter field against an item's value there (LangGraph's filter semantics)."""
    if isinstance(want, dict):
        if any(k.startswith("$") for k in want):
            return all(_compare(value, op, arg) for op, arg in want.items())
        return isinstance(value, dict) and all(_matches(value.get(k), v) for k, v in want.items())
    if isinstance(want, list | tuple):
        return (isinstance(value, list | tuple) and len(value) == len(want)
                and all(_matches(v, w) for v, w in zip(value, want, strict=True)))
    return value == want


def _compare(value: Any, op: str, arg: Any) -> bool:
    if op == "$eq":
        return value == arg
    if op == "$ne":
        return value != arg
    if op not in _ORDER:
        raise ValueError(f"unsupported filter operator {op!r}; known: $eq, $ne, {', '.join(_ORDER)}")
    try:
        return _ORDER[op](float(value), float(arg))
    except (TypeError, ValueError):
        return False  # a missing or non-numeric field is not in any range


def _path_matches(condition: MatchCondition, namespace: tuple[str, ...]) -> bool:
    path = tuple(condition.path)
    if len(namespace) < len(path):
        return False
    if condition.match_type == "prefix":
        part = namespace[: len(path)]
    elif condition.match_type == "suffix":
        part = namespace[len(namespace) - len(path):]
    else:
        raise ValueError(f"unsupported match type {condition.match_type!r}")
    return all(p == "*" or p == label for p, label in zip(path, part, strict=True))
