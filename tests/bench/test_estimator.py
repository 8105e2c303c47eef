"""The chat-mode token estimator (engine/remote_budget.py) on the bench conversations,
against the default model's own tokenizer and chat template (bench/estimator.py): the bound
with its margin never under-counts, before calibration (the prior) or after it."""

from __future__ import annotations

import pytest

from agentmem.bench.estimator import counts, measure, workload_prompts
from agentmem.bench.memory import build_workload
from agentmem.engine.remote_budget import MARGIN, PRIOR_FACTOR
from agentmem.engine.tokenizer import chat_format


@pytest.fixture(scope="module")
def tokenizer():
    from agentmem.config import Config
    from agentmem.engine.tokenizer import load_tokenizer
    from agentmem.engine.weights import resolve_model_dir

    c = Config()
    return load_tokenizer(resolve_model_dir(c.model_path, c.cache_dir))


@pytest.fixture(scope="module")
def pairs(tokenizer):
    workload = build_workload(0, users=3, facts=5, turns=300, sessions=4, change_frac=0.4)  # bench memory's default
    prompts = workload_prompts(workload, chat_format(tokenizer))
    assert len(prompts) == 15 and all(any(s.tier == "recall" for s in p) for p in prompts)
    return counts(tokenizer, prompts)


def test_the_bound_never_undercounts_the_bench_prompts(pairs):
    m = measure(pairs)
    assert m["estimator_undercounts_before"] == 0 and m["estimator_undercounts_after"] == 0
    assert m["estimator_bound_headroom_min_after"] >= MARGIN - 0.01  # the margin is what is left once calibrated
    # the prior over-counts by about its own excess before the server reported anything
    assert abs(m["estimator_rel_error_signed_mean_before"] - (PRIOR_FACTOR - 1)) < 0.05
    assert m["estimator_rel_error_max_after"] <= 0.02  # the default model's files: calibrated, about exact
    assert 100 < m["estimator_real_tokens_mean"] < 2048


def test_an_undercount_is_counted(pairs):
    """The check can fail: a server counting a fifth more than the calibration prompts showed
    (another model's tokenizer on unlike text) is reported as under-counted."""
    skewed = pairs[:3] + [(c, round(r * 1.2)) for c, r in pairs[3:]]
    m = measure(skewed)
    assert m["estimator_undercounts_after"] == len(pairs) - 3 and m["estimator_bound_headroom_min_after"] < 0
    assert m["estimator_undercounts_before"] == 0  # the prior's 1.25 x 1.05 still covers 1.2
