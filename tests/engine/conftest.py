"""The engine tests' shared fixtures: llama-cpp-python's OpenAI-compatible server on the
default GGUF (the remote engine's peer), started once for the whole test session on a free
loopback port and killed at its end; test_remote_engine.py (completions) and
test_remote_chat.py (chat) both talk to it. A test that kills its server starts its own."""

from __future__ import annotations

import pytest

LLAMA_CTX = 4096  # the server's window: every remote test's configured window is at most this


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory):
    from agentmem.engine.llama_server import LlamaServer

    s = LlamaServer(tmp_path_factory.mktemp("llama") / "llama.log", n_ctx=LLAMA_CTX)
    yield s
    s.kill()
