"""The bytes-bounded LRU the recall store keeps its per-user indexes in."""

from agentmem.tiers.byte_lru import ByteLRU


def test_evicts_least_recently_used_past_the_budget_and_remeasures():
    evicted = []
    lru = ByteLRU(10, size=len, on_evict=lambda k, v: evicted.append((k, v)) is None)
    lru.put("a", "xxxx")
    lru.put("b", "xxxx")
    assert lru.get("a") == "xxxx"  # a is now the most recent
    lru.put("c", "xxxx")
    assert evicted == [("b", "xxxx")] and list(lru) == ["a", "c"] and lru.bytes == 8
    grown = "x" * 9
    lru.put("a", grown)  # a grew in place: measured again, c goes
    assert evicted[-1] == ("c", "xxxx") and list(lru) == ["a"] and lru.bytes == 9
    lru.put("big", "y" * 50)  # one entry over the budget alone stays: it is in use
    assert list(lru) == ["big"] and lru.evictions == 3
    assert lru.pop("big") == "y" * 50 and lru.bytes == 0 and lru.get("big") is None and len(lru) == 0


def test_an_entry_in_use_is_skipped_not_evicted():
    busy = {"a"}
    lru = ByteLRU(8, size=len, on_evict=lambda k, v: k not in busy)
    for k in "abc":
        lru.put(k, "xxxx")
    assert list(lru) == ["c", "a"] or list(lru) == ["a", "c"]  # b went; a was in use and stayed
    assert "b" not in lru and lru.bytes == 8 and lru.evictions == 1
