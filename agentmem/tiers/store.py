"""`MemoryStore`: the tenant-scoped facade over the archive and the recall index.

Plain methods with the scope as arguments (the mem0 shape), shared by `AgentSession` and
the REST service. Writes go to SQL first and are committed before the recall index is
touched, so the index can always be rebuilt from the archive.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Collection, Iterable
from datetime import datetime

from ..config import Config, private_dir
from . import records as R
from . import transfer
from .archive import Archive, clean_text
from .recall import Recall

# called as hook(tenant_id, user_id or None) after a user or a whole tenant is deleted,
# e.g. to drop cached KV of that scope
ForgetHook = Callable[[str, str | None], None]


class MemoryStore:
    def __init__(self, config: Config | None = None, embedder=None):
        self.config = config or Config()
        private_dir(self.config.data_dir)
        self.archive = Archive(self.config.resolved_db_url(), self.config.db_sync)
        self._embedder = embedder
        self._embedder_lock = threading.Lock()
        self.embed_bulk_threads = self.config.embed_bulk_threads or None  # None: every core
        url_key = hashlib.sha256(self.archive.url.encode()).hexdigest()[:16]
        self.recall = Recall(self.archive, self.embedder_instance, self.config.data_dir / "recall" / url_key,
                             cache_bytes=self.config.recall_cache_mb << 20, whiten_pcs=self.config.recall_whiten_pcs)
        self.forget_hooks: list[ForgetHook] = []

    @property
    def embedder_loaded(self) -> bool:
        return self._embedder is not None

    def embedder_instance(self):
        """The embedder, loaded on first use (the archive alone needs no model)."""
        with self._embedder_lock:
            if self._embedder is None:
                from .embed import load_embedder

                self._embedder = load_embedder(self.config.embed_model_path, self.config.embed_dtype,
                                               self.embed_bulk_threads, self.config.embed_bulk_nice)
            return self._embedder

    def set_bulk_threads(self, n: int | None) -> None:
        """Threads that indexing may use from now on (None: every core)."""
        self.embed_bulk_threads = n
        with self._embedder_lock:
            if self._embedder is not None and hasattr(self._embedder, "bulk_threads"):
                self._embedder.bulk_threads = n

    def close(self) -> None:
        self.recall.close()
        self.archive.close()

    # --- tenants, keys, users ----------------------------------------------------------------
    def create_tenant(self, name: str) -> str:
        return self.archive.create_tenant(name)

    def ensure_tenant(self, tenant_id: str, name: str | None = None) -> None:
        self.archive.ensure_tenant(tenant_id, name)

    def list_tenants(self) -> list[R.Tenant]:
        return self.archive.list_tenants()

    def delete_tenant(self, tenant_id: str) -> None:
        self.archive.delete_tenant(tenant_id)
        self.recall.drop_tenant(tenant_id)
        for hook in self.forget_hooks:
            hook(tenant_id, None)

    def add_api_key(self, tenant_id: str, key_hash: str, name: str = "") -> None:
        self.archive.add_api_key(tenant_id, key_hash, name)

    def tenant_for_key_hash(self, key_hash: str) -> str | None:
        return self.archive.tenant_for_key_hash(key_hash)

    def list_users(self, tenant_id: str, after: str | None = None, limit: int | None = None) -> list[R.User]:
        """By id; `after`, `limit`: one page (the users after that id)."""
        return self.archive.list_users(tenant_id, after, limit)

    def delete_user(self, tenant_id: str, user_id: str) -> None:
        """Delete the user's rows, vectors and (through the hooks) cached KV."""
        self.archive.delete_user(tenant_id, user_id)
        self.recall.drop(tenant_id, user_id)
        for hook in self.forget_hooks:
            hook(tenant_id, user_id)

    # --- sessions and messages ---------------------------------------------------------------
    def open_session(self, tenant_id: str, user_id: str, session_id: str | None = None) -> R.SessionInfo:
        return self.archive.open_session(tenant_id, user_id, session_id)

    def list_sessions(self, tenant_id: str, user_id: str, after: tuple[datetime, str] | None = None,
                      limit: int | None = None) -> list[R.SessionInfo]:
        """By (created_at, id); `after`, `limit`: one page (the sessions after that key)."""
        return self.archive.list_sessions(tenant_id, user_id, after, limit)

    def latest_session(self, tenant_id: str, user_id: str) -> str | None:
        """The session a call that names none continues: the user's default conversation (the
        one a stateless chat without `session_id` uses) when it exists, else the newest."""
        return self.archive.latest_session(tenant_id, user_id, prefer=default_session_id(tenant_id, user_id))

    def session_messages(self, tenant_id: str, user_id: str, session_id: str, after_id: int = 0,
                         limit: int | None = None) -> list[R.Message]:
        return self.archive.messages(tenant_id, user_id, session_id=session_id, after_id=after_id, limit=limit)

    def add_messages(self, tenant_id: str, user_id: str, session_id: str, messages: Iterable[dict]) -> list[R.Message]:
        """Commit messages to the archive (the full-text index with them, in the same
        transaction). The dense index embeds them on its next use: a write never waits for
        embeddings, and a bulk import embeds in large batches."""
        return self.archive.append_messages(tenant_id, user_id, session_id, messages)

    # --- memories ----------------------------------------------------------------------------
    def add_memory(self, tenant_id: str, user_id: str, text: str, importance: float = 0.5,
                   source_ids: Iterable[int] = (), kind: str = "fact", event_time: datetime | None = None,
                   compressed_text: str | None = None, create_user: bool = True) -> R.Memory:
        """`create_user=False`: background writers (reflection) never recreate a deleted user."""
        m = self.archive.add_memory(tenant_id, user_id, text, importance, source_ids, kind, event_time,
                                    compressed_text, create_user)
        self.recall.sync(tenant_id, user_id)
        return m

    def list_memories(self, tenant_id: str, user_id: str, status: str | None = None,
                      kind: str | None = None, after_id: int = 0, limit: int | None = None) -> list[R.Memory]:
        return self.archive.list_memories(tenant_id, user_id, status, kind, after_id, limit)

    def get_memory(self, tenant_id: str, user_id: str, id: int) -> R.Memory:
        return self.archive.get_memory(tenant_id, user_id, id)

    def update_memory(self, tenant_id: str, user_id: str, id: int, text: str | None = None, **fields) -> R.Memory:
        """Change text and/or compressed_text, importance, status, superseded_by."""
        m = self.archive.update_memory(tenant_id, user_id, id, text, **fields)
        self.recall.sync(tenant_id, user_id)
        return m

    def correct_memory(self, tenant_id: str, user_id: str, memory_id: int, text: str) -> R.Memory:
        """The user's correction of a memory: a new memory with the same sources, kind and
        importance supersedes the old one, which stays in the archive linked to it."""
        old = self.get_memory(tenant_id, user_id, memory_id)
        if old.status != "active":
            raise R.InvalidInput(f"memory {memory_id} is {old.status}: correct its successor {old.superseded_by}")
        new = self.add_memory(tenant_id, user_id, text, old.importance, old.source_ids, old.kind, old.event_time)
        self.supersede(tenant_id, user_id, old.id, new.id)
        return new

    def supersede(self, tenant_id: str, user_id: str, old_id: int, new_id: int) -> R.Memory:
        """Mark `old_id` superseded by `new_id` (reflection does this when a fact changes)."""
        return self.update_memory(tenant_id, user_id, old_id, superseded_by=new_id)

    def delete_memory(self, tenant_id: str, user_id: str, id: int) -> None:
        self.archive.delete_memory(tenant_id, user_id, id)
        self.recall.sync(tenant_id, user_id)

    def search(self, tenant_id: str, user_id: str, query: str, k: int = 10, since: datetime | None = None,
               until: datetime | None = None, exclude_messages: Collection[int] = frozenset(), *,
               retrievers: Collection[str] | None = None, own_replies: bool = True) -> list[R.Hit]:
        """Hybrid recall (tiers/recall/): full-text, dense, in-context dense and reflected facts,
        fused; each hit says which `retrievers` found it. Pass `retrievers` to use a subset.
        `own_replies=False` leaves out the assistant's own replies (unnamed assistant turns;
        an imported conversation's named speakers stay), as the prompt's notes do."""
        query = clean_text(query, "query")
        if not self.archive.user_exists(tenant_id, user_id):
            return []
        return self.recall.search(tenant_id, user_id, query, k, since, until, exclude_messages,
                                  retrievers=retrievers, own_replies=own_replies)

    # --- core memory, summaries, traces ------------------------------------------------------
    def core_blocks(self, tenant_id: str, user_id: str, after: str | None = None,
                    limit: int | None = None) -> list[R.CoreBlock]:
        return self.archive.core_blocks(tenant_id, user_id, after, limit)

    def set_core_block(self, tenant_id: str, user_id: str, label: str, value: str,
                       limit: int | None = None, create_user: bool = True,
                       expected_version: int | None = None) -> R.CoreBlock:
        """`expected_version`: the block's `version` as read; `Conflict` if it changed since."""
        return self.archive.set_core_block(tenant_id, user_id, label, value, limit, create_user,
                                           expected_version=expected_version)

    def core_block_history(self, tenant_id: str, user_id: str, label: str | None = None) -> list[R.CoreBlockEdit]:
        return self.archive.core_block_history(tenant_id, user_id, label)

    def record_turn(self, tenant_id: str, user_id: str, session_id: str, trace: dict) -> R.Turn:
        return self.archive.record_turn(tenant_id, user_id, session_id, trace)

    def turns(self, tenant_id: str, user_id: str, session_id: str | None = None, limit: int = 50,
              before_id: int | None = None) -> list[R.Turn]:
        """The newest `limit` turns (before `before_id` if given), oldest first."""
        return self.archive.turns(tenant_id, user_id, session_id, limit, before_id)

    # --- export / import ---------------------------------------------------------------------
    def export_user(self, tenant_id: str, user_id: str) -> dict:
        """Everything about one user as one JSON-ready document (tiers/transfer.py)."""
        return transfer.export_doc(self.archive, tenant_id, user_id)

    def import_user(self, tenant_id: str, user_id: str, doc: dict, limits: dict[str, int] | None = None) -> dict:
        """Load an `export_user` document under (tenant_id, user_id), all or nothing; ids,
        texts and times kept, a second import of the same document changes nothing
        (tiers/transfer.py). `limits`: the most sessions, messages, memories, core_blocks
        a document may hold, refused before any row is read. Returns what was created, and
        the ids that changed."""
        transfer.check_counts(doc, limits or {})
        out = transfer.import_doc(self.archive, tenant_id, user_id, transfer.parse(doc))
        self.recall.sync(tenant_id, user_id)
        return out


def default_session_id(tenant_id: str, user_id: str) -> str:
    """A user's default conversation, stable across restarts and distinct across tenants."""
    return "default-" + hashlib.sha256(f"{tenant_id}\x00{user_id}".encode()).hexdigest()[:24]
