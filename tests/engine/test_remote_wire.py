"""What the remote engine sends and asks, against a stand-in server (httpx.MockTransport):
the model's sampling defaults and every setting spelled out in the server's dialect, and
token counts from the server's tokenize endpoint. The real server is in test_remote_engine.py."""

from __future__ import annotations

import json

import httpx
import pytest

from agentmem.engine.remote import RemoteEngine
from agentmem.engine.sampler import with_defaults


class StandIn:
    """An OpenAI-compatible server in a function: llama-cpp-python's endpoints (`llama`),
    vLLM's (`openai`), or one without a tokenize endpoint; `up` False refuses connections."""

    def __init__(self, kind: str):
        self.kind, self.up = kind, True
        self.completions: list[dict] = []
        self.tokenized: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("refused", request=request)
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served"}]})
        if path == "/extras/tokenize/count" and self.kind == "llama":
            text = json.loads(request.content)["input"]
            self.tokenized.append(text)
            return httpx.Response(200, json={"count": len(text.split()) + 100})
        if path == "/tokenize" and self.kind == "openai":
            text = json.loads(request.content)["prompt"]
            self.tokenized.append(text)
            return httpx.Response(200, json={"count": len(text.split()) + 200, "tokens": []})
        if path == "/v1/completions":
            self.completions.append(json.loads(request.content))
            events = [{"choices": [{"text": "Hi", "finish_reason": None}]},
                      {"choices": [{"text": "", "finish_reason": "stop"}]}]
            body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})
        return httpx.Response(404, json={"detail": "Not Found"})


def _remote(engine, server: StandIn, tokenize: str = "auto") -> RemoteEngine:
    r = RemoteEngine("http://stand-in", engine.tokenizer, defaults=engine.sampling_defaults, tokenize=tokenize,
                     retries=0)
    r.http = httpx.Client(base_url=r.url, transport=httpx.MockTransport(server))
    return r


@pytest.mark.parametrize("kind, penalty, top_k_off", [("llama", "repeat_penalty", 0),
                                                      ("openai", "repetition_penalty", -1)])
def test_sampling_is_the_models_defaults_spelled_out(engine, kind, penalty, top_k_off):
    server = StandIn(kind)
    remote = _remote(engine, server)
    assert remote.sampling_defaults == engine.sampling_defaults  # the same model card and fallbacks
    params = with_defaults(remote.sampling_defaults, max_tokens=5, seed=7)
    assert remote.generate("Hello", params).text == "Hi"
    sent = server.completions[-1]
    d = engine.sampling_defaults
    assert sent["temperature"] == d["temperature"] and sent["top_p"] == d["top_p"] and sent["seed"] == 7
    assert sent[penalty] == d.get("repetition_penalty", 1.0)  # none by default: sent as 1.0, off
    assert sent["frequency_penalty"] == d["frequency_penalty"] and sent["presence_penalty"] == d["presence_penalty"]
    # off is sent as off: a server's own defaults (llama-cpp-python: top-k 40, min-p 0.05) never apply
    assert sent["top_k"] == top_k_off and sent["min_p"] == 0.0
    remote.generate("Hello", max_tokens=3)  # greedy, no penalty: still spelled out
    assert server.completions[-1][penalty] == 1.0 and server.completions[-1]["temperature"] == 0.0


@pytest.mark.parametrize("kind, extra", [("llama", 100), ("openai", 200)])
def test_counts_come_from_the_servers_tokenize_endpoint(engine, kind, extra):
    server = StandIn(kind)
    remote = _remote(engine, server)
    assert remote.counts_on_server
    assert remote.count_tokens("three small words") == 3 + extra
    assert remote.count_tokens_many(["three small words", "two words"]) == [3 + extra, 2 + extra]
    assert server.tokenized.count("three small words") == 1  # counted once, then remembered
    server.up = False  # away: counted with the local files, no error
    assert remote.count_tokens("four words here now") == engine.count_tokens("four words here now")


def test_local_counts_when_asked_or_when_the_server_has_no_endpoint(engine):
    server = StandIn("llama")
    local = _remote(engine, server, tokenize="local")
    assert not local.counts_on_server and local.count_tokens("a b c") == engine.count_tokens("a b c")
    assert server.tokenized == []
    bare = _remote(engine, StandIn("none"))
    assert not bare.counts_on_server and bare.count_tokens("a b c") == engine.count_tokens("a b c")
    with pytest.raises(Exception, match="no tokenize endpoint"):
        _remote(engine, StandIn("none"), tokenize="server").count_tokens("a b c")
    with pytest.raises(ValueError, match="auto, server or local"):
        RemoteEngine("http://stand-in", engine.tokenizer, tokenize="sometimes")
