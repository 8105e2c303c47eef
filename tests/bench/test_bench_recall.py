"""The recall benchmark's generator keeps its promises, and a tiny run keeps the JSON contract."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest

from agentmem.bench.recall import ranked_messages, run, scores
from agentmem.bench.recall_data import CATEGORIES, generate, scale_history
from agentmem.bench.recall_data.words import content_stems, shared_stems


@pytest.fixture(scope="module")
def data():
    return generate(seed=3, conversations=3)


def test_same_seed_same_data_other_seed_other_data():
    a, b, c = generate(5, 2, 6), generate(5, 2, 6), generate(6, 2, 6)
    assert [dataclasses.asdict(x) for x in a.conversations] == [dataclasses.asdict(x) for x in b.conversations]
    assert a.questions == b.questions
    assert [t.text for t in a.conversations[0].turns] != [t.text for t in c.conversations[0].turns]


def test_stems_are_porter_and_skip_stop_words():
    assert content_stems("Which cities has Tom moved to?") == {"citi", "tom", "move"}
    assert shared_stems("When did Priya move house?", "we moved into the new house") == {"move", "hous"}


def test_paraphrase_questions_share_no_content_word_with_their_evidence(data):
    convs = {c.id: c for c in data.conversations}
    para = [q for q in data.questions if q.category == "paraphrase"]
    assert len(para) >= 6
    for q in para:
        assert len(q.evidence) == 1
        assert not shared_stems(q.text, convs[q.conversation].turns[q.evidence[0]].text), q


def test_every_category_present_and_evidence_belongs_to_its_conversation(data):
    assert {q.category for q in data.questions} == set(CATEGORIES)
    convs = {c.id: c for c in data.conversations}
    for q in data.questions:
        turns = convs[q.conversation].turns
        assert q.evidence and all(0 <= i < len(turns) for i in q.evidence), q
        assert len(set(q.evidence)) == len(q.evidence)
        # evidence is said by a speaker of this conversation, on or before its session date
        assert all(turns[i].speaker in convs[q.conversation].speakers for i in q.evidence)


def test_multi_hop_evidence_spans_two_sessions(data):
    convs = {c.id: c for c in data.conversations}
    hops = [q for q in data.questions if q.category == "multi_hop"]
    assert hops
    for q in hops:
        assert len({convs[q.conversation].turns[i].session for i in q.evidence}) == 2, q


def test_distractors_share_more_words_with_the_question_than_the_evidence(data):
    convs = {c.id: c for c in data.conversations}
    for q in (q for q in data.questions if q.category == "distractor"):
        turns = convs[q.conversation].turns
        ev = len(shared_stems(q.text, turns[q.evidence[0]].text))
        near = [t for t in turns if t.index not in q.evidence and len(shared_stems(q.text, t.text)) >= max(2, ev + 1)]
        assert near, q


def test_temporal_answers_follow_from_the_session_date(data):
    convs = {c.id: c for c in data.conversations}
    for q in (q for q in data.questions if q.category == "temporal" and q.text.startswith("When")):
        turn = convs[q.conversation].turns[q.evidence[0]]
        assert q.answer[-10:] <= f"{turn.created_at:%Y-%m-%d}", (q, turn)


def test_conversations_look_like_chat(data):
    conv = data.conversations[0]
    assert 10 <= len(conv.session_dates) <= 25
    assert conv.session_dates == sorted(conv.session_dates)
    assert all(t1.created_at <= t2.created_at for t1, t2 in zip(conv.turns, conv.turns[1:], strict=False))
    sessions = conv.sessions()
    assert all(20 <= len(s) for s in sessions)
    assert {m["role"] for s in sessions for m in s} == {"user", "assistant"}
    assert {m["name"] for s in sessions for m in s} == set(conv.speakers)
    texts = [t.text for t in conv.turns]
    assert any("[image:" in t for t in texts)
    assert len(set(texts)) > len(texts) / 3  # small talk, not one line repeated


def test_scale_history_is_a_timeline():
    msgs, questions = scale_history(1, 700, (10, 20))
    assert len(msgs) == 700 and questions
    assert all(a["created_at"] <= b["created_at"] for a, b in zip(msgs, msgs[1:], strict=False))


def test_scoring_counts_memories_for_their_sources():
    hit = dataclasses.make_dataclass("Hit", ["id", "kind", "source_ids"])
    hits = [hit(7, "fact", [3, 4]), hit(3, "message", [3]), hit(9, "message", [9])]
    assert ranked_messages(hits) == [3, 4, 9]
    r5, r10, ndcg = scores([3, 4, 9], [9, 11])
    assert (r5, r10) == (0.5, 0.5)
    assert math.isclose(ndcg, (1 / math.log2(4)) / (1 + 1 / math.log2(3)))


def test_tiny_run_keeps_the_json_contract(engine, embedder, tmp_path):
    args = argparse.Namespace(seed=0, conversations=1, sessions=3, turns="12,16", scale="60,120", scale_queries=3,
                              no_scale=False, db_url=None, dtype="float32")
    out = run(args, engine, embedder, tmp_path)
    for key in ("evidence_recall_at_5", "evidence_recall_at_10", "ndcg_at_10", "dense_recall_at_10"):
        assert 0.0 <= out[key] <= 1.0
    assert out["lexical_recall_at_10"] is None or 0.0 <= out["lexical_recall_at_10"] <= 1.0
    assert out["evidence_recall_at_5"] <= out["evidence_recall_at_10"]
    assert set(out["by_category"]) == set(CATEGORIES)
    for cat in out["by_category"].values():
        assert set(cat) == {"evidence_recall_at_5", "evidence_recall_at_10", "ndcg_at_10", "dense_recall_at_10",
                            "lexical_recall_at_10", "questions"}
        assert cat["questions"] >= 1 and 0.0 <= cat["evidence_recall_at_10"] <= 1.0
    assert [r["messages"] for r in out["scale"]] == [60, 120]
    for r in out["scale"]:
        assert 0 < r["search_p50_s"] <= r["search_p95_s"] and 0 < r["context_p95_s"] and r["first_search_s"] > 0
        assert r["alternating_search_p95_s"] > 0
    assert out["ingest_msgs_per_s"] > 0 and out["dtype"] == "float32"
    # searchable: the fill plus the first searches, which embed what it added, so never the faster
    assert 0 < out["searchable_msgs_per_s"] < out["ingest_msgs_per_s"]
    assert out["questions"] == sum(c["questions"] for c in out["by_category"].values())


# --- data sets from files (`--dataset`) ----------------------------------------------------------

def _own_file(tmp_path, **over):
    doc = {
        "conversations": [{"id": "A", "speakers": ["Ines", "Kwame"], "sessions": [
            {"date": "2023-01-14T19:05:00", "turns": [
                {"speaker": "Ines", "text": "hey! long week"},
                {"speaker": "Kwame", "text": "look what I made!!", "caption": "a loaf of sourdough bread on a board"},
                {"speaker": "Ines", "text": "we got the keys to the new flat last Tuesday"}]},
            {"date": "2023-02-20T08:00:00+01:00", "turns": [
                {"speaker": "Kwame", "text": "finally bought a second-hand cello"},
                {"speaker": "Ines", "text": "no way, play me something"}]}]}],
        "questions": [
            {"conversation": "A", "question": "Which instrument did Kwame pick up?", "answer": "a cello",
             "category": "single_hop", "evidence": [[1, 0]]},
            {"conversation": "A", "question": "What did Kwame bake?", "answer": "bread", "category": "single_hop",
             "evidence": [[0, 1]]},
            {"conversation": "A", "question": "When did Ines move?", "category": "temporal", "evidence": [[0, 2], [0, 2]]},
            {"conversation": "A", "question": "Out of range", "category": "single_hop", "evidence": [[5, 0]]},
            {"conversation": "Z", "question": "Unknown conversation", "category": "single_hop", "evidence": [[0, 0]]},
        ]}
    doc.update(over)
    path = tmp_path / "own.json"
    path.write_text(__import__("json").dumps(doc))
    return path


def test_own_layout_loads_turns_dates_captions_and_evidence(tmp_path):
    from agentmem.bench.recall_data.dataset import TURN_GAP, load_dataset

    data, skipped = load_dataset(_own_file(tmp_path))
    (conv,) = data.conversations
    assert conv.speakers == ("Ines", "Kwame") and len(conv.turns) == 5 and skipped == 2
    assert [t.session for t in conv.turns] == [0, 0, 0, 1, 1]
    assert conv.turns[1].created_at - conv.turns[0].created_at == TURN_GAP
    assert conv.turns[0].created_at.tzinfo is not None and conv.turns[3].created_at.utcoffset().total_seconds() == 3600
    assert conv.turns[1].caption == "a loaf of sourdough bread on a board" and "[image:" in conv.turns[1].seen
    assert [(q.category, q.evidence) for q in data.questions] == [("single_hop", (3,)), ("single_hop", (1,)),
                                                                  ("temporal", (2,))]
    msgs = conv.sessions()
    assert msgs[0][1] == {"role": "assistant", "content": "look what I made!!", "created_at": conv.turns[1].created_at,
                          "name": "Kwame", "caption": "a loaf of sourdough bread on a board"}
    assert "caption" not in msgs[0][0] and msgs[1][0]["role"] == "assistant"


@pytest.mark.parametrize("name", ["handwritten.json", "handwritten2.json"])
def test_shipped_hand_written_sets_load_whole_and_in_order(name):
    """The hand-written sets `bench recall --dataset` reads: every question kept (its evidence
    names turns of its own conversation), sessions in date order, the five categories."""
    from importlib import resources

    from agentmem.bench.recall_data.dataset import load_dataset

    path = resources.files("agentmem.bench.recall_data") / "data" / name
    data, skipped = load_dataset(str(path))
    assert skipped == 0 and len(data.questions) >= 170
    assert {q.category for q in data.questions} == {"single_hop", "multi_hop", "temporal", "which_person",
                                                    "adversarial"}
    convs = {c.id: c for c in data.conversations}
    for c in convs.values():
        times = [t.created_at for t in c.turns]
        assert times == sorted(times) and len({t.speaker for t in c.turns}) >= 2
    for q in data.questions:
        turns = convs[q.conversation].turns
        assert q.evidence and all(0 <= t < len(turns) for t in q.evidence)
    # multi-hop evidence spans sessions (one question of the first set asks two people of one evening)
    single = [q for q in data.questions if q.category == "multi_hop"
              and len({convs[q.conversation].turns[t].session for t in q.evidence}) < 2]
    assert len(single) <= 1


def test_a_speaker_called_assistant_is_the_assistants_own_replies(tmp_path):
    import json

    from agentmem.bench.recall_data.dataset import load_dataset

    doc = {"conversations": [{"id": "E", "speakers": ["Hana", "assistant"], "sessions": [
        {"date": "2023-03-02T21:10:00", "turns": [
            {"speaker": "Hana", "text": "I'm lactose intolerant, so no cream sauces please"},
            {"speaker": "assistant", "text": "Noted! Here are three dairy-free pasta sauces."}]}]}],
        "questions": []}
    path = tmp_path / "e.json"
    path.write_text(json.dumps(doc))
    (conv,) = load_dataset(path)[0].conversations
    hana, reply = conv.sessions()[0]
    assert hana["role"] == "user" and hana["name"] == "Hana"
    assert reply["role"] == "assistant" and "name" not in reply


def test_locomo_style_layout_loads(tmp_path):
    import json

    from agentmem.bench.recall_data.dataset import load_dataset

    sample = {"sample_id": "s1", "conversation": {
        "speaker_a": "Caroline", "speaker_b": "Melanie",
        "session_1_date_time": "1:56 pm on 8 May, 2023",
        "session_1": [{"speaker": "Caroline", "dia_id": "D1:1", "text": "I went to a support group yesterday"},
                      {"speaker": "Melanie", "dia_id": "D1:2", "text": "so proud!", "blip_caption": "a photo of a cake"}],
        "session_2_date_time": "10:37 am on 27 June, 2023",
        "session_2": [{"speaker": "Melanie", "dia_id": "D2:1", "text": "I ran a charity race last Saturday"}]},
        "qa": [{"question": "When did Caroline go to the support group?", "answer": "7 May 2023",
                "evidence": ["D1:1"], "category": 2},
               {"question": "What did they do?", "evidence": ["D1:2; D2:1"], "category": 1},
               {"question": "Unanswerable", "evidence": [], "category": 5},
               {"question": "Bad id", "evidence": ["D9:9"], "category": 4}]}
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps([sample]))
    data, skipped = load_dataset(path)
    (conv,) = data.conversations
    assert conv.id == "s1" and conv.speakers == ("Caroline", "Melanie") and skipped == 2
    assert conv.turns[0].created_at.isoformat() == "2023-05-08T13:56:00+00:00"
    assert conv.turns[2].session == 1 and conv.turns[1].caption == "a photo of a cake"
    assert [(q.category, q.evidence) for q in data.questions] == [("category_2", (0,)), ("category_1", (1, 2))]


@pytest.mark.parametrize("content, needle", [
    ("not json", "Expecting value"),
    ('{"nothing": 1}', "neither agentmem's layout"),
    ('{"conversations": [{"id": "A", "sessions": [{"date": "yesterday-ish", "turns": []}]}]}', "unreadable date"),
    ('{"conversations": [{"id": "A", "sessions": [{"date": "2023-01-01", "turns": [{"speaker": "A", "text": " "}]}]}]}',
     "text must be a non-empty string"),
    ('{"conversations": [], "questions": [{"conversation": "A", "question": "q", "evidence": [["1", 2]]}]}',
     "is not a \\[session, turn\\] pair"),
    ('{"conversations": [], "questions": [{"conversation": "A", "question": "q", "evidence": "D1:3"}]}',
     "a list of \\[session, turn\\] pairs"),
])
def test_bad_dataset_files_say_what_is_wrong(tmp_path, content, needle):
    from agentmem.bench.recall_data.dataset import DatasetError, load_dataset

    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(DatasetError, match=needle):
        load_dataset(path)


def test_bench_recall_cli_rejects_a_bad_dataset_before_loading_the_model(tmp_path, capsys):
    from agentmem.bench.recall import main

    path = tmp_path / "bad.json"
    path.write_text("[]")
    assert main(["--dataset", str(path)]) == 2
    assert "neither agentmem's layout" in capsys.readouterr().err


def test_run_on_a_dataset_file_scores_its_own_categories(engine, embedder, tmp_path):
    args = argparse.Namespace(seed=0, conversations=1, sessions=None, turns="20,60", scale=None, scale_queries=3,
                              no_scale=False, db_url=None, dtype="float32", dataset=str(_own_file(tmp_path)))
    out = run(args, engine, embedder, tmp_path / "store")
    assert out["dataset"].endswith("own.json") and out["skipped_questions"] == 2 and out["scale"] == []
    assert list(out["by_category"]) == ["temporal", "single_hop"]  # the generator's categories first
    assert out["by_category"]["single_hop"]["questions"] == 2 and out["questions"] == 3
    # five turns: every evidence turn is among the top 10 of every ranking
    assert out["evidence_recall_at_10"] == out["dense_recall_at_10"] == 1.0


def test_import_as_names_prefixes_or_bare_roles():
    """`--import-as`: the same session as a data set gives it (`name`), as a flattened transcript
    ("Name: ..." and no `name`) or as bare user/assistant turns; the input is not changed."""
    from agentmem.bench.recall import IMPORTS, as_imported

    msgs = [{"role": "user", "content": "finally bought a cello", "name": "Kwame", "created_at": "2023-02-20"},
            {"role": "assistant", "content": "play me something", "name": "Ines"},
            {"role": "assistant", "content": "Noted."}]
    assert IMPORTS == ("named", "prefixed", "roles")
    assert as_imported(msgs, "named") == msgs
    pre = as_imported(msgs, "prefixed")
    assert [m["content"] for m in pre] == ["Kwame: finally bought a cello", "Ines: play me something", "Noted."]
    roles = as_imported(msgs, "roles")
    assert all("name" not in m for m in pre + roles) and [m["role"] for m in roles] == ["user", "assistant", "assistant"]
    assert [m["content"] for m in roles] == [m["content"] for m in msgs] and roles[0]["created_at"] == "2023-02-20"
    assert msgs[0]["name"] == "Kwame"  # copies
    with pytest.raises(ValueError, match="import_as must be one of named, prefixed, roles"):
        as_imported(msgs, "anonymous")


def test_a_run_on_bare_roles_says_so_and_still_finds_the_turns(engine, embedder, tmp_path):
    args = argparse.Namespace(seed=0, conversations=1, sessions=None, turns="20,60", scale=None, scale_queries=3,
                              no_scale=True, db_url=None, dtype="float32", dataset=str(_own_file(tmp_path)),
                              import_as="roles")
    out = run(args, engine, embedder, tmp_path / "store")
    assert out["import_as"] == "roles" and out["questions"] == 3
    assert out["evidence_recall_at_10"] == 1.0  # five turns: all of them are in any top 10
