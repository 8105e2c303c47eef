"""`AsyncAgentSession`: `AgentSession`'s methods as awaitables, for asyncio backends.

There is one implementation of the turn, `AgentSession`; this class only moves its calls
off the event loop. Every method runs the session's own method in a worker thread (the
work is SQL, FAISS, embeddings and the engine, which release the GIL while they compute),
so the loop stays free to serve other requests. The calls share a pool of one thread per
core: more threads would only contend for the GIL with the loop itself (its wake-ups wait
for whichever thread holds it). A reply stream is produced by a thread of its own, which
mostly waits for the engine, and handed to the loop piece by piece; cancelling the task that iterates it sets
the stream's cancel event (`engine.cancel`), the engine ends the request and frees its KV
blocks, and the cancellation returns once that is done.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, TypeVar

from .assemble import Context
from .engine.cancel import cancel_on
from .engine.sampler import SamplingParams
from .session import AgentSession, TurnTrace
from .tiers.records import Hit, Memory, Message

T = TypeVar("T")
_END = object()
_POOL_LOCK = threading.Lock()
_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(max(2, os.cpu_count() or 2), thread_name_prefix="agentmem-async"))
        return _POOL[0]


class AsyncAgentSession:
    """One user's conversation with memory, awaitable. Build it like an `AgentSession`
    (`AsyncAgentSession("alice")`; loading the model blocks, so do it at start-up or with
    `await AsyncAgentSession.open(...)`), or wrap one: `AsyncAgentSession(session=s)`."""

    def __init__(self, user_id: str | None = None, tenant_id: str = "default", session_id: str | None = None,
                 config=None, engine=None, store=None, *, session: AgentSession | None = None):
        if session is None:
            if user_id is None:
                raise TypeError("AsyncAgentSession needs a user_id (or session=an AgentSession)")
            session = AgentSession(user_id, tenant_id, session_id, config, engine, store)
        self.session = session

    @classmethod
    async def open(cls, user_id: str, tenant_id: str = "default", session_id: str | None = None, config=None,
                   engine=None, store=None) -> AsyncAgentSession:
        """Build the session in a worker thread: the model and the archive load off the loop."""
        session = await asyncio.get_running_loop().run_in_executor(
            _pool(), functools.partial(AgentSession, user_id, tenant_id, session_id, config, engine, store))
        return cls(session=session)

    # the session's identity and last trace, read as they are
    @property
    def user_id(self) -> str:
        return self.session.user_id

    @property
    def tenant_id(self) -> str:
        return self.session.tenant_id

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def last_turn(self) -> TurnTrace | None:
        return self.session.last_turn

    async def _run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return await asyncio.get_running_loop().run_in_executor(_pool(), functools.partial(fn, *args, **kwargs))

    # --- the turn ----------------------------------------------------------------------------
    async def chat(self, text: str | bytes, params: SamplingParams | None = None, **kwargs) -> str:
        """`AgentSession.chat`: the reply's text, stored with its trace. Cancelling the
        awaiting task cancels the generation (the user's message stays stored)."""
        return "".join([piece async for piece in self.chat_stream(text, params, **kwargs)])

    async def chat_stream(self, text: str | bytes, params: SamplingParams | None = None,
                          **kwargs) -> AsyncIterator[str]:
        """`AgentSession.chat_stream`, iterated with `async for`. The user's message is
        committed before the first piece arrives; bad input raises before anything is stored."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        done = loop.create_future()

        def post(item: Any) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, item)

        def produce() -> None:
            try:
                with cancel_on(cancel):
                    for piece in self.session.chat_stream(text, params, **kwargs):
                        if not cancel.is_set():
                            post(piece)
                post(_END)
            except BaseException as exc:  # handed to the awaiting task, which raises it
                post(exc)
            finally:
                loop.call_soon_threadsafe(done.set_result, None)

        threading.Thread(target=produce, name="agentmem-stream", daemon=True).start()
        try:
            while True:
                item = await pieces.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()
            # the worker ends the request within one poll of the event; wait for it, so that
            # the request's KV is back in the pool when the cancellation returns
            await asyncio.shield(done)

    # --- the rest of the API -----------------------------------------------------------------
    async def add_messages(self, messages: list[dict]) -> list[Message]:
        return await self._run(self.session.add_messages, messages)

    async def search(self, query: str, k: int = 10, since: datetime | None = None, until: datetime | None = None, *,
                     retrievers: Collection[str] | None = None) -> list[Hit]:
        return await self._run(self.session.search, query, k, since, until, retrievers=retrievers)

    async def context(self, query: str) -> Context:
        return await self._run(self.session.context, query)

    async def memories(self, status: str | None = None) -> list[Memory]:
        return await self._run(self.session.memories, status)

    async def correct_memory(self, memory_id: int, text: str) -> Memory:
        return await self._run(self.session.correct_memory, memory_id, text)

    async def delete_memory(self, memory_id: int) -> None:
        await self._run(self.session.delete_memory, memory_id)

    async def forget(self) -> None:
        await self._run(self.session.forget)

    async def sync(self) -> None:
        await self._run(self.session.sync)
