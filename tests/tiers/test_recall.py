"""Hybrid recall: each retriever alone and fused, the full-text index kept in step
with the archive (migration, edits, deletes, tenants), time and people in the question,
diversity over sessions, and bad input."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
import sqlalchemy as sa

from agentmem.config import Config
from agentmem.tiers import InvalidInput, MemoryStore
from agentmem.tiers.archive import Archive, migrate
from agentmem.tiers.query import content_terms, mask_capitalised, parse_query
from agentmem.tiers.timeparse import parse_time

T0 = datetime(2023, 5, 1, 10, 0, tzinfo=UTC)


@pytest.fixture
def store(tmp_path, embedder):
    s = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    yield s
    s.close()


def _conversation(store, user="alice", tenant="default", sessions=None):
    """Sessions of (speaker, text, day offset); speakers alternate roles user/assistant."""
    ids = {}
    for turns in sessions:
        sid = store.open_session(tenant, user).id
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "name": who, "content": text,
                 "created_at": T0 + timedelta(days=day, minutes=i)} for i, (who, text, day) in enumerate(turns)]
        for m in store.add_messages(tenant, user, sid, msgs):
            ids[m.text] = m.id
    return ids


SMALL_TALK = [("Priya", "Morning! How was your weekend?", 0), ("Tom", "Pretty quiet, mostly slept haha", 0),
              ("Priya", "Same here, the weather was awful", 0), ("Tom", "Did you watch the match?", 0),
              ("Priya", "No, I fell asleep on the sofa", 0), ("Tom", "Classic. Coffee later?", 0)]


def test_each_retriever_alone_and_fused(store):
    ids = _conversation(store, sessions=[SMALL_TALK + [
        ("Priya", "I finally bought a second-hand cello, the neighbours will hate me", 0),
        ("Tom", "Ha! Which shop did you get it from?", 0),
        ("Priya", "The quirky place on Zamboni street that sells old radios", 0),
    ]])
    cello, zamboni = ids["I finally bought a second-hand cello, the neighbours will hate me"], \
        ids["The quirky place on Zamboni street that sells old radios"]
    # a paraphrase: no word in common with the evidence; only the embeddings find it
    lexical = store.search("default", "alice", "Which musical instrument did Priya purchase?", k=3,
                           retrievers=("lexical",))
    assert cello not in [h.id for h in lexical]
    dense = store.search("default", "alice", "Which musical instrument did Priya purchase?", k=3,
                         retrievers=("dense",))
    assert dense[0].id == cello and dense[0].retrievers == ["dense"]
    # a rare name: the full-text index finds it first
    lex = store.search("default", "alice", "zamboni", k=1, retrievers=("lexical",))
    assert lex[0].id == zamboni and lex[0].retrievers == ["lexical"]
    fused = store.search("default", "alice", "Where did Priya buy the instrument, the Zamboni shop?", k=3)
    assert {cello, zamboni} <= {h.id for h in fused}
    top = next(h for h in fused if h.id == zamboni)
    assert {"lexical", "dense"} <= set(top.retrievers)
    with pytest.raises(ValueError, match="unknown retrievers"):
        store.search("default", "alice", "cello", retrievers=("bm25",))


def test_reflected_fact_counts_for_its_sources(store):
    ids = _conversation(store, sessions=[SMALL_TALK + [("Tom", "we got the keys to the new flat in Ghent!!", 3)]])
    source = ids["we got the keys to the new flat in Ghent!!"]
    fact = store.add_memory("default", "alice", "Tom moved house to Ghent.", importance=0.8, source_ids=[source])
    hits = store.search("default", "alice", "Where did Tom relocate to?", k=3)
    assert any(h.kind == "fact" and h.id == fact.id and "facts" in h.retrievers for h in hits)
    msg = next(h for h in hits if h.kind == "message" and h.id == source)
    assert "facts" in msg.retrievers  # the fact voted for the turn it came from


def test_fulltext_follows_edits_deletes_and_tenants(store):
    t1, t2 = store.create_tenant("one"), store.create_tenant("two")
    for t in (t1, t2):
        sid = store.open_session(t, "u").id
        store.add_messages(t, "u", sid, [{"role": "user", "content": "The zeppelin museum was closed"}])
    a = store.archive
    assert len(a.lexical_search(t1, "u", ["zeppelin"])) == 1 and len(a.lexical_search(t2, "u", ["zeppelin"])) == 1
    hits = store.search(t1, "u", "zeppelin", k=10)
    assert [h.text for h in hits] == ["The zeppelin museum was closed"]
    assert hits[0].id == a.lexical_search(t1, "u", ["zeppelin"])[0][0]  # never the other tenant's row
    m = store.add_memory(t1, "u", "Likes airships such as the Hindenburg.")
    assert [i for i, _ in a.lexical_search(t1, "u", ["hindenburg"], what="memories")] == [m.id]
    store.update_memory(t1, "u", m.id, "Likes trains.")
    assert a.lexical_search(t1, "u", ["hindenburg"], what="memories") == []
    assert [i for i, _ in a.lexical_search(t1, "u", ["train"], what="memories")] == [m.id]  # stemmed
    store.supersede(t1, "u", m.id, store.add_memory(t1, "u", "Likes boats.").id)
    assert a.lexical_search(t1, "u", ["train"], what="memories") == []  # superseded: never recalled
    store.delete_user(t1, "u")
    assert a.lexical_search(t1, "u", ["zeppelin"]) == [] and store.search(t1, "u", "zeppelin") == []
    assert len(a.lexical_search(t2, "u", ["zeppelin"])) == 1
    a.purge_fulltext()
    store.delete_tenant(t2)
    assert a.lexical_search(t2, "u", ["zeppelin"]) == []


def test_very_common_words_are_left_out_of_the_fulltext_query(store, monkeypatch):
    """At scale a word most turns hold costs the full-text query far more than it tells it:
    it is dropped (not below COMMON_MIN_ROWS matching rows), the rarest word stays when every
    word is common, and a store without the vocabulary table keeps every word."""
    from agentmem.tiers import lexical

    a = store.archive
    sid = store.open_session("default", "u").id
    store.add_messages("default", "u", sid, [{"role": "user", "content": f"Some days are long, day {i}."}
                                             for i in range(30)]
                       + [{"role": "user", "content": "Back from Reykjavik at last."}])
    reykjavik = a.lexical_search("default", "u", ["reykjavik"])[0][0]
    assert len(a.lexical_search("default", "u", ["days", "reykjavik"], limit=50)) == 31  # 31 rows: nothing dropped
    monkeypatch.setattr(lexical, "COMMON_MIN_ROWS", 10)
    monkeypatch.setattr(lexical, "COMMON_SHARE", 0.5)
    lexical._rows_cache.clear()
    sent = []
    real = lexical._fts5_query
    monkeypatch.setattr(lexical, "_fts5_query", lambda terms: sent.append(terms) or real(terms))
    assert [i for i, _ in a.lexical_search("default", "u", ["days", "Reykjavik"])] == [reykjavik]
    assert sent[-1] == ["Reykjavik"]  # "days" (stem "dai") is in 30 of 31 rows
    assert len(a.lexical_search("default", "u", ["days", "long"], limit=50)) == 30  # both common: the rarer stays
    assert len(sent[-1]) == 1
    with a.tx() as s:
        s.execute(sa.text("DROP TABLE message_fts_vocab"))
    assert len(a.lexical_search("default", "u", ["days", "reykjavik"], limit=50)) == 31  # no vocabulary: every word


def _upgrade_from_0006(url: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as c:
        migrate(c, "0006")
        now = datetime.now()
        c.execute(sa.text("insert into messages (tenant_id, user_id, session_id, role, text, created_at) values "
                          "('t', 'u', 's', 'user', 'the aquarium had a giant octopus', :now)"), {"now": now})
        c.execute(sa.text("insert into memories (tenant_id, user_id, kind, text, importance, status, source_ids, "
                          "created_at, updated_at) values ('t', 'u', 'fact', 'Enjoys aquariums', 0.5, 'active', "
                          "'[]', :now, :now)"), {"now": now})
    engine.dispose()
    a = Archive(url)  # upgrades to head: the existing rows are indexed
    assert [i for i, _ in a.lexical_search("t", "u", ["octopus"])] == [1]
    assert len(a.lexical_search("t", "u", ["aquarium"], what="memories")) == 1
    a.close()


def test_migration_backfills_existing_rows_sqlite(tmp_path):
    _upgrade_from_0006(f"sqlite:///{tmp_path / 'old.db'}")


def test_migration_backfills_existing_rows_postgresql(pg_url):
    _upgrade_from_0006(pg_url)


def test_postgresql_fulltext_and_fusion(tmp_path, embedder, pg_url):
    s = MemoryStore(Config(data_dir=tmp_path, db_url=pg_url), embedder=embedder)
    try:
        ids = _conversation(s, sessions=[SMALL_TALK + [("Priya", "The quirky place on Zamboni street", 0)]])
        found = s.archive.lexical_search("default", "alice", content_terms('zamboni "streets" NEAR * :'))
        assert found[0][0] == ids["The quirky place on Zamboni street"]
        hits = s.search("default", "alice", "zamboni", k=2)
        assert hits[0].id == ids["The quirky place on Zamboni street"] and "lexical" in hits[0].retrievers
        s.delete_user("default", "alice")
        assert s.archive.lexical_search("default", "alice", ["zamboni"]) == []
    finally:
        s.close()


def _rare_and_common(s) -> dict[str, int]:
    sid = s.open_session("default", "idf").id
    texts = [f"today was {w} today, like every day" for w in ("slow", "grey", "long", "busy", "odd", "fine")] * 4
    texts += ["I finally bought a second-hand cello", "today the parcel came"]
    msgs = s.add_messages("default", "idf", sid, [{"role": "user", "content": t} for t in texts])
    s.add_messages("default", "idf", sid, [{"role": "user", "content": "look!", "caption": "a cello case on a bed"}])
    return {m.text: m.id for m in msgs} | {"look!": s.archive.lexical_search("default", "idf", ["look"])[0][0]}


@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_full_text_weighs_a_rare_word_over_a_common_one(tmp_path, embedder, db, request):
    """bm25 on both databases: "cello" (said once) outweighs "today" (said 25 times, twice in
    most of those turns); a word only in a caption counts less than in the text. PostgreSQL's
    ts_rank_cd has no inverse document frequency, so it ranked the common word's turns first."""
    url = request.getfixturevalue("pg_url") if db == "postgresql" else None
    s = MemoryStore(Config(data_dir=tmp_path, db_url=url), embedder=embedder)
    try:
        ids = _rare_and_common(s)
        found = [i for i, _ in s.archive.lexical_search("default", "idf", ["today", "cello"], 5)]
        assert found[:2] == [ids["I finally bought a second-hand cello"], ids["look!"]]
    finally:
        if db == "postgresql":
            s.delete_user("default", "idf")
        s.close()


