"""Export and import as a faithful, idempotent round trip (tiers/transfer.py), through the
Python API on two databases: ids, texts and times kept, a second import changes nothing,
references follow remapped ids, and a bad document is refused whole before any work."""

from __future__ import annotations

import copy
import time

import pytest

from agentmem.config import Config
from agentmem.tiers.records import Conflict, InvalidInput
from agentmem.tiers.store import MemoryStore


@pytest.fixture
def stores(tmp_path, embedder):
    a = MemoryStore(Config(data_dir=tmp_path / "a"), embedder=embedder)
    b = MemoryStore(Config(data_dir=tmp_path / "b"), embedder=embedder)
    yield a, b
    a.close()
    b.close()


def _fill(store, tenant="default", user="dave") -> dict:
    s1 = store.open_session(tenant, user, "trip-2024").id
    s2 = store.open_session(tenant, user, "work").id
    m = store.add_messages(tenant, user, s1, [
        {"role": "user", "content": "I am allergic to sesame.", "created_at": "2024-03-02T10:00:00.123456+00:00",
         "event_time": "2024-03-01T09:00:00+02:00"},
        {"role": "assistant", "content": "Noted: no sesame.", "name": "bot"}])
    store.add_messages(tenant, user, s2, [{"role": "user", "content": "My desk is on floor 3."}])
    old = store.add_memory(tenant, user, "Allergic to peanuts.", source_ids=[m[0].id])
    new = store.add_memory(tenant, user, "Allergic to sesame.", source_ids=[m[0].id], event_time=m[0].event_time)
    store.supersede(tenant, user, old.id, new.id)
    store.set_core_block(tenant, user, "human", "Allergy: sesame")
    store.set_core_block(tenant, user, "human", "Allergy: sesame; desk floor 3")  # version 2 here
    return store.export_user(tenant, user)


def test_export_import_elsewhere_export_is_identical_and_a_second_import_changes_nothing(stores):
    a, b = stores
    doc = _fill(a)
    time.sleep(0.01)  # a rewritten time would show
    out = b.import_user("default", "dave", copy.deepcopy(doc))
    assert out["created"] == {"sessions": 2, "messages": 3, "memories": 2, "core_blocks": 1}
    assert out["id_map"] == {"messages": {}, "memories": {}}  # the ids were free: kept
    assert b.export_user("default", "dave") == doc
    again = b.import_user("default", "dave", copy.deepcopy(doc))
    assert again["unchanged"] and not any(again["created"].values())
    assert b.export_user("default", "dave") == doc
    hit = b.search("default", "dave", "allergy sesame", k=3)
    assert any("sesame" in h.text for h in hit)  # the recall index follows the import


def test_import_under_another_user_of_the_same_database_remaps_ids_and_references(stores):
    a, _ = stores
    doc = _fill(a)
    out = a.import_user("default", "erin", copy.deepcopy(doc))
    ids = out["id_map"]
    assert len(ids["messages"]) == 3 and len(ids["memories"]) == 2  # taken by dave's rows: remapped
    copy_doc = a.export_user("default", "erin")
    assert [s["id"] for s in copy_doc["sessions"]] == [s["id"] for s in doc["sessions"]]
    for key in ("messages", "memories"):
        strip = ("id", "source_ids", "superseded_by", "user_id")
        assert [{k: v for k, v in r.items() if k not in strip} for r in copy_doc[key]] == \
            [{k: v for k, v in r.items() if k not in strip} for r in doc[key]]
    sup = next(m for m in copy_doc["memories"] if m["status"] == "superseded")
    assert sup["superseded_by"] == ids["memories"][str(next(m for m in doc["memories"] if m["status"] == "active")["id"])]
    assert sup["source_ids"] == [ids["messages"][str(doc["messages"][0]["id"])]]
    assert a.import_user("default", "erin", copy.deepcopy(doc))["unchanged"]  # idempotent under remapping too
    assert len(a.archive.messages("default", "erin")) == 3


def test_a_session_holding_other_messages_is_a_conflict_and_nothing_is_written(stores):
    a, b = stores
    doc = _fill(a)
    b.open_session("default", "dave", "work")
    b.add_messages("default", "dave", "work", [{"role": "user", "content": "something else"}])
    with pytest.raises(Conflict):
        b.import_user("default", "dave", copy.deepcopy(doc))
    assert [s.id for s in b.list_sessions("default", "dave")] == ["work"]
    assert b.list_memories("default", "dave") == []


def _bad_docs(doc: dict):
    def edit(fn):
        d = copy.deepcopy(doc)
        fn(d)
        return d

    yield "messages", edit(lambda d: d.pop("messages"))
    yield "version", edit(lambda d: d.update(version=2))
    yield "messages.0.id", edit(lambda d: d["messages"][0].update(id=2**70))
    yield "messages.0.id", edit(lambda d: d["messages"][0].update(id=-5))
    yield "messages.1.id", edit(lambda d: d["messages"][1].update(id=d["messages"][0]["id"]))
    yield "messages.0.session_id", edit(lambda d: d["messages"][0].update(session_id="nowhere"))
    yield "sessions.2.id", edit(lambda d: d["sessions"].append(copy.deepcopy(d["sessions"][0])))
    yield "memories.0.superseded_by", edit(lambda d: d["memories"][0].update(superseded_by=12345))
    yield "memories.0.source_ids", edit(lambda d: d["memories"][0].update(source_ids=[777]))
    yield "messages.0.text", edit(lambda d: d["messages"][0].update(text="a\x00b"))
    yield "messages.0.text", edit(lambda d: d["messages"][0].update(text="a\ud800b"))
    yield "messages.0.created_at", edit(lambda d: d["messages"][0].update(created_at="yesterday-ish"))
    yield "sessions.0.id", edit(lambda d: [d["sessions"][0].update(id="a/b")] + [
        m.update(session_id="a/b") for m in d["messages"] if m["session_id"] == "trip-2024"])


def test_bad_documents_are_refused_whole_naming_the_field(stores):
    a, b = stores
    doc = _fill(a)
    for param, bad in _bad_docs(doc):
        with pytest.raises(InvalidInput) as got:
            b.import_user("default", "dave", bad)
        assert getattr(got.value, "param", None) == param, (param, str(got.value))
    assert b.list_users("default") == []


def test_counts_past_the_limit_are_refused_before_any_row_is_read(stores):
    _, b = stores
    row = {"id": 1, "session_id": "s", "role": "user", "text": "x", "created_at": "2024-01-01T00:00:00"}
    doc = {"version": 1, "sessions": [{"id": "s", "created_at": "2024-01-01T00:00:00"}],
           "messages": [row] * 100_000, "memories": [], "core_blocks": []}
    t = time.perf_counter()
    with pytest.raises(InvalidInput, match="at most 50000") as got:
        b.import_user("default", "dave", doc, {"messages": 50_000})
    assert time.perf_counter() - t < 1.0 and got.value.code == "import_too_large"
