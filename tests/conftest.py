"""Shared fixtures. The model is loaded once per test session (fp32, so that comparisons
against the HF oracle are exact to 1e-3, and kv_mode "full", so no chunk-KV planner is
installed); every test that needs a model uses `engine`."""

from __future__ import annotations

import os
import uuid

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# no background compiles of the decode step behind every test's engine (each model shape and
# bucket compiles for seconds); test_engine_fast.py turns it on where it is tested
os.environ.setdefault("AGENTMEM_COMPILE", "off")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# what makes a test slow: the model (loaded once per session, then every turn runs it) or a
# benchmark run; `make test-fast` leaves these out, `make test` runs everything. Soaks, timed
# load tests and tests that load a model in a subprocess carry the mark by hand.
MODEL_FIXTURES = frozenset({"engine", "hf_model"})


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) or "bench" in item.path.name:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _timings_are_saved_under_load(monkeypatch):
    """The engine does not save a choice it timed on a busy machine (measured.machine_busy); the
    tests time under their own load, and those that read the saved choices back need them saved.
    test_engine_fast.py tests the guard itself."""
    from agentmem.engine import measured

    monkeypatch.setattr(measured, "machine_busy", lambda: None)


@pytest.fixture(scope="session")
def engine():
    from agentmem.config import Config
    from agentmem.engine import Engine

    return Engine.load(Config(dtype="float32", device="cpu", kv_mode="full"))  # plain prefill: parity tests


@pytest.fixture(scope="session")
def hf_model(engine):
    """The transformers oracle, on the same checkpoint directory."""
    from transformers import LlamaForCausalLM

    from agentmem.engine import resolve_model_dir

    path = resolve_model_dir(engine.config.model_path, engine.config.cache_dir)
    return LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def embedder():
    from agentmem.tiers.embed import load_embedder

    return load_embedder()


PG_URL = os.environ.get("AGENTMEM_TEST_PG_URL")


@pytest.fixture
def pg_url():
    """A fresh, empty PostgreSQL schema of this test's own on AGENTMEM_TEST_PG_URL (other tests
    may share the database), dropped afterwards; the test is skipped, saying so, when unset."""
    if not PG_URL:
        pytest.skip("AGENTMEM_TEST_PG_URL is unset: set it to a PostgreSQL URL "
                    "(e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test) to run")
    import sqlalchemy as sa

    schema = f"agentmem_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_URL)
    with admin.begin() as c:
        c.execute(sa.text(f"create schema {schema}"))
    yield sa.engine.make_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(False)
    with admin.begin() as c:
        c.execute(sa.text(f"drop schema {schema} cascade"))
    admin.dispose()