def test_speaker_named_in_the_question_is_favoured(store):
    ids = _conversation(store, sessions=[
        SMALL_TALK + [("Priya", "Our tabby cat knocked a plant off the shelf again", 2),
                      ("Tom", "Ha, our parrot keeps shouting at the neighbour's dog", 2)],
    ])
    hits = store.search("default", "alice", "What pet does Tom have?", k=2)
    assert hits[0].id == ids["Ha, our parrot keeps shouting at the neighbour's dog"]
    hits = store.search("default", "alice", "What pet does Priya have?", k=2)
    assert hits[0].id == ids["Our tabby cat knocked a plant off the shelf again"]


@pytest.mark.parametrize("texts, names", [
    (["Caroline: I went to the support group", "Mel: How was it?", "Caroline: Powerful"],
     ["Caroline", "Mel", "Caroline"]),
    (["Mary Ann: hi", "Jo: hey there", "no prefix here", "Jo: fine", "Mary Ann: good"],  # 80% is enough
     ["Mary Ann", "Jo", None, "Jo", "Mary Ann"]),
    (["Note: buy milk", "Update: bought it"], [None, None]),  # labels, not people
    (["User: hi", "Assistant: hello"], [None, None]),  # roles, not names
    (["Paris: day 3 of the trip"], [None]),  # one message: a heading
    (["Caroline: hi", "how are you?", "fine thanks"], [None, None, None]),  # not a transcript
    (["see you at 10: bring snacks", "ok: will do"], [None, None]),
    ([f"P{i}: hello there" for i in range(9)], [None] * 9),  # nine 'names': labels
])
def test_speakers_named_in_a_flattened_transcript(texts, names):
    from agentmem.tiers.keys import transcript_speakers, unprefixed

    assert transcript_speakers(texts) == names
    assert unprefixed("Caroline: I went there", "Caroline") == "I went there"
    assert unprefixed("Caroline: I went there", "Mel") == "Caroline: I went there"
    assert unprefixed("Carolines are nice", "Caroline") == "Carolines are nice"


def test_transcript_prefixes_make_speakers(store):
    """A conversation imported as role/content pairs with the speaker in the text is ranked
    as if it named its speakers: the text is kept verbatim, the speaker comes from the prefix."""
    sid = store.open_session("default", "alice").id
    turns = [f"{who}: {text}" for who, text, _ in SMALL_TALK] + [
        "Priya: Our tabby cat knocked a plant off the shelf again",
        "Tom: Ha, our parrot keeps shouting at the neighbour's dog"]
    stored = store.add_messages("default", "alice", sid, [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t, "created_at": T0 + timedelta(minutes=i)}
        for i, t in enumerate(turns)])
    assert [m.name for m in stored[-2:]] == ["Priya", "Tom"] and stored[-1].text == turns[-1]
    hits = store.search("default", "alice", "What pet does Tom have?", k=2)
    assert hits[0].id == stored[-1].id and hits[0].name == "Tom"
    hits = store.search("default", "alice", "What pet does Priya have?", k=2)
    assert hits[0].id == stored[-2].id
    # a batch that gives names keeps them, prefixes or not
    named = store.add_messages("default", "alice", sid, [
        {"role": "user", "name": "Priya", "content": "Tom: is what he said", "created_at": T0 + timedelta(hours=1)},
        {"role": "user", "name": "Priya", "content": "Tom: and again", "created_at": T0 + timedelta(hours=1)}])
    assert [m.name for m in named] == ["Priya", "Priya"]
    # the same transcript one message at a time: a prefix names a speaker this user already has
    one = [store.add_messages("default", "alice", sid, [{"role": "user", "content": t}])[0]
           for t in ("Priya: We adopted a second cat", "Paris: day 3 of the trip", "Note: Tom's birthday")]
    assert [m.name for m in one] == ["Priya", None, None] and one[0].text == "Priya: We adopted a second cat"
    assert store.add_messages("default", "bob", store.open_session("default", "bob").id,
                              [{"role": "user", "content": "Priya: hi"}])[0].name is None  # another user's


def test_message_times_as_imports_write_them(store):
    """ISO-8601, unix seconds, or a date with its month in words and its year (as conversation
    datasets write session dates); anything ambiguous is a clear error, never a guess."""
    sid = store.open_session("default", "alice").id
    got = store.add_messages("default", "alice", sid, [
        {"role": "user", "content": "a", "created_at": "1:56 pm on 8 May, 2023"},
        {"role": "user", "content": "b", "created_at": 1683554160},
        {"role": "user", "content": "c", "created_at": "2023-05-08T15:56:00+02:00"},
        {"role": "user", "content": "d", "event_time": "May 8th 2023, 13:56"}])
    want = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
    assert [m.time for m in got] == [want] * 4
    for bad in ("03/04/2023", "8 May", "yesterday", True, 1e30, ["2023"]):
        with pytest.raises(InvalidInput, match="created_at"):
            store.add_messages("default", "alice", sid, [{"role": "user", "content": "x", "created_at": bad}])


def test_time_in_the_question_picks_the_window(store):
    ids = _conversation(store, sessions=[
        [("Priya", "I cooked a huge pot of lentil curry tonight", 0), ("Tom", "Yum", 0)],
        [("Priya", "I cooked a huge pot of mushroom risotto tonight", 35), ("Tom", "Yum", 35)],
        [("Priya", "I cooked a huge pot of chickpea stew tonight", 70), ("Tom", "Yum", 70)],
    ])
    # conversation 'now' is 2023-07-10: "in June" is the second session
    hits = store.search("default", "alice", "What did Priya cook in June?", k=1)
    assert hits[0].id == ids["I cooked a huge pot of mushroom risotto tonight"]
    hits = store.search("default", "alice", "What did Priya cook in May 2023?", k=1)
    assert hits[0].id == ids["I cooked a huge pot of lentil curry tonight"]


