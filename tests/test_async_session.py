"""AsyncAgentSession on the shared engine: every method awaitable and equal to the sync
session's, the event loop kept free while searches and a chat run, and cancellation of the
awaiting task ending the generation with its KV blocks back in the pool."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentmem import AgentSession, AsyncAgentSession
from agentmem.config import Config
from agentmem.engine.sampler import SamplingParams
from agentmem.tiers import InvalidInput, MemoryStore, NotFound

FACTS = ["My dog is called Biscuit.", "I moved to Lisbon in March.", "My sister Ana plays the cello.",
         "I am allergic to peanuts.", "My favourite tea is genmaicha."]


@pytest.fixture
def store(tmp_path, embedder):
    s = MemoryStore(Config(data_dir=tmp_path, dtype="float32", device="cpu"), embedder=embedder)
    yield s
    s.close()


@pytest.fixture
def make(store, engine):
    def make(user: str = "alice", **kw) -> AsyncAgentSession:
        return AsyncAgentSession(user, config=store.config, engine=engine, store=store, **kw)

    return make


def run(coro):
    return asyncio.run(coro)


def test_every_method_is_awaitable_and_matches_the_sync_session(make, store, engine):
    async def main():
        s = make()
        stored = await s.add_messages([{"role": "user", "content": t} for t in FACTS])
        assert [m.text for m in stored] == FACTS
        hits = await s.search("What is my dog's name?", k=3)
        sync = AgentSession("alice", session_id=s.session_id, config=store.config, engine=engine, store=store)
        assert [h.id for h in hits] == [h.id for h in sync.search("What is my dog's name?", k=3)]
        assert hits[0].text == FACTS[0]
        ctx = await s.context("What is my dog's name?")
        assert any(FACTS[0] in seg.text for seg in ctx.segments if seg.tier == "recall")
        mem = store.add_memory("default", "alice", "The user's dog is Biscuit.")
        assert [m.id for m in await s.memories()] == [mem.id]
        new = await s.correct_memory(mem.id, "The user's dog is Biscuit, a beagle.")
        assert {m.id: m.status for m in await s.memories(None)}[mem.id] == "superseded"
        assert store.get_memory("default", "alice", mem.id).superseded_by == new.id
        await s.delete_memory(new.id)
        with pytest.raises(NotFound):
            await s.delete_memory(new.id)
        reply = await s.chat("Say one word.", max_tokens=4, seed=1)
        assert s.last_turn is not None and s.last_turn.reply == reply.strip()
        params_reply = await s.chat("Say one word.", SamplingParams(max_tokens=4, seed=1))
        assert isinstance(params_reply, str)
        with pytest.raises(InvalidInput):
            await s.chat("")
        await s.forget()
        assert await s.search("dog") == []

    run(main())


def test_chat_stream_yields_the_reply_it_stores(make, store):
    async def main():
        s = make()
        pieces = [p async for p in s.chat_stream("Tell me a word.", max_tokens=6, seed=2)]
        assert "".join(pieces).strip() == s.last_turn.reply
        roles = [m.role for m in store.session_messages("default", "alice", s.session_id)]
        assert roles[0] == "user"

    run(main())


def test_the_loop_stays_responsive_while_searches_and_a_chat_run(make):
    """A 10 ms heartbeat on the loop: its largest lag while 20 searches and a 32-token chat
    run at once is the longest the loop was blocked."""

    async def main():
        s = make()
        await s.add_messages([{"role": "user", "content": f"{t} (note {i})"} for i in range(60) for t in FACTS])
        await s.search("warm-up")  # the index is built before the clock starts
        lags: list[float] = []
        stop = asyncio.Event()

        async def heartbeat():
            while not stop.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                lags.append(time.perf_counter() - t - 0.01)

        beat = asyncio.create_task(heartbeat())
        queries = ["Where did I move?", "Who plays the cello?", "What am I allergic to?", "Which tea?"] * 5
        results = await asyncio.gather(s.chat("Tell me about my sister.", max_tokens=32, ignore_eos=True),
                                       *(s.search(q, k=5) for q in queries))
        stop.set()
        await beat
        assert all(results[1:]) and len(lags) > 10
        return max(lags)

    worst = run(main())
    assert worst < 0.1, f"the loop was blocked for {worst * 1000:.0f} ms"


def test_cancelling_the_task_cancels_the_generation_and_frees_its_kv(make, engine, store):
    async def main():
        s = make()
        await s.chat("Hello.", max_tokens=2)  # the loop and its pool exist before the baseline
        free = engine.loop.blocks.num_free
        got: list[str] = []

        async def consume():
            async for piece in s.chat_stream("Write a very long story about the sea.", max_tokens=400,
                                             ignore_eos=True):
                got.append(piece)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0.01)
        started = time.perf_counter()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.perf_counter() - started < 5
        assert not engine.loop.scheduler.has_work()
        assert engine.loop.blocks.num_free == free
        turn = store.turns("default", "alice", s.session_id, limit=1)[0]
        assert turn.trace["stats"]["finish_reason"] == "cancelled"
        assert turn.trace["stats"]["completion_tokens"] < 400

    run(main())


def test_a_user_is_needed(engine):
    with pytest.raises(TypeError, match="user_id"):
        AsyncAgentSession(engine=engine)
