"""LangGraph's BaseStore on agentmem (integrations/langgraph.py), with the real package: the
operations, the same sequence run on InMemoryStore and compared, isolation, a compiled graph
using it, and the message when the extra is missing."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import sys
import threading
from datetime import UTC
from pathlib import Path
from typing import TypedDict

import pytest

pytest.importorskip("langgraph")

from langgraph.graph import END, START, StateGraph  # noqa: E402
from langgraph.runtime import Runtime  # noqa: E402
from langgraph.store.base import (  # noqa: E402
    GetOp,
    InvalidNamespaceError,
    ListNamespacesOp,
    MatchCondition,
    PutOp,
    SearchOp,
)
from langgraph.store.memory import InMemoryStore  # noqa: E402

from agentmem.config import Config  # noqa: E402
from agentmem.integrations.langgraph import SHARED_USER, AgentmemStore  # noqa: E402
from agentmem.tiers import InvalidInput, MemoryStore  # noqa: E402

ANA, BO = ("memories", "ana"), ("memories", "bo")
FACTS = {"food": "Ana is vegetarian and loves lentil soup",
         "music": "Ana plays the cello in a small orchestra",
         "city": "Ana moved to Lisbon last year for a new job"}


@pytest.fixture
def mstore(tmp_path, embedder):
    s = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    yield s
    s.close()


@pytest.fixture
def store(mstore):
    return AgentmemStore("default", store=mstore)


def _memories(mstore: MemoryStore, user: str, tenant: str = "default") -> list[str]:
    return sorted(m.text for m in mstore.list_memories(tenant, user, kind="store"))


def test_put_get_update_delete_keep_the_memory_current(store, mstore):
    store.put(ANA, "food", {"text": FACTS["food"], "n": 1})
    first = store.get(ANA, "food")
    assert (first.namespace, first.key, first.value) == (ANA, "food", {"text": FACTS["food"], "n": 1})
    assert first.created_at == first.updated_at and first.created_at.tzinfo is UTC
    assert _memories(mstore, "ana") == [FACTS["food"]]

    store.put(ANA, "food", {"text": "Ana now eats fish on Fridays", "n": 2})
    second = store.get(ANA, "food")
    assert second.value == {"text": "Ana now eats fish on Fridays", "n": 2}
    assert second.created_at == first.created_at < second.updated_at
    assert _memories(mstore, "ana") == ["Ana now eats fish on Fridays"]  # replaced, not added
    [hit] = store.search(ANA, query="what does Ana eat?")
    assert hit.value["n"] == 2 and hit.score > 0

    store.delete(ANA, "food")
    assert store.get(ANA, "food") is None
    assert _memories(mstore, "ana") == []
    assert store.search(ANA, query="fish") == [] and store.search(ANA) == []
    store.delete(ANA, "food")  # deleting what is not there is no error, as in InMemoryStore


def test_query_search_ranks_by_recall_then_filter_limit_offset(store):
    for key, text in FACTS.items():
        store.put(ANA, key, {"text": text, "topic": key, "year": len(key)})
    ranked = store.search(ANA, query="which instrument does she play?")
    assert ranked[0].key == "music"
    assert sorted(i.key for i in ranked) == sorted(FACTS)
    assert all(i.score is not None for i in ranked)
    assert [i.score for i in ranked] == sorted((i.score for i in ranked), reverse=True)
    assert store.search(ANA, query="which city does Ana live in?")[0].key == "city"

    pages = [store.search(ANA, query="which instrument does she play?", limit=1, offset=o) for o in range(4)]
    assert [p[0].key for p in pages[:3]] == [i.key for i in ranked] and pages[3] == []

    assert [i.key for i in store.search(ANA, query="which instrument?", filter={"topic": "food"})] == ["food"]
    assert {i.key for i in store.search(ANA, query="soup", filter={"year": {"$gte": 5}})} == {"music"}
    assert store.search(ANA, query="soup", filter={"topic": "none"}) == []


def test_filters_match_in_memory_store(store):
    memory = InMemoryStore()
    values = {"a": {"n": 1, "tags": ["x", "y"], "meta": {"lang": "en", "v": 2}, "s": "3"},
              "b": {"n": 5, "tags": ["x"], "meta": {"lang": "pt", "v": 2}, "s": "10"},
              "c": {"n": 9, "meta": {"lang": "en"}}}
    for s in (store, memory):
        for key, value in values.items():
            s.put(("docs",), key, value)
    filters = [{"n": 5}, {"n": {"$gt": 1}}, {"n": {"$gte": 5, "$lt": 9}}, {"n": {"$lte": 1}}, {"n": {"$ne": 5}},
               {"n": {"$eq": 9}}, {"tags": ["x"]}, {"tags": ["x", "y"]}, {"meta": {"lang": "en"}},
               {"meta": {"lang": "en", "v": 2}}, {"missing": None}, {"n": 1, "s": "3"}]
    for f in filters:
        assert [i.key for i in store.search(("docs",), filter=f)] == \
            [i.key for i in memory.search(("docs",), filter=f)], f
    # numbers as strings compare as numbers; a field an item lacks is in no range (InMemoryStore raises)
    assert [i.key for i in store.search(("docs",), filter={"s": {"$gt": 4}})] == ["b"]
    with pytest.raises(ValueError, match="operator"):
        store.search(("docs",), filter={"n": {"$in": [1]}})


# The same batches for both stores: puts, an update, deletes, batches that read before they
# write, namespaces of several depths and users.
SEQUENCE = [
    [PutOp(ANA, "food", {"text": FACTS["food"], "kind": "diet"}),
     PutOp(ANA, "music", {"text": FACTS["music"], "kind": "hobby"}),
     PutOp(BO, "food", {"text": "Bo grills steak every weekend", "kind": "diet"}),
     PutOp(("memories", "ana", "work"), "job", {"text": "Ana is a nurse at the city hospital"})],
    [GetOp(ANA, "food"), PutOp(ANA, "food", {"text": "Ana eats fish now", "kind": "diet"}), GetOp(ANA, "food"),
     SearchOp(ANA, None, 10, 0)],
    [PutOp(ANA, "city", {"text": FACTS["city"], "kind": "place"}), PutOp(BO, "city", {"text": "Bo lives in Oslo"}),
     PutOp(BO, "city", {"text": "Bo lives in Bergen", "kind": "place"})],
    [PutOp(("memories", "cy"), "x", {"text": "Cy collects stamps"}), PutOp(("prefs",), "theme", {"theme": "dark"})],
    [PutOp(ANA, "music", None), GetOp(ANA, "music"), PutOp(("memories", "ana", "work"), "shift", {"text": "nights"}),
     PutOp(("prefs",), "theme", None)],
]
READS = [
    SearchOp((), None, 100, 0), SearchOp(("memories",), None, 100, 0), SearchOp(("memories",), None, 2, 1),
    SearchOp(ANA, None, 10, 0), SearchOp(ANA, {"kind": "diet"}, 10, 0), SearchOp(("memories",), {"kind": "place"}, 10, 0),
    SearchOp(("memories", "an"), None, 10, 0), SearchOp(("memories", "ana", "work"), None, 10, 1),
    GetOp(BO, "city"), GetOp(ANA, "music"), GetOp(("memories", "ana", "work"), "job"),
    ListNamespacesOp(), ListNamespacesOp(max_depth=1), ListNamespacesOp(max_depth=2, limit=2, offset=1),
    ListNamespacesOp((MatchCondition("prefix", ("memories", "*")),)),
    ListNamespacesOp((MatchCondition("suffix", ("*", "work")),)),
    ListNamespacesOp((MatchCondition("prefix", ("memories",)), MatchCondition("suffix", ("bo",)))),
    ListNamespacesOp((MatchCondition("prefix", ("memories", "ana")),), max_depth=2),
]


def _plain(result):
    """A result without its times and scores (each store stamps its own)."""
    if isinstance(result, list):
        return [_plain(r) for r in result]
    if result is None or isinstance(result, tuple):
        return result
    return (result.namespace, result.key, result.value)


def test_differential_against_in_memory_store(store, embedder):
    memory = InMemoryStore(index={"dims": embedder.dim, "embed": lambda texts: embedder.embed(texts).tolist(),
                                  "fields": ["text"]})
    for ops in SEQUENCE:
        assert _plain(store.batch(ops)) == _plain(memory.batch(ops))
    # the documented difference: InMemoryStore still lists a namespace it emptied
    assert memory.list_namespaces(prefix=("prefs",)) == [("prefs",)] and store.list_namespaces(prefix=("prefs",)) == []
    ops = [PutOp(("prefs",), "theme", {"theme": "light"})]
    assert _plain(store.batch(ops)) == _plain(memory.batch(ops))
    for op in READS:
        assert _plain(store.batch([op])[0]) == _plain(memory.batch([op])[0]), op
    # with a query both rank every item under the prefix; the clearly best one is the same
    for prefix, query, best in [(ANA, "what does Ana eat?", (ANA, "food")),
                                (("memories",), "who lives in Bergen?", (BO, "city")),
                                (("memories",), "Ana's job at the hospital", (("memories", "ana", "work"), "job"))]:
        ours = store.search(prefix, query=query, limit=20)
        theirs = memory.search(prefix, query=query, limit=20)
        assert sorted(_plain(ours)) == sorted(_plain(theirs))
        assert (ours[0].namespace, ours[0].key) == (theirs[0].namespace, theirs[0].key) == best, query
    # an update keeps created_at (PostgresStore's semantics); InMemoryStore stamps it anew
    food = store.get(ANA, "food")
    assert food.created_at < food.updated_at
    bergen = store.get(BO, "city")
    assert bergen.created_at == bergen.updated_at and bergen.value["text"] == "Bo lives in Bergen"  # a batch's last put


def test_a_batch_writes_all_of_its_puts_or_none(store, mstore):
    with pytest.raises(InvalidInput):  # a user label longer than a user id may be, after a valid put
        store.batch([PutOp(ANA, "food", {"text": FACTS["food"]}), PutOp(("memories", "u" * 300), "k", {"text": "x"})])
    with pytest.raises(InvalidInput, match="must be JSON"):
        store.batch([PutOp(ANA, "food", {"text": FACTS["food"]}), PutOp(ANA, "when", {"at": object()})])
    # a label holding the separator would address another namespace: refused, as is an empty namespace
    for ops in ([PutOp(("memories", "ana.work"), "job", {"text": "x"})], [GetOp(("memories", "ana.work"), "job")],
                [SearchOp(("memories.ana",), None, 10, 0)], [PutOp((), "k", {"text": "x"})]):
        with pytest.raises(InvalidNamespaceError):
            store.batch([PutOp(ANA, "food", {"text": FACTS["food"]}), *ops])
    assert store.search(()) == [] and store.list_namespaces() == []
    assert _memories(mstore, "ana") == []


def test_index_paths_fields_and_unindexed_items(mstore):
    store = AgentmemStore(store=mstore, fields=["title"])
    store.put(ANA, "a", {"title": "Trip to Kyoto", "body": "temples and tea"})
    store.put(ANA, "b", {"title": "Cello lessons", "body": "Tuesdays"}, index=["body", "title"])
    store.put(ANA, "c", {"title": "Tax notes", "body": "receipts"}, index=False)
    store.put(ANA, "d", {"title": "x", "chapters": [{"t": "rain"}, {"t": "snow"}]}, index=["chapters[*].t"])
    assert _memories(mstore, "ana") == ["Trip to Kyoto", "Tuesdays\nCello lessons", "rain\nsnow"]
    hits = store.search(ANA, query="weather: rain and snow", limit=10)
    assert hits[0].key == "d"
    assert hits[-1].key == "c" and hits[-1].score is None  # not indexed: listed after recall's ranking
    assert [h.key for h in store.search(ANA, query="weather", limit=1, offset=3)] == ["c"]
    store.put(ANA, "a", {"title": "Trip to Kyoto", "body": "new body"})  # same indexed text: the memory stays
    store.put(ANA, "b", {"title": "Cello lessons"}, index=False)  # no longer indexed: its memory goes
    assert _memories(mstore, "ana") == ["Trip to Kyoto", "rain\nsnow"]
    default = AgentmemStore(store=mstore)
    default.put(("notes", "ana"), "n", {"text": "lunch with Bo", "tags": ["food", "friends"], "count": 2})
    default.put(("notes", "ana"), "m", {"count": 2, "ok": True})
    assert {'{"count": 2, "ok": true}', "lunch with Bo\nfood\nfriends"} <= set(_memories(mstore, "ana"))


def test_isolation_between_namespaces_users_and_tenants(store, mstore):
    store.put(ANA, "pet", {"text": "Ana has a greyhound called Pixel"})
    store.put(BO, "pet", {"text": "Bo has a parrot called Kiwi"})
    store.put(("memories", "an"), "pet", {"text": "An has a cat"})
    store.put(("Memories", "ana"), "pet", {"text": "another namespace: labels are case sensitive"})
    for query in ("Bo's parrot Kiwi", "greyhound", "cat"):
        assert [i.namespace for i in store.search(ANA, query=query)] == [ANA]
    assert [i.value["text"] for i in store.search(("memories", "an"))] == ["An has a cat"]  # labels, not characters
    assert {i.namespace for i in store.search(("memories",), query="pets")} == {ANA, BO, ("memories", "an")}
    assert store.get(ANA, "pet").value["text"].startswith("Ana")
    # the user is the namespace's second label: the text is that user's memory, and goes with the user
    assert _memories(mstore, "bo") == ["Bo has a parrot called Kiwi"]
    assert mstore.search("default", "bo", "parrot")[0].kind == "store"
    mstore.delete_user("default", "bo")
    assert store.get(BO, "pet") is None and store.search(("memories",), filter={"text": "Bo has a parrot called Kiwi"}) == []

    other = AgentmemStore("tenant-b", store=mstore)
    other.delete(ANA, "pet")  # nothing to delete: nothing written, not even the tenant
    assert "tenant-b" not in {t.id for t in mstore.list_tenants()}
    assert other.get(ANA, "pet") is None
    assert other.search(ANA, query="greyhound") == [] and other.search(()) == []
    assert other.list_namespaces() == []
    other.put(ANA, "pet", {"text": "tenant b's Ana has a horse"})
    assert store.get(ANA, "pet").value["text"] == "Ana has a greyhound called Pixel"
    assert [i.value["text"] for i in other.search(ANA, query="pet")] == ["tenant b's Ana has a horse"]


def test_user_index_decides_whose_memory_an_item_is(mstore):
    first = AgentmemStore(store=mstore, user_index=0)
    first.put(("ana", "memories"), "k", {"text": "first label is the user"})
    first.put(("ana",), "k", {"text": "a one-label namespace"})
    last = AgentmemStore(store=mstore, user_index=-1)
    last.put(("team", "bo"), "k", {"text": "last label is the user"})
    short = AgentmemStore(store=mstore)
    short.put(("settings",), "k", {"text": "no user label"})
    assert _memories(mstore, "ana") == ["a one-label namespace", "first label is the user"]
    assert _memories(mstore, "bo") == ["last label is the user"]
    assert _memories(mstore, SHARED_USER) == ["no user label"]
    assert [i.key for i in first.search(("ana",), query="user label")] == ["k", "k"]


WORDS = ("apple river stone cloud piano garden window candle forest bridge tiger lemon violin harbor pepper castle "
         "meadow rocket silver thunder orange marble island feather jacket ladder mirror needle pillow saddle").split()


def test_a_users_messages_do_not_crowd_out_its_items(store, mstore):
    """Recall ranks the user's messages with its memories: turns that name the question's word
    outrank the items it finds by meaning alone, and the search must still score them all."""
    session = mstore.open_session("default", "ana").id
    n = len(WORDS)
    mstore.add_messages("default", "ana", session, [
        {"role": "user", "content": f"My cello sat near the {WORDS[i % n]} and the {WORDS[(7 * i + 3) % n]}"}
        for i in range(60)])
    store.batch([PutOp(ANA, f"t{i}", {"text": f"Ana's note {i} on practising her string instrument"})
                 for i in range(40)])
    hits = store.search(ANA, query="cello", limit=50)
    assert sorted(h.key for h in hits) == sorted(f"t{i}" for i in range(40))
    assert all(h.score is not None for h in hits)


def test_async_operations_run_off_the_event_loop(store, mstore, monkeypatch):
    threads = []
    search = mstore.search

    def recording(*args, **kwargs):
        threads.append(threading.get_ident())
        return search(*args, **kwargs)

    monkeypatch.setattr(mstore, "search", recording)

    async def scenario():
        await store.aput(ANA, "music", {"text": FACTS["music"]})
        await store.aput(ANA, "food", {"text": FACTS["food"]})
        got = await store.aget(ANA, "music")
        hits = await store.asearch(ANA, query="instrument", limit=1)
        listed = await store.asearch(ANA, filter={"text": FACTS["food"]})
        spaces = await store.alist_namespaces(prefix=("memories",))
        await store.adelete(ANA, "music")
        return got, hits, listed, spaces, await store.aget(ANA, "music"), threading.get_ident()

    got, hits, listed, spaces, gone, loop_thread = asyncio.run(scenario())
    assert got.value == {"text": FACTS["music"]} and [h.key for h in hits] == ["music"]
    assert [i.key for i in listed] == ["food"] and spaces == [ANA] and gone is None
    assert threads and loop_thread not in threads


class State(TypedDict, total=False):
    said: str
    question: str
    answer: str


def _graph(store: AgentmemStore):
    def remember(state: State, runtime: Runtime) -> State:
        if state.get("said"):
            runtime.store.put(("memories", "ana"), f"note-{len(runtime.store.search(ANA, limit=100))}",
                              {"text": state["said"]})
        return {}

    async def answer(state: State, runtime: Runtime) -> State:
        hits = await runtime.store.asearch(ANA, query=state["question"], limit=1)
        return {"answer": hits[0].value["text"] if hits else ""}

    graph = StateGraph(State)
    graph.add_node(remember)
    graph.add_node(answer)
    graph.add_edge(START, "remember")
    graph.add_edge("remember", "answer")
    graph.add_edge("answer", END)
    return graph.compile(store=store)


def test_a_compiled_graph_uses_it_as_its_store(store, mstore):
    graph = _graph(store)

    async def run():
        for fact in FACTS.values():
            await graph.ainvoke({"said": fact, "question": "anything"})
        return (await graph.ainvoke({"question": "Which instrument does Ana play?"}))["answer"]

    assert asyncio.run(run()) == FACTS["music"]
    assert [i.key for i in store.search(ANA)] == ["note-0", "note-1", "note-2"]
    assert _memories(mstore, "ana") == sorted(FACTS.values())


def test_the_example_runs(mstore, monkeypatch):
    path = Path(__file__).parents[2] / "examples" / "langgraph_memory.py"
    spec = importlib.util.spec_from_file_location("langgraph_memory_example", path)
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # its dataclass looks its module up
    spec.loader.exec_module(example)
    answers = example.run(AgentmemStore(store=mstore))
    assert [a for _q, a in answers] == example.FACTS


def test_postgresql(pg_url, tmp_path, embedder):
    mstore = MemoryStore(Config(data_dir=tmp_path, db_url=pg_url), embedder=embedder)
    try:
        store = AgentmemStore(store=mstore)
        store.put(ANA, "music", {"text": FACTS["music"], "year": 2020})
        store.put(("memories", "an"), "x", {"text": "An"})
        store.put(("memories", "ana", "work"), "job", {"text": "a nurse", "year": 2024})
        store.put(ANA, "music", {"text": FACTS["music"], "year": 2021})
        assert [i.key for i in store.search(("memories", "ana"))] == ["music", "job"]
        assert [i.key for i in store.search(("memories",), filter={"year": {"$gt": 2020}})] == ["music", "job"]
        assert store.search(ANA, query="cello")[0].key == "music"
        assert store.list_namespaces(prefix=("memories", "ana")) == [ANA, ("memories", "ana", "work")]
        store.delete(ANA, "music")
        assert store.get(ANA, "music") is None and _memories(mstore, "ana") == ["a nurse"]
    finally:
        mstore.close()


def test_without_the_extra_the_import_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "langgraph", None)
    monkeypatch.delitem(sys.modules, "agentmem.integrations.langgraph")
    with pytest.raises(ImportError, match=r"agentmem\[langgraph\]"):
        importlib.import_module("agentmem.integrations.langgraph")
