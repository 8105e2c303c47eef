"""`agentmem demo` on the shared engine: both phases in this process, two stores on one data
dir (the demo runs them in two processes; the REPL test covers a real second process)."""

from __future__ import annotations

from agentmem.config import Config
from agentmem.demo import FACTS, phase_one, phase_two
from agentmem.tiers import MemoryStore


def test_demo_recalls_facts_of_an_earlier_session(tmp_path, engine, embedder, capsys):
    first = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    phase_one(str(tmp_path), 3, engine=engine, store=first, pairs=10)
    first.close()
    second = MemoryStore(Config(data_dir=tmp_path), embedder=embedder)
    phase_two(str(tmp_path), 3, engine=engine, store=second)
    second.close()
    out = capsys.readouterr().out
    assert "=== session 2" in out and "20 messages of unrelated talk imported" in out
    assert "fact: The user's dog is Biscuit.  (from message" in out  # reflection ran between the phases
    memory_lines = [ln for ln in out.splitlines() if ln.strip().startswith("* message:")]
    for fact in FACTS:  # each fact of session 1 went into a prompt of session 3
        assert any(fact in ln for ln in memory_lines), out
