"""Which session a call that names none continues (REST and MCP `add_messages`, `context`)."""

from __future__ import annotations

from agentmem.config import Config
from agentmem.tiers import MemoryStore
from agentmem.tiers.store import default_session_id


def test_latest_session_is_the_default_conversation_else_the_newest(tmp_path):
    store = MemoryStore(Config(data_dir=tmp_path))
    assert store.latest_session("t", "u") is None
    store.open_session("t", "u", "a")
    store.open_session("t", "u", "b")
    assert store.latest_session("t", "u") == "b"
    default = store.open_session("t", "u", default_session_id("t", "u")).id
    store.open_session("t", "u", "c")
    assert store.latest_session("t", "u") == default
    assert store.latest_session("t", "someone-else") is None
    assert store.latest_session("other-tenant", "u") is None
    store.close()