def test_evidence_in_two_sessions_both_come_back(store):
    leeds = [("Tom", "I grew up in Leeds, lived there till I was twenty", 0), ("Priya", "Oh nice!", 0),
             ("Tom", "Leeds was so rainy though, I lived in wellies", 0), ("Priya", "Haha", 0),
             ("Tom", "I lived in Leeds near the canal, loved it", 0), ("Priya", "Sounds lovely", 0)]
    ids = _conversation(store, sessions=[
        SMALL_TALK + leeds,
        SMALL_TALK + [("Tom", "we got the keys to our new flat in Bristol last week", 40), ("Priya", "Congrats!", 40)],
    ])
    bristol = ids["we got the keys to our new flat in Bristol last week"]
    hits = store.search("default", "alice", "Which cities has Tom lived in?", k=5)
    assert bristol in [h.id for h in hits]  # the session with one match is not crowded out by the other's three
    assert len({h.session_id for h in hits}) == 2


def test_session_decay_spreads_close_scores():
    from agentmem.tiers.recall import _Cand, _diverse

    ranked = [(_Cand(0, i, score=s), sid) for i, (s, sid) in enumerate([(1.0, "a"), (0.95, "a"), (0.9, "a"),
                                                                          (0.88, "b"), (0.2, "b")])]
    picked = _diverse(ranked, 3, lambda cr: cr[1])
    assert [c.row_id for c, _ in picked] == [0, 3, 1]  # b's close second comes before a's third
    assert [c.row_id for c, _ in _diverse(ranked, 5, lambda cr: cr[1])][-1] == 4  # a far score stays last


def test_a_repeated_small_talk_turn_counts_less_once_its_twin_is_taken():
    from agentmem.tiers.recall import _Cand, _diverse, _letter_words

    texts = ["Working from home today, still in pyjamas at 7pm", "working from home today still in pyjamas at 5pm",
             "First week at the hospital pharmacy done, everyone is lovely", "Working late at the office again"]
    ranked = [(_Cand(0, i, score=s), f"s{i}") for i, s in enumerate([1.0, 0.95, 0.6, 0.2])]  # each its own session
    words = {i: _letter_words(t) for i, t in enumerate(texts)}
    picked = _diverse(ranked, 3, lambda cr: cr[1], lambda cr: words[cr[0].row_id])
    assert [c.row_id for c, _ in picked] == [0, 2, 1]  # the pharmacy turn before the pyjamas twin (0.95 x 0.3)
    assert [c.row_id for c, _ in _diverse(ranked, 3, lambda cr: cr[1])] == [0, 1, 2]  # without words: by score
    assert picked[2][0].score == 0.95  # the order changes, the score does not
    assert not _letter_words("3 deadlines") & _letter_words("8 deadlines") - {"deadlines"}


def test_one_query_search_matches_faiss_and_restores_the_thread_setting():
    """`_one_query` scans on one OpenMP thread of the calling thread: the same neighbours as
    FAISS's own search (with and without a selector), and this thread's setting as it was."""
    import threading

    import faiss

    from agentmem.tiers.recall import _one_query

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 32)).astype(np.float32)
    index = faiss.IndexIDMap2(faiss.IndexFlatIP(32))
    index.add_with_ids(x, np.arange(10, 3010, dtype=np.int64))
    q = x[5:6] + 0.01
    sel = faiss.SearchParameters(sel=faiss.IDSelectorRange(100, 2000))
    out = {}

    def run():
        faiss.omp_set_num_threads(2)
        out["plain"] = _one_query(index, q, 50)
        out["selected"] = _one_query(index, q, 50, sel)
        out["after"] = faiss.omp_get_max_threads()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    want, want_ids = index.search(q, 50)
    assert np.array_equal(out["plain"][1], want_ids) and np.allclose(out["plain"][0], want)
    assert out["plain"][1][0, 0] == 15
    got = out["selected"][1][0]
    assert np.array_equal(got, index.search(q, 50, params=sel)[1][0])
    assert ((got >= 100) & (got < 2000)).all()
    assert out["after"] == 2


def test_the_pre_cut_scores_equal_the_rule_written_out():
    """`_pre_scores` (the order the metadata cut keeps) is each candidate's fused score times its
    text prior, its window factor and its speaker boost, computed for all candidates at once;
    the rule written out per candidate gives the same numbers on random candidates."""
    import math
    import random
    from types import SimpleNamespace

    from agentmem.tiers import recall
    from agentmem.tiers.query import ParsedQuery
    from agentmem.tiers.timeparse import TimeWindow

    rnd = random.Random(7)
    t0 = datetime(2023, 5, 1, tzinfo=UTC).timestamp()
    rows = list(range(1, 301))
    ui = SimpleNamespace(info={r: rnd.choice([1.0, 0.41, 0.82]) for r in rows if rnd.random() < 0.7},
                         asks={r for r in rows if rnd.random() < 0.1},
                         times={r: t0 + rnd.uniform(-60, 60) * 86400 for r in rows if rnd.random() < 0.95},
                         who={r: rnd.randrange(3) for r in rows if rnd.random() < 0.8},
                         codes={"Priya": 0, "Tom": 1, "Ana": 2})
    specific = {r: rnd.random() for r in rows if rnd.random() < 0.9}
    labels = ["dense", "context", "lexical", "facts", "time", "person"]
    cands = []
    for r in rows:
        c = recall._Cand(recall._MESSAGE, r, lexical_share=rnd.random())
        for label in rnd.sample(labels, rnd.randrange(1, 4)):
            c.ranks[label] = rnd.randrange(100)
        cands.append(c)
    window = TimeWindow(datetime(2023, 4, 20, tzinfo=UTC), datetime(2023, 5, 10, tzinfo=UTC), "in late April")

    def written_out(c, pq):
        f = ui.info.get(c.row_id, 1.0) * specific.get(c.row_id, 1.0) * (
            recall.QUESTION_WEIGHT if c.row_id in ui.asks else 1.0)
        t = ui.times.get(c.row_id)
        if pq.window is not None and t is not None:
            lo, hi = pq.window.since.timestamp(), pq.window.until.timestamp()
            if lo <= t < hi:
                f *= recall.WINDOW_BOOST
            elif lo - recall.NEAR_WINDOW_S <= t < hi + recall.NEAR_WINDOW_S:
                f *= recall.NEAR_WINDOW_BOOST
        if pq.people and c.row_id in ui.who:
            f *= recall.SPEAKER_BOOST if any(ui.codes.get(p) == ui.who[c.row_id] for p in pq.people) else 1.0
        fused = sum(recall.WEIGHTS[k] / (recall.RRF_K + v) for k, v in c.ranks.items())
        if "lexical" in c.ranks:
            fused -= recall.WEIGHTS["lexical"] / (recall.RRF_K + c.ranks["lexical"]) * (1 - math.sqrt(c.lexical_share))
        return fused * f

    for pq in (ParsedQuery("q", []), ParsedQuery("q", [], people=["Tom"], window=window),
               ParsedQuery("q", [], people=["Priya", "Nobody"]), ParsedQuery("q", [], window=window)):
        got = recall._pre_scores(ui, cands, pq, specific)
        assert got == [written_out(c, pq) for c in cands]
        assert len(set(got)) > 200  # the factors vary: the comparison is not between constants


def test_the_diverse_pick_equals_the_greedy_rule_it_implements():
    """`_diverse` updates each item's weight per pick; the rule it implements recomputes every
    weight against every pick so far. Random rankings with ties, shared sessions, sessionless
    items (memories) and near-duplicate texts pick the same items in the same order."""
    import random

    from agentmem.tiers.recall import DUPLICATE_DECAY, SESSION_DECAY, _Cand, _diverse, _repeats

    def reference(ranked, k, session_of, words_of):
        left, taken, seen, out = list(ranked), {}, [], []
        while left and len(out) < k:
            def weight(item):
                w = item[0].score * SESSION_DECAY ** taken.get(session_of(item), 0)
                return w * DUPLICATE_DECAY if _repeats(words_of(item), seen) else w
            item = left.pop(max(range(len(left)), key=lambda i: weight(left[i])))
            if (s := session_of(item)) is not None:
                taken[s] = taken.get(s, 0) + 1
            seen.append(words_of(item))
            out.append(item)
        return out

    rng = random.Random(7)
    vocab = ["tea", "run", "cello", "flat", "keys", "work", "home", "late", "park", "cat"]
    for _ in range(200):
        n = rng.randint(0, 30)
        ranked = [(_Cand(0, i, score=rng.choice([1.0, 0.5, rng.random()])),
                   rng.choice(["a", "b", "c", None]), frozenset(rng.sample(vocab, rng.randint(0, 4))))
                  for i in range(n)]
        for k in (1, 5, 10):
            got = _diverse(ranked, k, lambda cr: cr[1], lambda cr: cr[2])
            assert [c.row_id for c, *_ in got] == [c.row_id for c, *_ in reference(ranked, k, lambda cr: cr[1],
                                                                                    lambda cr: cr[2])]


