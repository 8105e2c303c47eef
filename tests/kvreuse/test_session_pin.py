"""The tool-call pin on the session's own turn path: a reply that is a tool call keeps its
prompt's chunk KV in memory for `tool_pin_s`, and the continuation that brings the tool's
result reuses it although the store was flooded meanwhile."""

from __future__ import annotations

import pytest
import torch

from agentmem.config import Config
from agentmem.engine import Engine
from agentmem.engine.grammar import Grammar
from agentmem.kvreuse import ChunkKV
from agentmem.kvreuse.policy import LRUPolicy
from agentmem.kvreuse.reuse import ChunkReuse
from agentmem.kvreuse.store import ChunkStore
from agentmem.session import TOOL_CALL_OPEN, AgentSession, ends_in_tool_call
from agentmem.tiers import MemoryStore

PERSONA = ("You are Juniper, the assistant of a small outdoor shop. You help customers plan trips and track "
           "their orders. When you need live data, call a tool: order_status(order_id) or weather(city).")
CALL = '<tool_call>{"name": "order_status", "arguments": {"order_id": "A123"}}</tool_call>'


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def setup(engine, embedder, tmp_path):
    cfg = Config(dtype="float32", device="cpu", kv_mode="blend", data_dir=tmp_path, tool_pin_s=30.0)
    e = Engine(engine.model, engine.tokenizer, engine.model_id, engine.device, cfg)  # the fixture stays as is
    clock = Clock()
    # LRU, so that the flood below would push out everything a pin does not hold
    store = ChunkStore([("cpu", 24 << 20)], policy=LRUPolicy(clock=clock))
    reuse = ChunkReuse(e, cfg, store=store)
    e.chunk_reuse = reuse
    e.set_prefill_planner(reuse)
    mem = MemoryStore(cfg, embedder=embedder)
    mem.set_core_block("t1", "u1", "persona", PERSONA)
    session = AgentSession("u1", tenant_id="t1", config=cfg, engine=e, store=mem)
    yield session, reuse, clock
    mem.close()


def flood(reuse: ChunkReuse, clock: Clock, n: int, tag: str) -> None:
    """Fill the RAM tier with other users' chunks, each newer than the last."""
    args = reuse.engine.model.args
    shape = (args.n_layers, 48, args.n_kv_heads, args.head_dim)
    for i in range(n):
        clock.t += 0.1
        reuse.store.put(f"{tag}{i}", "t2", ChunkKV(torch.zeros(shape), torch.zeros(shape)), kind="recall")


def persona_seg(trace) -> dict:
    return next(s for s in trace.segments if s["ref"] == "core:persona")


def test_the_api_and_the_session_read_a_tool_call_alike():
    from agentmem.api.reply_format import CALL_OPEN

    assert TOOL_CALL_OPEN == CALL_OPEN
    assert ends_in_tool_call("  " + CALL) and not ends_in_tool_call("The order shipped.")

    class Remote:
        tool_calls = [{"id": "c1"}]

    assert ends_in_tool_call("", Remote())


def test_a_tool_call_turn_pins_its_kv_and_the_continuation_reuses_it(setup):
    session, reuse, clock = setup
    session.chat("Where is my order A123?", max_tokens=48, grammar=_literal(CALL))
    first = session.last_turn
    assert first.reply.startswith(TOOL_CALL_OPEN)
    assert first.kv_pins is not None and first.kv_pins["pinned"] >= 2 and first.kv_pins["missing"] == 0
    assert first.to_dict()["kv_pins"] == first.kv_pins
    assert reuse.store.stats()["pinned"] >= 2
    flood(reuse, clock, 40, "other")  # 40 x 1.7 MB through a 24 MB tier: all that is unpinned goes
    assert reuse.store.evictions > 0
    clock.t += 5  # the tool ran for a few seconds
    session.chat("[tool result] order A123 shipped yesterday and arrives on Friday.", max_tokens=2)
    cont = session.last_turn
    seg = persona_seg(cont)
    assert seg["kv_pin"] == "held" and seg["kv"] == "reused"
    assert cont.kv_pins is None  # an ordinary reply pins nothing


def test_without_a_tool_call_nothing_is_pinned_and_a_pin_expires(setup):
    session, reuse, clock = setup
    session.chat("Hello!", max_tokens=2)
    assert session.last_turn.kv_pins is None and reuse.store.stats()["pinned"] == 0
    flood(reuse, clock, 40, "a")
    session.chat("Hello again!", max_tokens=2)
    assert persona_seg(session.last_turn)["kv"] == "prefilled"  # LRU lost it to the flood
    session.chat("And my order A123?", max_tokens=48, grammar=_literal(CALL))
    assert session.last_turn.kv_pins["pinned"] >= 2
    clock.t += 31  # past tool_pin_s: the pin no longer holds
    assert reuse.store.stats()["pinned"] == 0
    flood(reuse, clock, 40, "b")
    session.chat("[tool result] it shipped.", max_tokens=2)
    seg = persona_seg(session.last_turn)
    assert seg["kv"] == "prefilled" and "kv_pin" not in seg


def _literal(text: str) -> Grammar:
    import json

    return Grammar(f"start: {json.dumps(text)}")
