"""The remote engine against a real OpenAI-compatible server: llama-cpp-python's, on the
default GGUF, started here on a free loopback port (`make test` installs it; skipped, saying
so, where llama_cpp is not importable)."""

from __future__ import annotations

import importlib.util
import time

import httpx
import pytest

from agentmem.api import create_app, create_tenant_with_key
from agentmem.api.local import LocalServer, free_port
from agentmem.config import Config
from agentmem.engine import EngineUnavailable, TextEngine, load_engine
from agentmem.engine.llama_server import LlamaServer
from agentmem.engine.remote import RemoteEngine
from agentmem.session import AgentSession
from agentmem.tiers import MemoryStore

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed: `make test` builds and installs it (the remote engine's peer)")

WINDOW = 4096  # the shared server's (`llama_server`, conftest.py)


def _config(tmp_path, url: str, **kw) -> Config:
    return Config(data_dir=tmp_path, engine_url=url, context_window=WINDOW, engine_retries=2, **kw)


@pytest.fixture
def remote(llama_server, tmp_path) -> RemoteEngine:
    e = load_engine(_config(tmp_path, llama_server.url))
    yield e
    e.close()


def test_remote_engine_is_a_text_engine_counting_as_the_server_does(remote, engine):
    assert isinstance(remote, TextEngine) and isinstance(engine, TextEngine)
    assert remote.model_id == "smollm2"
    text = remote.format_message("user", "Name a colour.") + remote.chat.generation_prefix
    assert remote.chat == engine.chat and remote.encode(text) == engine.encode(text)
    plain = httpx.post(remote.url + "/v1/completions", json={"prompt": text, "max_tokens": 1}, timeout=60).json()
    assert plain["usage"]["prompt_tokens"] == remote.count_tokens(text)  # the server counts the same tokens
    g = remote.generate(text, max_tokens=4)
    # llama-cpp-python reports no usage in a stream: the stats say so rather than guess
    assert g.stats.server["prompt_tokens"] in (None, remote.count_tokens(text))
    assert g.stats.prompt_tokens == remote.count_tokens(text) and g.text


def test_stream_stop_and_max_tokens(remote):
    prompt = remote.chat_segments([{"role": "user", "content": "Count from one to twenty in words."}])
    s = remote.stream(prompt, max_tokens=12)
    pieces = list(s)
    assert len(pieces) > 1 and "".join(pieces) == s.result.text
    assert s.result.stats.finish_reason == "length" and s.result.stats.completion_tokens == 12
    assert s.result.stats.ttft_s > 0 and s.result.stats.total_s >= s.result.stats.ttft_s
    prompt = remote.chat_segments([{"role": "user", "content": "Write three sentences about the sea."}])
    remote.generate(prompt, max_tokens=40)  # the server's prompt cache settles (its first pass may differ)
    full = remote.generate(prompt, max_tokens=40).text
    assert len(full) > 20
    cut = full[len(full) // 2: len(full) // 2 + 3]
    stopped = remote.generate(prompt, max_tokens=40, stop=[cut])
    assert stopped.stats.finish_reason == "stop" and cut not in stopped.text
    assert full.startswith(stopped.text) and len(stopped.text) < len(full)


def test_session_turns_through_the_remote_engine(remote, tmp_path, embedder):
    store = MemoryStore(remote_cfg := _config(tmp_path, remote.url), embedder=embedder)
    s = AgentSession("alice", config=remote_cfg, engine=remote, store=store)
    s.chat("My cat is called Miso.", max_tokens=8)
    reply = "".join(s.chat("What is my cat called?", stream=True, max_tokens=8))
    trace = store.turns("default", "alice")[-1].trace  # the second turn's
    assert trace["reply"] == reply.strip() and trace["stats"]["server"]["url"] == remote.url
    assert trace["stats"]["prompt_tokens"] == sum(seg["tokens"] for seg in trace["segments"])
    assert trace["stats"]["server"]["ttft_s"] == trace["stats"]["ttft_s"] > 0
    assert {seg["kv"] for seg in trace["segments"]} == {"prefilled"}  # no chunk-KV blending remotely
    assert [m.role for m in store.session_messages("default", "alice", s.session_id)][:3] == ["user", "assistant",
                                                                                             "user"]
    store.close()


def test_server_killed_mid_stream_fails_the_turn_cleanly(tmp_path, embedder):
    dying = LlamaServer(tmp_path / "llama.log", n_ctx=WINDOW)
    cfg = _config(tmp_path, dying.url)
    store = MemoryStore(cfg, embedder=embedder)
    remote = load_engine(cfg)
    s = AgentSession("bob", config=cfg, engine=remote, store=store)
    out = s.chat("Write a long story about a lighthouse keeper.", stream=True, max_tokens=400)
    first = next(out)
    dying.kill()
    with pytest.raises(EngineUnavailable, match="broke off|ended the stream"):
        for _ in out:
            pass
    assert first
    msgs = store.session_messages("default", "bob", s.session_id)
    assert [m.role for m in msgs] == ["user"]  # the user's message is kept, no half reply stored
    assert store.turns("default", "bob") == []
    t0 = time.perf_counter()
    with pytest.raises(EngineUnavailable, match="unreachable after 3 tries"):
        s.chat("Are you there?", max_tokens=4)
    assert time.perf_counter() - t0 < 30  # retried with backoff, then a clear error (not the 120 s read timeout)
    assert [m.text for m in store.session_messages("default", "bob", s.session_id)][-1] == "Are you there?"
    store.close()
    remote.close()


def test_wrong_url_is_a_503_and_the_message_is_kept(tmp_path, embedder):
    cfg = _config(tmp_path, f"http://127.0.0.1:{free_port()}", engine_model="smollm2")
    store = MemoryStore(cfg, embedder=embedder)
    tenant, key = create_tenant_with_key(store, "acme")
    with LocalServer(create_app(cfg, store=store, ui=False)) as api:
        r = httpx.post(api.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={"model": "smollm2", "user": "carol", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "Remember: my locker is 42."}]})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_unavailable" and "127.0.0.1" in err["message"]
        texts = [m.text for m in store.archive.messages(tenant, "carol")]
        assert texts == ["Remember: my locker is 42."]
    store.close()