@pytest.mark.parametrize("query", ["the of and a", "x" * 100_000, '" * NEAR : -( ) ^ AND OR NOT',
                                   "café ünïcode 東京 emoji 🎻", "SELECT * FROM messages; --", "NEAR(a b, 2)"])
def test_bad_queries_give_results_or_clear_errors(store, query):
    _conversation(store, sessions=[SMALL_TALK])
    hits = store.search("default", "alice", query, k=3)
    assert len(hits) <= 3
    for h in hits:
        assert h.kind == "message"


def test_empty_query_is_a_clear_error(store):
    with pytest.raises(InvalidInput, match="empty"):
        store.search("default", "alice", "   ")


def test_query_terms_and_people():
    assert content_terms("What did Tom's sister buy in the shop?") == ["tom", "sister", "buy", "shop"]
    assert content_terms("the of and") == []
    assert len(content_terms(" ".join(f"w{i}" for i in range(1000)))) == 48
    pq = parse_query("What did Tom's sister buy last week?", ["Tom", "Priya"], datetime(2023, 8, 2, tzinfo=UTC))
    assert pq.people == ["Tom"] and "tom" not in pq.terms and pq.window is not None
    assert parse_query("When did Priya move?", ["Priya"]).asks_when
    # a speaker known by a full name is named by the first name alone, unless two share it
    pq = parse_query("What did Caroline's sister paint?", ["Caroline Smith", "Mel Jones"])
    assert pq.people == ["Caroline Smith"] and "caroline" not in pq.terms
    assert pq.dense_text == "What did someone's sister paint?"
    pq = parse_query("What did Caroline paint?", ["Caroline Smith", "Caroline Jones"])
    assert pq.people == [] and "caroline" in pq.terms
    assert parse_query("What did Caroline Jones paint?", ["Caroline Smith", "Caroline Jones"]).people == [
        "Caroline Jones"]
    assert parse_query("What did Smith paint?", ["Caroline Smith"]).people == []  # a surname alone is no one


# (question, reference 'now', expected since, expected until) -- `now` is a Wednesday
NOW = datetime(2023, 8, 2, 15, 0, tzinfo=UTC)
TIME_TABLE = [
    ("What did Tom cook last week?", NOW, "2023-07-24", "2023-07-31"),
    ("What happened yesterday?", NOW, "2023-08-01", "2023-08-02"),
    ("the day before yesterday", NOW, "2023-07-31", "2023-08-01"),
    ("What did Priya do in May 2023?", NOW, "2023-05-01", "2023-06-01"),
    ("Where was he in March?", NOW, "2023-03-01", "2023-04-01"),
    ("in December", NOW, "2022-12-01", "2023-01-01"),  # the last December before 'now'
    ("What did we do on 7 May 2023?", NOW, "2023-05-07", "2023-05-08"),
    ("What happened on May 20th?", NOW, "2023-05-20", "2023-05-21"),
    ("on 2023-06-14", NOW, "2023-06-14", "2023-06-15"),
    ("what did he do last weekend", NOW, "2023-07-29", "2023-07-31"),
    ("plans for this month", NOW, "2023-08-01", "2023-09-01"),
    ("last month", NOW, "2023-07-01", "2023-08-01"),
    ("last year", NOW, "2022-01-01", "2023-01-01"),
    ("in 2021", NOW, "2021-01-01", "2022-01-01"),
    ("early June", NOW, "2023-06-01", "2023-06-12"),
    ("late June", NOW, "2023-06-20", "2023-07-01"),
    ("last Monday", NOW, "2023-07-31", "2023-08-01"),
    ("two weeks ago", NOW, "2023-07-16", "2023-07-23"),
    ("3 days ago", NOW, "2023-07-29", "2023-08-01"),
    ("last week", datetime(2024, 1, 3, tzinfo=UTC), "2023-12-25", "2024-01-01"),
    ("last month", datetime(2024, 1, 15, tzinfo=UTC), "2023-12-01", "2024-01-01"),
]


@pytest.mark.parametrize(("question", "now", "since", "until"), TIME_TABLE)
def test_time_phrases(question, now, since, until):
    w = parse_time(question, now)
    assert w is not None, question
    assert (w.since.date().isoformat(), w.until.date().isoformat()) == (since, until)


@pytest.mark.parametrize("question", ["What may I bring?", "When did Tom move house?", "Which instrument?",
                                      "I will march on", "the mar of the sea"])
def test_no_time_where_there_is_none(question):
    assert parse_time(question, NOW) is None


@pytest.mark.parametrize("question, window", [
    ("What food can Jun not eat because of an allergy?", None),
    ("Which novel did Jun recommend?", None),
    ("What did April cook for August?", None),
    ("What did Jun do in June 2023?", "June 2023"),
    ("What did Jun do in Jun?", "Jun"),
    ("What did April bake in April?", "April"),
    ("Where was Jun in early June?", "early June"),
    ("What did Rosa cook in June?", "June"),
])
def test_a_speaker_named_like_a_month_is_a_person_unless_a_date_is_around_it(question, window):
    """A month word that is also a speaker's name ("Jun", "April", "June", "August") names a
    month only as "may" the verb does: after a preposition, with a year or early/mid/late."""
    pq = parse_query(question, ["Rosa", "Jun", "April", "August"], NOW)
    assert (pq.window.phrase if pq.window else None) == window
    assert parse_time(question, NOW) is not None  # without the names, each reads as a month


def test_lazy_index_and_hard_time_filters(store):
    sid = store.open_session("default", "bob").id
    store.add_messages("default", "bob", sid, [
        {"role": "user", "content": f"Day {i}: I walked the dog in the park", "created_at": T0 + timedelta(days=i)}
        for i in range(400)])
    ui = store.recall._indexes.get(("default", "bob"))
    assert ui is None or not ui.messages  # writes did not wait for embeddings
    hits = store.search("default", "bob", "dog walk in the park", k=5, since=T0 + timedelta(days=300),
                        until=T0 + timedelta(days=302, hours=12))
    assert sorted(h.text for h in hits) == [f"Day {i}: I walked the dog in the park" for i in (300, 301, 302)]


def test_the_exact_index_holds_fp16_and_an_fp32_one_is_converted_on_load(tmp_path, embedder, monkeypatch):
    """Below the IVF's size the index scans every vector, held as fp16. An index written by an
    earlier version (fp32 `IndexFlatIP`) is narrowed when it is loaded: the same ids and
    vectors, nothing embedded again, the same hits."""
    import faiss

    from agentmem.tiers import recall

    store = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    sid = store.open_session("default", "ann").id
    topics = ["sailing", "baking bread", "chess", "gardening", "jazz"]
    msgs = store.add_messages("default", "ann", sid, [
        {"role": "user", "content": f"Day {i}: today was about {topics[i % 5]} with friend number {i}"}
        for i in range(60)] + [{"role": "user", "content": "I finally bought a second-hand cello"}])
    ui = store.recall.sync("default", "ann")
    base = faiss.downcast_index(ui.index.index)
    assert isinstance(base, faiss.IndexScalarQuantizer) and base.code_size == 2 * ui.index.d
    before = [h.id for h in store.search("default", "ann", "Which instrument did she buy?", k=5)]
    assert before[0] == msgs[-1].id
    vecs, ids = recall._all_vectors(ui.index)
    old = faiss.IndexIDMap2(faiss.IndexFlatIP(ui.index.d))
    old.add_with_ids(vecs, ids)
    ui.index, ui.dirty = old, 1
    store.recall.flush("default", "ann")
    store.recall._indexes.pop(("default", "ann"))
    monkeypatch.setattr(embedder, "embed", lambda texts, **kw: pytest.fail("embedded again"))
    again = store.recall._current(("default", "ann"), store.recall._epoch(("default", "ann")))
    assert isinstance(faiss.downcast_index(again.index.index), faiss.IndexScalarQuantizer) and again.dirty
    back, back_ids = recall._all_vectors(again.index)
    assert np.array_equal(back_ids, ids) and np.abs(back - vecs).max() < 1e-3
    monkeypatch.undo()
    assert [h.id for h in store.search("default", "ann", "Which instrument did she buy?", k=5)] == before
    store.close()


