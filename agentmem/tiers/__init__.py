"""Tiered memory: archive (SQL), recall (FAISS per tenant/user), working context.

The public surface for other packages (the REST service, reflection, compression):

- `MemoryStore(config, embedder=None)`: every operation takes its scope (tenant_id,
  user_id) as arguments. An id from another tenant or user raises `NotFound`, exactly
  like a missing one. Bad text raises `InvalidInput`.
- Reflection writes facts with `store.add_memory(tenant, user, text, importance,
  source_ids=[message ids], kind="fact"|"insight", event_time=...)`, replaces a changed
  fact with `store.supersede(tenant, user, old_id, new_id)` and merges with
  `store.update_memory(tenant, user, id, text)`. It reads sessions with
  `store.list_sessions` / `store.session_messages`. Superseded memories stay in the
  archive (with `superseded_by`) but are never recalled.
- Compression fills `store.update_memory(tenant, user, id, compressed_text=...)`; the
  prompt shows the compressed text when present. Changing `text` clears it.
- `load_embedder()` (in `embed`) loads the sentence embedder offline.
"""

from .archive import Archive, clean_text
from .records import (
    CoreBlock,
    CoreBlockEdit,
    Hit,
    InvalidInput,
    Memory,
    Message,
    NotFound,
    SessionInfo,
    Summary,
    Tenant,
    Turn,
    User,
)
from .store import MemoryStore
from .working import WorkingContext

__all__ = [
    "Archive",
    "CoreBlock",
    "CoreBlockEdit",
    "Hit",
    "InvalidInput",
    "Memory",
    "MemoryStore",
    "Message",
    "NotFound",
    "SessionInfo",
    "Summary",
    "Tenant",
    "Turn",
    "User",
    "WorkingContext",
    "clean_text",
]
