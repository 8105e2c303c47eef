"""The specificity prior (tiers/specific.py): word statistics per user, kept in step."""

import numpy as np
import pytest

from agentmem.tiers.query import content_terms
from agentmem.tiers.specific import EXPONENT, MIN_MESSAGES, TermStats, topical

CHATTER = "Working from home today, still in pyjamas at 3pm"


def _filled(n_chatter: int = 60) -> TermStats:
    stats = TermStats()
    for i in range(n_chatter):
        stats.add(i, content_terms(CHATTER))
    stats.add(1000, content_terms("First week at the hospital pharmacy done, everyone is lovely"))
    stats.add(1001, content_terms("haha yes"))
    return stats


def test_repeated_small_talk_weighs_less_than_a_fact():
    stats = _filled()
    fact, chatter, empty = stats.weight(1000), stats.weight(0), stats.weight(1001)
    assert fact == pytest.approx(1.0)
    assert chatter < 0.01  # every word of it is in nearly every turn
    assert empty == 0.0  # no content word at all
    assert stats.weight(99999) == 1.0  # a message without statistics is not judged


def test_a_word_said_a_few_times_is_in_between():
    stats = _filled(200)
    for i in range(3):
        stats.add(2000 + i, content_terms(f"my courgettes came up, number {i}"))
    n = len(stats)
    # rarest two words of "my courgettes came up, number 0": the number (once) and courgettes (3x)
    want = ((np.log(n / 1) + np.log(n / 3)) / 2 / np.log(n)) ** EXPONENT
    assert stats.weight(2000) == pytest.approx(want, rel=1e-6)
    assert stats.weight(1000) > stats.weight(2000) > stats.weight(0)


def test_no_judgement_below_min_messages():
    stats = TermStats()
    for i in range(MIN_MESSAGES - 1):
        stats.add(i, content_terms(CHATTER))
    assert stats.weight(0) == 1.0
    stats.add(MIN_MESSAGES, content_terms(CHATTER))
    assert stats.weight(0) < 1.0


def test_remove_and_round_trip():
    stats = _filled()
    before = stats.weight(1000)
    for i in range(55):
        stats.remove(i)
    stats.remove(12345)  # unknown: nothing happens
    assert len(stats) == 7
    assert stats.weight(1000) == 1.0  # fewer than MIN_MESSAGES left
    stats.add(1000, ["ignored"])  # a message is added once
    again = TermStats.from_state({k: v for k, v in _filled().state().items()})
    assert again.weight(1000) == pytest.approx(before)
    assert again.weight(0) == pytest.approx(_filled().weight(0))
    assert again.held == _filled().held
    assert np.array_equal(again.df[: len(again.vocab)], _filled().df[: len(again.vocab)])


def test_vocabulary_grows_past_its_first_array():
    stats = TermStats()
    for i in range(400):
        stats.add(i, [f"word{i}", "common"])
    assert len(stats.vocab) == 401
    assert stats.df[stats.vocab["common"]] == 400
    assert stats.weight(7) == pytest.approx(((np.log(400) + np.log(1)) / 2 / np.log(400)) ** EXPONENT)


def test_weights_of_many_equal_weight_of_each():
    stats = _filled(120)
    for i in range(30):
        stats.add(3000 + i, content_terms(f"day {i % 7}: courgettes, chillies and {'tomatoes ' * (i % 3)}basil"))
    stats.add(4000, [])
    ids = [0, 1000, 1001, 4000, 3000, 3005, 3013, 424242]
    got = stats.weights(ids)
    assert got.keys() == set(ids)
    for i in ids:
        assert got[i] == pytest.approx(stats.weight(i), abs=1e-12), i
    assert TermStats().weights([1, 2]) == {1: 1.0, 2: 1.0}


def test_candidates_with_no_content_word_at_all_weigh_zero():
    """A search whose candidates are all "haha"-like turns (no content word) must not fail."""
    stats = _filled()
    stats.add(4001, [])
    assert stats.weights([1001, 4001]) == {1001: 0.0, 4001: 0.0}
    assert stats.weights([4001, 1000])[1000] == pytest.approx(1.0)


def test_numerals_do_not_make_repeated_small_talk_specific():
    """"still in pyjamas at 7pm" / "at 9pm": each numeral is rare, so counted as words they made
    every repeat look specific; `topical` (what the recall index counts) leaves them out, and a
    fact stated with a number keeps its words."""
    assert topical(["pyjamas", "7pm", "2019", "3", "fountain", "pens"]) == ["pyjamas", "fountain", "pens"]
    raw, kept = TermStats(), TermStats()
    for i in range(80):
        text = f"Working from home today, still in pyjamas at {i % 12 + 1}pm, {i} emails"
        raw.add(i, content_terms(text))
        kept.add(i, topical(content_terms(text)))
    fact = "I counted my fountain pens: 212"
    raw.add(500, content_terms(fact))
    kept.add(500, topical(content_terms(fact)))
    assert raw.weight(3) > 0.3  # the numerals alone made a repeat look half as specific as a fact
    assert kept.weight(3) < 0.01
    assert kept.weight(500) == pytest.approx(1.0)