def test_large_history_moves_to_an_ivf_index(tmp_path, embedder, monkeypatch):
    import faiss

    from agentmem.tiers import recall

    monkeypatch.setattr(recall, "IVF_MIN_VECTORS", 400)
    store = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    sid = store.open_session("default", "big").id
    topics = ["sailing", "baking bread", "chess", "gardening", "jazz", "hiking", "painting", "cycling"]
    msgs = store.add_messages("default", "big", sid, [
        {"role": "user", "content": f"Day {i}: today was about {topics[i % 8]} with friend number {i}"}
        for i in range(240)])
    ui = store.recall.sync("default", "big")
    assert isinstance(ui.index, faiss.IndexIVFScalarQuantizer) and ui.index.ntotal == 480  # fp16 vectors
    assert ui.index.code_size == 2 * ui.index.d
    hit = store.search("default", "big", "friend number 123 and chess", k=3)
    assert msgs[123].id in [h.id for h in hit]
    # an IVF-flat written before (fp32 vectors) is converted on load, its vectors kept, nothing embedded again
    vecs, ids = recall._all_vectors(ui.index)
    assert np.abs(np.linalg.norm(vecs, axis=1) - 1).max() < 1e-2
    old = faiss.IndexIVFFlat(faiss.IndexFlatIP(ui.index.d), ui.index.d, ui.index.nlist, faiss.METRIC_INNER_PRODUCT)
    old.train(vecs)
    old.add_with_ids(vecs, ids)
    ui.index, ui.dirty = old, 1
    store.recall.flush("default", "big")
    store.recall._indexes.pop(("default", "big"))
    calls = []
    monkeypatch.setattr(embedder, "embed", lambda texts, **kw: calls.append(texts) or pytest.fail("embedded again"))
    again = store.recall._current(("default", "big"), store.recall._epoch(("default", "big")))
    assert isinstance(again.index, faiss.IndexIVFScalarQuantizer) and again.index.ntotal == 480 and again.dirty
    back, back_ids = recall._all_vectors(again.index)
    order = np.argsort(back_ids)
    assert np.array_equal(back_ids[order], np.sort(ids)) and np.abs(back[order] - vecs[np.argsort(ids)]).max() < 1e-3
    monkeypatch.undo()
    monkeypatch.setattr(recall, "IVF_MIN_VECTORS", 400)
    store.delete_user("default", "big")
    sid = store.open_session("default", "big").id
    store.add_messages("default", "big", sid, [{"role": "user", "content": "Just one line now"}])
    assert store.recall.sync("default", "big").index.ntotal == 2
    store.close()


def test_bench_memory_questions_do_not_repeat_their_evidence():
    """`bench memory` measures recall only if its questions are worded unlike their facts."""
    from agentmem.bench.memory import FACTS
    from agentmem.bench.recall_data.words import shared_stems

    for _key, statement, change, question, values in FACTS:
        for said in (statement, change):
            if said is not None:
                assert not shared_stems(said.format(v=values[0]), question), (said, question)


