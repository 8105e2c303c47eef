"""The recall store's per-user indexes live in a cache bounded by bytes
(`AGENTMEM_RECALL_CACHE_MB`): a soak over 10,000 users keeps the process's resident size
flat, and an index evicted from memory is loaded again, whole, on its next use."""

from __future__ import annotations

import pytest

from agentmem.bench.recall_cache import HashEmbedder, rss_mb, soak
from agentmem.config import Config
from agentmem.tiers import MemoryStore

pytestmark = pytest.mark.slow  # a soak: `agentmem bench recall-cache` in small


def test_soak_over_10k_users_keeps_resident_size_flat(tmp_path):
    rss_mb()  # the probe itself works here
    out = soak(tmp_path, 10_000, cache_mb=2, embedder=HashEmbedder(), every=2000, search=False)
    first, last = out["samples"][0]["rss_mb"], out["samples"][-1]["rss_mb"]
    assert last - first < 25, out["samples"]  # 8,000 more users' indexes are not all in memory
    assert 0 < out["cached_indexes"] < 10_000


def test_evicted_index_comes_back_from_disk(tmp_path):
    emb = HashEmbedder()
    store = MemoryStore(Config(data_dir=tmp_path, recall_cache_mb=0), embedder=emb)  # keeps one index
    for user, text in (("ann", "My locker code is 4711."), ("bob", "My bike is red.")):
        sid = store.open_session("t", user).id
        store.add_messages("t", user, sid, [{"role": "user", "content": text}])
        assert store.search("t", user, text, k=1)[0].text == text
    assert store.recall.cached_users() == 1  # ann's index left memory when bob's came in
    before = emb.texts
    hit = store.search("t", "ann", "locker code", k=1)[0]
    assert hit.text == "My locker code is 4711."
    assert emb.texts - before <= 2  # the query: ann's message came back from disk, not re-embedded
    store.close()
