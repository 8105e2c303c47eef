"""The recall index's sync embeds new rows outside the user's lock: the lock is
free while the embedder works, concurrent syncs of one user add every vector once and lose
none (evictions to disk included), and a user forgotten mid-sync gets nothing back."""

from __future__ import annotations

import threading
import time

import pytest

from agentmem.bench.recall_cache import HashEmbedder
from agentmem.config import Config
from agentmem.tiers import MemoryStore


class GatedEmbedder(HashEmbedder):
    """Blocks a call embedding a text that holds `GATE` until `go` is set."""

    GATE = "gate-marker"

    def __init__(self):
        super().__init__()
        self.started, self.go = threading.Event(), threading.Event()

    def embed(self, texts, owner=""):
        if any(self.GATE in t for t in texts):
            self.started.set()
            assert self.go.wait(30)
        return super().embed(texts, owner)


class SlowEmbedder(HashEmbedder):
    """Yields the GIL for a while on each call, so that syncs and writers interleave."""

    def __init__(self):
        super().__init__()
        self._count = threading.Lock()

    def embed(self, texts, owner=""):
        time.sleep(0.005)
        with self._count:  # `texts` counts every text embedded, by any thread
            return super().embed(texts, owner)


@pytest.fixture
def gated(tmp_path):
    emb = GatedEmbedder()
    store = MemoryStore(Config(data_dir=tmp_path), embedder=emb)
    yield store, emb
    emb.go.set()
    store.close()


def _post(store, user, texts, tenant="t"):
    sid = store.open_session(tenant, user).id
    return store.add_messages(tenant, user, sid, [{"role": "user", "content": t} for t in texts])


def test_the_users_lock_is_free_while_new_rows_embed(gated):
    store, emb = gated
    _post(store, "u", ["I keep bees.", f"A long note {GatedEmbedder.GATE} about the hives."])
    syncing = threading.Thread(target=store.recall.sync, args=("t", "u"))
    syncing.start()
    assert emb.started.wait(10)
    # what takes the user's lock (flush, a search's FAISS scan, eviction, forget) is not held up
    flushed = threading.Thread(target=store.recall.flush, args=("t", "u"))
    flushed.start()
    flushed.join(5)
    assert not flushed.is_alive(), "flush waited for the embedder: the user's lock was held"
    emb.go.set()
    syncing.join(10)
    ui = store.recall.sync("t", "u")
    assert len(ui.messages) == 2 and ui.index.ntotal == sum(ui.messages.values())


def test_a_user_forgotten_mid_sync_gets_nothing_back(gated):
    store, emb = gated
    _post(store, "u", [f"My PIN is 4711 {GatedEmbedder.GATE}."])
    syncing = threading.Thread(target=store.recall.sync, args=("t", "u"))
    syncing.start()
    assert emb.started.wait(10)
    store.delete_user("t", "u")
    emb.go.set()
    syncing.join(10)
    assert not syncing.is_alive()
    assert ("t", "u") not in store.recall._indexes
    index_path, meta_path = store.recall._paths("t", "u")
    assert not index_path.exists() and not meta_path.exists()
    assert store.recall.sync("t", "u").index.ntotal == 0


def test_concurrent_syncs_add_every_vector_once(tmp_path):
    emb = SlowEmbedder()
    # a cache that holds one index: the other user's syncs evict this one to disk mid-sync
    store = MemoryStore(Config(data_dir=tmp_path, recall_cache_mb=0), embedder=emb)
    sid = store.open_session("t", "u").id
    errors: list[BaseException] = []
    done = threading.Event()

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - surfaced by the assertion below
                errors.append(e)
        return run

    def write(n):
        for i in range(25):
            store.add_messages("t", "u", sid, [{"role": "user", "content": f"writer {n} says thing {i} " * (1 + i % 3)}])
            if i % 10 == 0:
                store.add_memory("t", "u", f"fact {n}-{i}")

    def sync(user):
        while not done.is_set():
            store.recall.sync("t", user)

    _post(store, "other", ["The other user's only message."])
    writers = [threading.Thread(target=guard(lambda n=n: write(n))) for n in range(3)]
    syncers = [threading.Thread(target=guard(lambda: sync("u"))) for _ in range(3)]
    syncers.append(threading.Thread(target=guard(lambda: sync("other"))))
    for t in writers + syncers:
        t.start()
    for t in writers:
        t.join(120)
    done.set()
    for t in syncers:
        t.join(120)
    assert errors == []
    ui = store.recall.sync("t", "u")
    ids = set(store.archive.message_ids("t", "u"))
    assert set(ui.messages) == ids and len(ids) == 75
    assert set(ui.memories) == {m.id for m in store.list_memories("t", "u")} and len(ui.memories) == 9
    pieces = list(ui.pieces.values())
    assert len(pieces) == len(set(pieces)) == ui.index.ntotal == sum(ui.messages.values()) + len(ui.memories)
    other = store.recall.sync("t", "other")
    assert emb.texts == ui.index.ntotal + other.index.ntotal  # each vector embedded once
    store.close()


def test_deleting_the_newest_messages_is_reconciled_once(tmp_path, monkeypatch):
    """After the user's newest messages are deleted (an agent framework taking its last items
    back), one sync drops their vectors; later syncs see nothing stale and read no ids."""
    from sqlalchemy import delete

    from agentmem.tiers.schema import MessageRow

    store = MemoryStore(Config(data_dir=tmp_path), embedder=HashEmbedder())
    sid = store.open_session("t", "u").id
    kept = store.add_messages("t", "u", sid, [{"role": "user", "content": f"kept message {i}"} for i in range(3)])
    gone = store.add_messages("t", "u", sid, [{"role": "user", "content": "taken back"}])
    store.recall.sync("t", "u")
    with store.archive.tx() as s:
        s.execute(delete(MessageRow).where(MessageRow.id == gone[0].id))
    ui = store.recall.sync("t", "u")
    assert set(ui.messages) == {m.id for m in kept} and ui.top_id == kept[-1].id
    reads = []
    real = store.archive.message_ids
    monkeypatch.setattr(store.archive, "message_ids", lambda *a: reads.append(a) or real(*a))
    store.recall.sync("t", "u")
    assert reads == []
    store.close()