def test_embedder_dtype_setting():
    import torch

    from agentmem.engine.engine import cpu_has_bf16
    from agentmem.tiers.embed import load_embedder

    def dtype(e):
        return next(e.model.parameters()).dtype

    assert dtype(load_embedder(dtype="float32")) == torch.float32
    assert dtype(load_embedder()) == (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    with pytest.raises(ValueError, match="embed dtype"):
        load_embedder(dtype="float16")


def test_a_query_takes_the_lean_forward_with_the_models_own_vectors(embedder):
    """The quick lane's forward (tiers/lean.py) gives `encode`'s vectors (fp32: rounding
    only), on questions, odd text and a text past the model's 256 tokens; bulk calls keep
    `encode` (batches, padding)."""
    import numpy as np
    import torch

    from agentmem.tiers.lean import LeanBert

    if next(embedder.model.parameters()).dtype != torch.float32:
        pytest.skip("the fp32 comparison: this embedder is bf16")
    assert isinstance(embedder.lean, LeanBert)
    texts = ["Which instrument did Priya pick up?", "", "  spaces   around  ", "NEAR * \" : ( )",
             "Ünïcödé — naïve café 東京 🎻", "word " * 400, "When did Tom move house? " * 3]
    got = embedder.lean(texts)
    want = embedder._encode(texts)
    assert got.shape == want.shape == (len(texts), embedder.dim)
    assert np.abs(got - want).max() < 1e-5
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    # the lanes: a query goes through the lean forward, a long text through encode
    calls = []
    lean, encode = embedder.lean, embedder._encode
    try:
        embedder.lean = lambda t: calls.append(("lean", len(t))) or lean(t)
        embedder._encode = lambda t: calls.append(("encode", len(t))) or encode(t)
        embedder.embed(["a short question?"])
        embedder.embed(["long " * 200])
    finally:
        embedder.lean = lean
        del embedder._encode
    assert calls == [("lean", 1), ("encode", 1)]


def test_the_lean_forward_refuses_what_it_does_not_compute(embedder):
    """A model of another layout gets no lean forward, and one whose vectors differ from the
    model's own fails the check (the queries then use `encode`). The tolerance is the one
    `load_embedder` applies for the embedder's dtype: a bf16 lean forward and `encode` part by
    more than 1e-3 of cosine where oneDNN runs bf16 on AMX (0.99877 on an AMX Xeon VM)."""
    import numpy as np
    import torch

    from agentmem.tiers.embed import LEAN_TOLERANCE, LEAN_TOLERANCE_BF16
    from agentmem.tiers.lean import LeanBert

    bf16 = next(embedder.model.parameters()).dtype == torch.bfloat16
    tol = LEAN_TOLERANCE_BF16 if bf16 else max(LEAN_TOLERANCE, 1e-3)
    assert LeanBert.of(object()) is None
    assert LeanBert.of([embedder.model[0]]) is None  # no pooling module
    lean = LeanBert.of(embedder.model)
    assert lean is not None
    assert lean.check(embedder._encode, tol)
    assert not lean.check(lambda t: np.roll(embedder._encode(t), 1, axis=1), tol)

    def broken(texts):
        raise RuntimeError("no")

    lean._one = broken
    assert not lean.check(embedder._encode, tol)


# --- events as time anchors, neighbour turns, looped replies, sentence vectors ----------------
LONG = ("Hey! sorry I have been so quiet, work has been chaos all week with three deadlines and a broken printer. "
        "Oh and we finally adopted a greyhound from the shelter, she is called Pepper.")


def test_a_long_turn_is_found_by_one_of_its_sentences_and_returned_whole(store):
    from agentmem.tiers.recall import sentences

    assert sentences(LONG) == ["sorry I have been so quiet, work has been chaos all week with three deadlines "
                               "and a broken printer.",  # "Hey!" alone is too short to say anything
                               "Oh and we finally adopted a greyhound from the shelter, she is called Pepper."]
    assert sentences("Short turn. Two sentences.") == []
    ids = _conversation(store, sessions=[SMALL_TALK + [("Priya", LONG, 0), ("Tom", "Work sounds awful", 0),
                                                       ("Priya", "The printer at work is broken again", 0)]])
    ui = store.recall.sync("default", "alice")
    assert ui.messages[ids[LONG]] == 1 + 1 + len(sentences(LONG))  # text, context, one per sentence
    hit = store.search("default", "alice", "Which dog did Priya take home?", k=3, retrievers=("dense",))[0]
    assert hit.id == ids[LONG] and hit.text == LONG and hit.chunk == 0 and hit.retrievers == ["dense"]


@pytest.mark.parametrize("question, relation, days, phrase", [
    ("What happened with Sofia in the days after getting back from Lisbon?", "after", 7, "getting back from Lisbon"),
    ("What did Priya do the week after her trip to Oaxaca?", "after", 8, "her trip to Oaxaca"),
    ("Where did Tom go the month before his wedding?", "before", 31, "his wedding"),
    ("What did she eat following the marathon", "after", 14, "the marathon"),
    ("What exercise did Sofia do before the current one?", None, None, None),
    ("What did he do after that?", None, None, None),
])
def test_events_that_date_a_question(question, relation, days, phrase):
    from agentmem.tiers.timeparse import parse_anchor

    got = parse_anchor(question)
    assert (got.relation, got.days, got.phrase) == (relation, days, phrase) if relation else got is None


def test_the_week_after_an_event_is_found_through_the_events_own_date(store):
    trip = [("Priya", "Back home from Lisbon now, miss the pastries already", 0), ("Tom", "Welcome back!", 0)]
    after = [("Priya", "Yesterday I ran a 5k, long story", 5), ("Tom", "Wow, good for you", 5)]
    far = [("Priya", "Yesterday I went climbing with my cousin", 60), ("Tom", "Sounds fun", 60)]
    ids = _conversation(store, sessions=[SMALL_TALK, trip, after, far])
    q = parse_query("What did Priya do the week after her trip to Lisbon?", ["Priya", "Tom"], T0)
    assert q.window is None and q.anchor is not None
    from agentmem.tiers.recall import BRIEF_DEPTH, DEPTH

    asked = []  # the full-text searches' depths: the question's, and the brief one for its event
    lexical_search = store.archive.lexical_search
    store.archive.lexical_search = lambda *a, **kw: asked.append(a[3]) or lexical_search(*a, **kw)
    hits = store.search("default", "alice", "What did Priya do the week after her trip to Lisbon?", k=4)
    assert DEPTH in asked and BRIEF_DEPTH in asked and set(asked) == {DEPTH, BRIEF_DEPTH}
    ranked = [h.id for h in hits]
    five_k, climbing = ids["Yesterday I ran a 5k, long story"], ids["Yesterday I went climbing with my cousin"]
    assert five_k in ranked and "time" in hits[ranked.index(five_k)].retrievers
    assert climbing not in ranked or ranked.index(five_k) < ranked.index(climbing)


def test_an_event_told_of_after_it_happened_dates_the_question_not_its_announcement(store):
    from agentmem.tiers.recall import event_time

    # the event's best match is the trip's announcement; the telling of it comes three weeks later
    announce = [("Priya", "Lisbon trip booked!! off on Friday for my trip, two weeks of pastries", 0),
                ("Tom", "Jealous", 0)]
    early = [("Priya", "Yesterday I went climbing with my cousin", 4), ("Tom", "Sounds fun", 4)]
    back = [("Priya", "Back home from my Lisbon trip now, miss the pastries already", 20), ("Tom", "Welcome back!", 20)]
    after = [("Priya", "Yesterday I ran a 5k, long story", 24), ("Tom", "Wow, good for you", 24)]
    ids = _conversation(store, sessions=[SMALL_TALK, announce, early, back, after])
    question = "What did Priya do the week after her trip to Lisbon?"
    event = store.search("default", "alice", "her trip to Lisbon Priya", k=3)
    assert {ids[announce[0][1]], ids[back[0][1]]} <= {h.id for h in event}
    assert event_time(event) == next(h.time for h in event if h.id == ids[back[0][1]])
    hits = store.search("default", "alice", question, k=4)
    ranked = [h.id for h in hits]
    five_k, climbing = ids[after[0][1]], ids[early[0][1]]
    assert five_k in ranked and "time" in hits[ranked.index(five_k)].retrievers
    assert climbing not in ranked or ranked.index(five_k) < ranked.index(climbing)
    # a weak second match does not move the date: the best hit's stands
    weak = [h for h in event if h.id == ids[announce[0][1]]] + [
        replace(h, score=0.1 * h.score) for h in event if h.id == ids[back[0][1]]]
    assert event_time(weak) == weak[0].time


def test_a_short_reply_comes_with_its_question_and_a_question_with_its_answer(store):
    ids = _conversation(store, sessions=[SMALL_TALK + [
        ("Tom", "What did you end up buying at the flea market?", 0), ("Priya", "The cello!", 0)]])
    hits = store.search("default", "alice", "the cello", k=3, retrievers=("lexical",))
    reply = next(h for h in hits if h.id == ids["The cello!"])
    assert reply.context == 'in reply to Tom: "What did you end up buying at the flea market?"'
    hits = store.search("default", "alice", "flea market buying", k=3, retrievers=("lexical",))
    asked = next(h for h in hits if h.id == ids["What did you end up buying at the flea market?"])
    assert asked.context == 'Priya answered: "The cello!"'
    from agentmem.assemble import memory_line

    assert memory_line(reply).endswith('"The cello!" (in reply to Tom: "What did you end up buying at the flea market?")\n')
    # the hot-segment precompute builds the same line, so its chunk-KV key is the one the prompt uses
    from agentmem.reflect import hot_segments

    store.record_turn("default", "alice", reply.session_id, {"memories_used": [{"ref": reply.ref}]})
    assert [seg.text for seg in hot_segments(store, "default", "alice", 1)] == [memory_line(reply)]
    long = next(h for h in store.search("default", "alice", "weather awful", k=3, retrievers=("lexical",))
                if h.id == ids["Same here, the weather was awful"])
    assert long.context == 'in reply to Tom: "Pretty quiet, mostly slept haha"'


def test_looped_replies_are_read_incrementally(store):
    archive = store.archive
    sid = store.open_session("default", "lou").id
    first = store.add_messages("default", "lou", sid, [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": "hi hi hi"}])
    store.record_turn("default", "lou", sid, {"stats": {"finish_reason": "repetition"},
                                              "message_ids": [m.id for m in first]})
    got, top = archive.looped_since("default", "lou")
    assert got == {first[1].id} and top > 0
    assert archive.looped_since("default", "lou", top) == (set(), top)
    more = store.add_messages("default", "lou", sid, [{"role": "user", "content": "and?"},
                                                      {"role": "assistant", "content": "fine"}])
    store.record_turn("default", "lou", sid, {"stats": {"finish_reason": "stop"}, "message_ids": [m.id for m in more]})
    got, newer = archive.looped_since("default", "lou", top)
    assert got == set() and newer > top


def test_a_question_naming_a_person_ranks_their_turns_apart(store, tmp_path, embedder):
    """The `person` vote: the same dense and full-text search over the named speaker's turns
    only. Tom talks about cooking a lot; Priya once. Asked about Priya, her turn carries the
    vote and none of Tom's does."""
    tom = [("Tom", f"Made {dish} for dinner again, cooking is my therapy", 0)
           for dish in ("risotto", "ramen", "a curry", "lasagne", "paella", "tacos", "dumplings", "a stew")]
    chat = [t for pair in zip(tom, [("Priya", "nice", 0)] * len(tom), strict=True) for t in pair]
    ids = _conversation(store, sessions=[SMALL_TALK, chat + [("Priya", "I tried baking sourdough bread, it went flat", 1),
                                                            ("Tom", "Next time it will rise", 1)]])
    bread = ids["I tried baking sourdough bread, it went flat"]
    hits = store.search("default", "alice", "What did Priya cook?", k=5)
    assert bread in [h.id for h in hits]
    assert "person" in next(h for h in hits if h.id == bread).retrievers
    assert not any("person" in h.retrievers for h in hits if h.name == "Tom")
    # the full-text side filters in SQL
    only = store.archive.lexical_search("default", "alice", ["cooking", "bread"], 50, speakers=["Priya"])
    assert [i for i, _ in only] == [bread]
    assert store.archive.lexical_search("default", "alice", ["cooking"], 50, speakers=[]) == []
    # the speakers survive a reload of the index from disk
    who = dict(store.recall.sync("default", "alice").who)
    store.close()
    again = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    try:
        assert again.recall.sync("default", "alice").who == who and len(set(who.values())) == 2
    finally:
        again.close()


def test_a_row_committed_late_below_the_newest_is_indexed(store):
    """Two replicas' transactions: the one that took the lower id commits after the index has
    seen the higher. The index's check (oldest id, newest id, how many in the last second of
    ids) notices it without counting the whole history."""
    from agentmem.tiers.schema import MessageRow

    ids = _conversation(store, sessions=[SMALL_TALK])
    ui = store.recall.sync("default", "alice")
    top = max(ids.values())
    assert ui.top_id == top
    sid = store.list_sessions("default", "alice")[0].id
    with store.archive.tx() as s:  # a lower id than the newest, committed now
        s.add(MessageRow(id=top - 7, tenant_id="default", user_id="alice", session_id=sid, role="user",
                         name="Priya", text="I adopted a greyhound called Pepper", created_at=T0))
    assert store.archive.message_bounds("default", "alice", min(ids.values()) - 1) == (min(ids.values()), top, len(ids) + 1)
    hits = store.search("default", "alice", "greyhound Pepper", k=3)
    assert hits[0].id == top - 7
    assert top - 7 in store.recall.sync("default", "alice").messages


@pytest.mark.slow  # runs `agentmem bench memory` on the model
def test_bench_memory_repeats_its_questions_under_other_sampling_seeds(capsys):
    """`--sampling-seeds N`: every question asked N times (each repeat in a tenant of its own,
    with other seeds), one accuracy per seed and their mean in the JSON."""
    import json

    from agentmem.bench.memory import main

    assert main(["--quick", "--json", "--no-reflect", "--sampling-seeds", "2", "--dtype", "float32"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    by_seed = got["answer_accuracy_by_seed"]
    assert len(by_seed) == 2 and all(0 <= a <= 1 for a in by_seed)
    assert by_seed[0] == got["answer_accuracy"] and got["answer_accuracy_mean"] == sum(by_seed) / 2
    assert got["questions"] == 4 and got["evidence_in_prompt"] >= 0.75


def test_small_talk_said_again_and_again_yields_to_a_fact_said_once(tmp_path, embedder, monkeypatch):
    """The specificity prior (tiers/specific.py): fused without it, "Where does Arjun work?"
    ranks every pyjamas turn (a word in common, the person asked about) above the pharmacy
    turn said once; with it, the pharmacy turn is first. The statistics are saved with the
    index and read back on reopen."""
    from agentmem.tiers import specific

    chatter = [("Arjun", f"Working from home today, still in pyjamas at {3 + d % 6}pm", d) for d in range(40)]
    other = [("Lena", f"Ha, same here on day {d}, how is the weather your side", d) for d in range(40)]
    fact = ("Arjun", "First week at the hospital pharmacy done, everyone is lovely", 41)
    turns = [t for pair in zip(chatter, other, strict=True) for t in pair] + [fact]
    store = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    ids = _conversation(store, sessions=[turns])
    q = "Where does Arjun work?"
    assert store.search("default", "alice", q, k=3)[0].id == ids[fact[1]]
    with monkeypatch.context() as m:
        m.setattr(specific, "EXPONENT", 0.0)
        assert ids[fact[1]] not in [h.id for h in store.search("default", "alice", q, k=5)]
    store.close()
    again = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    ui = again.recall.sync("default", "alice")
    assert len(ui.terms) == len(turns)
    assert ui.terms.weight(ids[fact[1]]) > 0.9 and ui.terms.weight(ids[turns[0][1]]) < 0.2
    assert again.search("default", "alice", q, k=3)[0].id == ids[fact[1]]
    again.delete_user("default", "alice")
    assert len(again.recall.sync("default", "alice").terms) == 0
    again.close()


def test_dense_ranking_discounts_what_many_of_the_users_turns_share(tmp_path):
    """A direction many turns lean along ("lol haha lol ..." in 40 of 300) no longer decides the
    dense ranking: with the user's top principal components taken out, the turn that says
    something about the question's content word ranks first; with plain cosine (pcs 0) the
    40 turns that share the question's filler words rank above it."""
    import random

    from agentmem.bench.recall_cache import HashEmbedder
    from agentmem.tiers.recall import _project

    rng = random.Random(0)
    letters = "bcdfghjklmnprstvz"
    filler = ["".join(rng.choice(letters) + rng.choice("aeiou") for _ in range(3)) for _ in range(400)]
    turns = [" ".join(["lol", "haha", "lol", *rng.sample(filler, 3)]) if i % 7 == 0 else " ".join(rng.sample(filler, 4))
             for i in range(280)]
    turns.insert(140, "finally bought a second hand cello")
    rank = {}
    for pcs in (0, 8):
        s = MemoryStore(Config(data_dir=tmp_path / str(pcs), recall_whiten_pcs=pcs), embedder=HashEmbedder())
        sid = s.open_session("t", "u").id
        s.add_messages("t", "u", sid, [{"role": "user", "content": t, "created_at": T0 + timedelta(minutes=i)}
                                       for i, t in enumerate(turns)])
        texts = [h.text for h in s.search("t", "u", "lol haha cello", k=50, retrievers=("dense",))]
        rank[pcs] = texts.index(turns[140]) if turns[140] in texts else len(texts)
        s.close()
    assert rank[8] == 0
    assert rank[0] >= 10
    # the projection takes the components out and leaves unit rows
    top = np.linalg.qr(np.random.default_rng(0).normal(size=(384, 3)))[0].T.astype(np.float32)
    x = np.random.default_rng(1).normal(size=(5, 384)).astype(np.float32)
    p = _project(x, x.mean(axis=0), top)
    assert np.allclose(p @ top.T, 0, atol=1e-5) and np.allclose(np.linalg.norm(p, axis=1), 1, atol=1e-5)


def test_a_photo_whose_caption_holds_the_fact_is_found_and_shown_with_it(store):
    """"look at her 😭" says nothing by itself: its caption is what it says. The dense text view
    and the priors (information, specificity) read the caption, and the prompt line shows it; a
    message without one is unchanged."""
    sid = store.open_session("default", "alice").id
    talk = SMALL_TALK * 4 + [("Priya", "My neighbour's dog barked all night again", 0),
                             ("Tom", "Do you prefer cats or dogs?", 0), ("Priya", "Dogs, always", 0)]
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "name": who, "content": text,
             "created_at": T0 + timedelta(minutes=i)} for i, (who, text, _) in enumerate(talk)]
    msgs += [{"role": "assistant", "name": "Tom", "content": "look at her 😭",
              "caption": "a photo of a small grey kitten sleeping curled up on a knitted blanket",
              "created_at": T0 + timedelta(days=1)},
             {"role": "user", "name": "Priya", "content": "omg", "created_at": T0 + timedelta(days=1, minutes=1)}]
    ids = {m.text: m.id for m in store.add_messages("default", "alice", sid, msgs)}
    photo = ids["look at her 😭"]
    for retrievers in (("dense",), None):
        hits = store.search("default", "alice", "What kind of pet did Tom adopt?", k=3, retrievers=retrievers)
        assert hits[0].id == photo, [h.text for h in hits]
    hit = hits[0]
    assert hit.keys.startswith("a photo of a small grey kitten")
    from agentmem.assemble import memory_line
    from agentmem.reflect import hot_segments

    line = memory_line(hit)
    assert 'Tom said: "look at her 😭" [attachment: a photo of a small grey kitten' in line
    store.record_turn("default", "alice", hit.session_id, {"memories_used": [{"ref": hit.ref}]})
    assert [seg.text for seg in hot_segments(store, "default", "alice", 1)] == [line]
    plain = next(h for h in store.search("default", "alice", "weather awful", k=5) if h.text.endswith("awful"))
    assert plain.keys is None and "[attachment:" not in memory_line(plain)


@pytest.mark.parametrize("question, people, dense", [
    ("What will Tom bring?", ["Tom"], "What will someone bring?"),
    ("What did Will bring?", ["Will"], "What did someone bring?"),
    ("Where will Will live?", ["Will"], "Where will someone live?"),
    ("What is Will's job?", ["Will"], "What is someone's job?"),
    ("what did will bring", [], "what did will bring"),
])
def test_a_speaker_named_like_a_function_word_is_named_only_as_written(question, people, dense):
    """"Will" is a speaker; "will" is a verb: a speaker whose name is also a stop word is named
    (boosted, masked in the embedded question) only where the question capitalises it."""
    pq = parse_query(question, ["Tom", "Will"], NOW)
    assert pq.people == people and pq.dense_text == dense


@pytest.mark.parametrize("question, dense", [
    ("Which instrument did Priya pick up?", "Which instrument did someone pick up?"),
    ("What is Priya's job? Did Tom know?", "What is someone's job? Did someone know?"),  # a sentence's first word stays
    ("Where did we go at Christmas in May?", "Where did we go at Christmas in May?"),  # times are not people
    ("what did will bring", "what did will bring"),
    ("OK so what TV show did Ana like", "OK so what TV show did someone like"),  # all-capital words are not names
    ("Did Zoë meet José's brother on her iPhone?", "Did someone meet someone's brother on her iPhone?"),
])
def test_with_no_speaker_known_capitalised_words_are_masked_in_the_embedded_question(question, dense):
    """A history that names no speaker (bare user/assistant turns): a name in the question may be
    either party, whose own turns never say it, so it is masked in what MiniLM reads; the
    full-text terms keep it."""
    assert mask_capitalised(question) == dense
    pq = parse_query(question, [], NOW)
    assert pq.dense_text == dense and pq.people == []
    assert parse_query(question, None, NOW).dense_text == dense
    if "Priya" in question:
        assert "priya" in pq.terms
        # with speakers known, only they are masked: a third person keeps their name
        named = parse_query(question, ["Tom"], NOW)
        assert "Priya" in named.dense_text and "Tom" not in named.dense_text


def _neighbour_ids_in_scope(store):
    """`Archive.neighbour_ids`: one query for many (message, step) pairs, each the turn just
    before or after in its own session, never another user's or tenant's row in between."""
    ids = _conversation(store, sessions=[[("Priya", "one", 0), ("Tom", "two", 0), ("Priya", "three", 0)],
                                         [("Priya", "four", 1), ("Tom", "five", 1)]])
    # rows of another user and another tenant, interleaved in id order with alice's
    sid = store.open_session("default", "bob").id
    store.add_messages("default", "bob", sid, [{"role": "user", "content": "bob's turn"}])
    _conversation(store, tenant="other", sessions=[[("Priya", "elsewhere", 0)]])  # the same user id, another tenant
    later = _conversation(store, sessions=[[("Priya", "six", 2), ("Tom", "seven", 2)]])
    a = store.archive
    meta = a.message_meta("default", "alice", [*ids.values(), *later.values()])
    want = [(ids[t], meta[ids[t]].session_id, st) for t in ("one", "two", "three", "four", "five") for st in (-1, 1)]
    want += [(later["six"], meta[later["six"]].session_id, -1), (later["six"], meta[later["six"]].session_id, 1)]
    got = a.neighbour_ids("default", "alice", want)
    assert got == {(ids["one"], 1): ids["two"], (ids["two"], -1): ids["one"], (ids["two"], 1): ids["three"],
                   (ids["three"], -1): ids["two"], (ids["four"], 1): ids["five"], (ids["five"], -1): ids["four"],
                   (later["six"], 1): later["seven"]}
    assert a.neighbour_ids("default", "bob", want) == {}  # bob has no row in alice's sessions
    near = a.neighbours("default", "alice", [(ids["two"], meta[ids["two"]].session_id, 1)])
    assert near[ids["two"]].text == "three"


def test_neighbour_ids_sqlite(store):
    _neighbour_ids_in_scope(store)


def test_neighbour_ids_postgresql(tmp_path, embedder, pg_url):
    s = MemoryStore(Config(data_dir=tmp_path, db_url=pg_url), embedder=embedder)
    try:
        _neighbour_ids_in_scope(s)
    finally:
        s.close()


ANSWERED = [("Kwame", "speaking of Dele, he finally went and got what he always wanted. look at this idiot", 0),
            ("Kwame", "this is Biscuit. she's slept on my side of the sofa every single day since she arrived", 0)]


def test_the_turn_beside_a_top_hit_is_lent_its_support(store, monkeypatch):
    """Evidence over two turns: "who owns Biscuit?" finds "this is Biscuit ..." but the turn
    before it says whose dog she is and shares no word with the question. The head of the
    ranking lends its neighbours support; a turn found only that way says so."""
    from agentmem.tiers import recall

    filler = [("Ines", f"Clinic was busy, saw patient number {i} before lunch", 0) if i % 2 else
              ("Kwame", f"Long day at the studio, mixed track {i} of the album twice", 0) for i in range(30)]
    dogs = [("Ines", "a terrier chased my bike down the street this morning", 0),
            ("Kwame", "the terrier next door barked at the postman for an hour", 0)]
    ids = _conversation(store, sessions=[filler + dogs + [("Ines", "how is the flat?", 0)] + ANSWERED + filler[:10]])
    owner, biscuit = ids[ANSWERED[0][1]], ids[ANSWERED[1][1]]
    q = "Who owns Biscuit the terrier?"

    def scores(**kw):
        return {h.id: h.score for h in store.search("default", "alice", q, k=40, **kw)}

    on = scores()
    monkeypatch.setattr(recall, "NEIGHBOUR_SUPPORT", 0.0)
    off = scores()
    monkeypatch.setattr(recall, "NEIGHBOUR_SUPPORT", 0.15)
    assert biscuit in sorted(off, key=off.get)[-3:]
    assert 0 < on[owner] - off[owner] <= 0.15 * max(on.values()) + 1e-9
    # with few candidates per retriever the owner turn is none of theirs: only its neighbour finds it
    monkeypatch.setattr(recall, "DEPTH", 2)
    hits = store.search("default", "alice", q, k=10)
    assert next(h for h in hits if h.id == owner).retrievers == ["neighbour"]
    # the support obeys what the search excludes: the working context's turns, hard time filters,
    # a single retriever asked for alone
    assert owner not in [h.id for h in store.search("default", "alice", q, k=5, exclude_messages=[owner])]
    lex = store.search("default", "alice", q, k=10, retrievers=("lexical",))
    assert owner not in [h.id for h in lex] and all("neighbour" not in h.retrievers for h in lex)
    assert store.search("default", "alice", q, k=10, until=T0 - timedelta(days=1)) == []


def test_the_models_own_words_are_no_context_and_a_bare_question_is_no_note(store):
    """In a chat with the assistant, its reply is no evidence: a question's "(answered: ...)"
    is never the model's own answer (the demo's 135M model copied its earlier wrong answer from
    there), and a short statement is shown "in reply to" the model only where the model asked
    something. The user's own question with nothing beside it is no note."""
    from agentmem.assemble import note_hits

    sid = store.open_session("default", "dana").id
    store.add_messages("default", "dana", sid, [
        {"role": "user", "content": "Which city do I live in?"},
        {"role": "assistant", "content": "The user's name is Dana."},
        {"role": "assistant", "content": "Hello there, welcome! I'm your friendly guide today."},
        {"role": "user", "content": "I am allergic to peanuts."},
        {"role": "assistant", "content": "Noted. Which colour would you like for the scarf?"},
        {"role": "user", "content": "Blue, the dark one."},
    ])
    hits = {h.text: h for h in store.search("default", "dana", "city live allergic peanuts colour blue dark", k=10,
                                            retrievers=("lexical",))}
    asked, allergy, blue = (hits[t] for t in ("Which city do I live in?", "I am allergic to peanuts.",
                                              "Blue, the dark one."))
    assert asked.context is None and allergy.context is None
    assert blue.context == 'in reply to: "Noted. Which colour would you like for the scarf?"'
    notes = [h.text for h in note_hits([asked, allergy, blue])]
    assert notes == ["I am allergic to peanuts.", "Blue, the dark one."]


def test_an_index_touched_after_its_tenant_is_deleted_is_never_written_back(tmp_path, embedder):
    """A request still under way when its tenant is deleted may load the user's index again
    (empty now) or hold a changed one; neither may reach the disk, at a flush or at close."""
    store = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    tid = store.create_tenant("doomed")
    sid = store.open_session(tid, "ann").id
    store.add_messages(tid, "ann", sid, [{"role": "user", "content": "My locker code is 4242."}])
    store.recall.sync(tid, "ann")
    store.recall.flush(tid, "ann")
    tenant_dir = store.recall._paths(tid, "ann")[0].parent
    assert tenant_dir.exists()
    store.delete_tenant(tid)
    assert not tenant_dir.exists()
    ui = store.recall.sync(tid, "ann")  # the late request: loads an empty index, dirty
    ui.dirty += 1
    store.recall.flush(tid, "ann")
    store.recall._save(tid, "bob", ui)  # an eviction of another of its users
    store.close()
    assert not tenant_dir.exists()
    # another tenant's indexes are still written
    other = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    sid = other.open_session("default", "cat").id
    other.add_messages("default", "cat", sid, [{"role": "user", "content": "I keep bees."}])
    other.recall.sync("default", "cat")
    other.close()
    assert other.recall._paths("default", "cat")[1].exists()
