"""`RemoteEngine`: an OpenAI-compatible inference server (vLLM, SGLang, llama.cpp's server,
TGI) in place of the embedded engine.

Each prompt goes to `/v1/completions` as the rendered text of its segments, in assembly
order, streamed; or, in chat mode (`engine_api`: chat, or auto where the server has no
completions route or the model's tokenizer is unknown), to `/v1/chat/completions` as chat
messages (remote_chat.py), with budgets bounded from the usage the server reports
(remote_budget.py). The assembly puts the stable part first (persona, core blocks, summary,
recent turns), so the server's own prefix cache reuses it from turn to turn; the embedded
engine's chunk-KV blending does not apply here. Tokens are counted with the model's own
tokenizer files when a path is given (`engine_tokenizer`), else by the server's own tokenize
endpoint where it has one (llama-cpp-python: `/extras/tokenize/count`; vLLM and llama.cpp's
server: `/tokenize`), else with the default model's files; either way budgets match what the
server sees. `engine_tokenize` (auto | server | local) overrides the choice.

Sampling is the embedded engine's: the same model defaults (`sampling_defaults`: the model
card, generation_config.json, AGENTMEM_SAMPLE_*) and every setting sent explicitly, off
included, so the server's own defaults (llama-cpp-python: top-k 40, min-p 0.05, repeat
penalty 1.1) never apply unasked. The names follow the server's dialect: llama.cpp's
(`repeat_penalty`, top-k 0 for off) or vLLM/SGLang's (`repetition_penalty`, top-k -1).

What the server reports (prompt tokens, cached tokens where it says: `usage.
prompt_tokens_details.cached_tokens` for vLLM/SGLang, `timings.cache_n` for llama.cpp's
server; llama-cpp-python's server reports neither, nor usage in a stream) lands in the
turn's stats, None where the server did not say; time to first token is measured here.

Failures: connecting and the server's 429/5xx answers before any text are retried with
exponential backoff (nothing was generated yet, so the request is still idempotent); a
stream cut after text has flowed is not retried. Either way `EngineUnavailable` says which
server and why; the session has already stored the user's message. Another 4xx, a refusal
(`refusal` in the reply) or a content filter is `EngineRefused` (a subclass), naming the
refused parameter where the server's answer does.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..config import Config
from .cancel import current_cancel_event
from .defaults import sampling_defaults
from .engine import ChatText, Segment
from .errors import EmptyPrompt, EngineRefused, EngineUnavailable, PromptTooLong
from .remote_budget import TokenBudget, server_window
from .remote_chat import ToolCalls, cached_tokens, refusal_error, sampling_body, to_messages
from .results import Generation, GenerationStats
from .sampler import SamplingParams
from .tokenizer import ChatFormat, chat_format, load_tokenizer

RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
DEFAULT_CONTEXT = 8192
PROBE_AGAIN_S = 30.0  # a server that did not answer the probe is asked again after this
COUNT_CACHE = 4096  # token counts the server gave, kept by text (memories are counted turn after turn)
# the server's tokenize endpoints and the text's key in their bodies: llama-cpp-python's, then
# vLLM's ("prompt") and llama.cpp's server's ("content"); the first that answers is used
TOKENIZE = (("/extras/tokenize/count", ("input",)), ("/tokenize", ("prompt", "content")))
APIS = ("auto", "chat", "completions")
# texts whose token counts tell whether the server's model has the local tokenizer: plain
# words, digits, accents and the chat wraps (special tokens) of the local template
PROBE_TEXTS = ("The quick brown fox, 1234567 - über naïve café.", "  def f(x):\n\treturn x ** 2  # ok")
CALIBRATION_PROBES = 3  # one-token requests that calibrate the budget where streams report no usage


@dataclass
class RemoteStats(GenerationStats):
    """The embedded engine's stats, filled from the server's report: `reused_tokens` is the
    server's cached prefix where it reports one. `server` keeps the raw figures (None where
    the server did not say)."""

    server: dict = field(default_factory=dict)
    tool_calls: list[dict] | None = None  # chat mode: the provider's own tool calls, OpenAI's shape


class RemoteEngine(ChatText):
    def __init__(self, url: str, tokenizer, *, model: str | None = None, api_key: str | None = None,
                 context_window: int = DEFAULT_CONTEXT, timeout_s: float = 120.0, connect_timeout_s: float = 5.0,
                 retries: int = 3, backoff_s: float = 0.25, defaults: dict | None = None,
                 tokenize: str = "local", api: str = "completions", exact_tokenizer: bool = True,
                 ask_window: bool = False, chat_defaults: dict | None = None):
        """`context_window` is the server's window (`ask_window`: unless its metadata states
        one). `exact_tokenizer` says `tokenizer` is the served model's own; where it is not
        known to be, the server's tokenize endpoint may still show it is, else chat mode's
        budget bound starts at the estimator's prior and sampling defaults to `chat_defaults`
        (the settings given, not another model's card)."""
        self.url = url.rstrip("/").removesuffix("/v1")
        self.tokenizer = tokenizer
        self.chat: ChatFormat = chat_format(tokenizer)
        if api not in APIS:
            raise ValueError(f"engine_api must be auto, chat or completions, got {api!r}")
        self._api = None if api == "auto" else api
        self._resolved = api == "completions"  # chat and auto still ask whether the tokenizer is the model's
        self._window = context_window
        self._ask_window = ask_window
        self._exact = exact_tokenizer
        self._chat_defaults = dict(chat_defaults or {})
        self.budget = TokenBudget(exact_tokenizer)
        self._stream_usage: bool | None = None  # whether the server reports usage in a chat stream
        self._dropped_fields: set[str] = set()  # fields a server refused that a request can go without
        self.retries, self.backoff_s = retries, backoff_s
        self.sampling_defaults: dict = dict(defaults or {})
        if tokenize not in ("auto", "server", "local"):
            raise ValueError(f"engine_tokenize must be auto, server or local, got {tokenize!r}")
        self.tokenize = tokenize
        self._endpoint: tuple[str, tuple[str, ...]] | None | bool = False  # False: not probed yet
        self._probe_at = 0.0  # monotonic time of the next probe while the server is away
        self._dialect: str | None = None  # the server's names for sampling settings, once asked
        self._counts: OrderedDict[str, int] = OrderedDict()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers,
                                 timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))
        self._model = model
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Config) -> RemoteEngine:
        """Tokenizer files: `engine_tokenizer` (a directory with tokenizer.json), else the
        default model's checkpoint directory (dequantized once into the cache if missing)."""
        path = config.engine_tokenizer
        tokenize = config.engine_tokenize
        given = path is not None
        if path is None:
            from .weights import DEFAULT_MODEL_ID, resolve_model_dir

            path, card = resolve_model_dir(config.model_path, config.cache_dir), DEFAULT_MODEL_ID
        else:
            card = Path(path).name
            tokenize = "local" if tokenize == "auto" else tokenize  # the files given are the model's
        window = config.engine_context or config.context_window or _window_from(Path(path))
        engine = cls(config.engine_url, load_tokenizer(Path(path)), model=config.engine_model,
                     api_key=config.engine_api_key, context_window=window, timeout_s=config.engine_timeout_s,
                     retries=config.engine_retries, defaults=sampling_defaults(Path(path), card, config),
                     tokenize=tokenize, api=config.engine_api, exact_tokenizer=given,
                     ask_window=config.engine_context is None, chat_defaults=_configured_sampling(config))
        return engine

    # --- which route, which window ---------------------------------------------------------
    @property
    def api(self) -> str:
        """"chat" or "completions". auto: completions where the server has that route and the
        model's tokenizer is known (its files were given, or the server's tokenize endpoint
        counts as the local files do on PROBE_TEXTS and the chat wraps), else chat. Asked once;
        a server that is down is asked again on the next call."""
        if not self._resolved:
            has_route = False
            if self._api is None:
                has_route = self._has_route("/v1/completions")
            known = self._exact or self._server_counts_as_local()
            if known and not self._exact:
                self._exact, self.budget = True, TokenBudget(True)
            self._api = self._api or ("completions" if has_route and known else "chat")
            self._resolved = True
            if self._api == "chat":
                self.tokenize = "local"  # the messages' counts are bounded by the budget
                if not known:  # another model's card does not fit: only the AGENTMEM_SAMPLE_* settings
                    self.sampling_defaults = dict(self._chat_defaults)
        return self._api

    def _has_route(self, path: str) -> bool:
        """Whether the server routes `path`: an empty request is answered 404 or 405 where it
        does not, and a validation error (llama-cpp-python's is a 500) where it does."""
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self.http.post(path, json={}).status_code not in (404, 405)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                last = f"{type(exc).__name__}: {exc}"
        raise EngineUnavailable(f"the inference server at {self.url} is unreachable after {self.retries + 1} "
                                f"tries (POST {path}): {last}")

    def _server_counts_as_local(self) -> bool:
        if self._tokenize_endpoint() is None:
            return False
        w = self.chat.wraps
        texts = (*PROBE_TEXTS, w["system"][0] + "s" + w["system"][1] + w["user"][0] + "u" + w["user"][1])
        return all(self.count_tokens(t) == super(RemoteEngine, self).count_tokens(t) for t in texts)

    @property
    def server_context(self) -> int:
        """The server's context window, in its tokens."""
        if self._ask_window and time.monotonic() >= self._probe_at:
            try:
                found = server_window(self.http, self._model)
            except httpx.TransportError:  # away: the configured window meanwhile, asked again later
                self._probe_at = time.monotonic() + PROBE_AGAIN_S
                return self._window
            self._ask_window = False
            self._window = found or self._window
        return self._window

    @property
    def context_window(self) -> int:
        """The window in this engine's counted tokens: the server's, in chat mode bounded by
        the budget's factor (remote_budget.py)."""
        try:
            api = self.api
        except EngineUnavailable:
            api = "chat"  # the server is away: the smaller, bounded window until it answers
        if api == "chat":
            return self.budget.window(self.server_context)
        return self.server_context

    @property
    def dialect(self) -> str:
        """"llama" (llama.cpp's servers) or "openai": the names of sampling settings and
        structured output the server takes; asked once it answers."""
        if self._dialect is None:
            self._dialect = _dialect(self.http)
        return self._dialect or "openai"

    @property
    def native_tools(self) -> bool:
        """Tools, tool_choice and response_format go to the server as they are (chat mode).
        Asked before the turn stores the user's message: a server that is down answers False
        here, so the message is kept and the turn's own request gives the EngineUnavailable."""
        try:
            return self.api == "chat"
        except EngineUnavailable:
            return False

    # --- identity --------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        """The server's model name: `engine_model`, else the first one it lists."""
        with self._lock:
            if self._model is None:
                r = self._request("GET", "/v1/models")
                models = r.json().get("data") or []
                if not models:
                    raise EngineUnavailable(f"the inference server at {self.url} lists no model")
                self._model = models[0]["id"]
            return self._model

    def close(self) -> None:
        self.http.close()

    # --- the server's tokenizer ------------------------------------------------------------
    def _tokenize_endpoint(self) -> tuple[str, tuple[str, ...]] | None:
        """The server's tokenize endpoint (path, body keys); None if it has none. Probed once;
        while the server is unreachable, counts are local and it is probed again after
        PROBE_AGAIN_S. With `tokenize="local"` the server is not asked."""
        if self._endpoint is False and self.tokenize != "local" and time.monotonic() >= self._probe_at:
            found, down = None, ""
            for path, keys in TOKENIZE:
                try:
                    r = self.http.post(path, json=_tokenize_body(keys, "a"))
                    body = r.json() if r.status_code == 200 else {}
                except httpx.HTTPError as exc:
                    down = f"{type(exc).__name__}: {exc}"
                    break
                except ValueError:
                    continue
                if isinstance(body, dict) and ("count" in body or "tokens" in body):
                    found = (path, keys)
                    break
            if down:
                self._probe_at = time.monotonic() + PROBE_AGAIN_S
                if self.tokenize == "server":
                    raise EngineUnavailable(f"the inference server at {self.url} is unreachable ({down})")
                return None
            if found is None and self.tokenize == "server":
                raise EngineUnavailable(f"the inference server at {self.url} has no tokenize endpoint "
                                        "(AGENTMEM_ENGINE_TOKENIZE=server)")
            self._endpoint = found
        return self._endpoint or None

    @property
    def counts_on_server(self) -> bool:
        return self._tokenize_endpoint() is not None

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` as the server counts them (its tokenize endpoint), else locally."""
        ep = self._tokenize_endpoint()
        if ep is None or not text:
            return super().count_tokens(text)
        with self._lock:
            if text in self._counts:
                self._counts.move_to_end(text)
                return self._counts[text]
        path, keys = ep
        try:
            r = self.http.post(path, json=_tokenize_body(keys, text))
            r.raise_for_status()
            out = r.json()
            n = int(out["count"]) if "count" in out else len(out["tokens"])
        except (httpx.HTTPError, ValueError, KeyError):
            # the server is away (the turn will say so when it asks for the reply): count
            # with the local files meanwhile, and look for the endpoint again later
            self._endpoint, self._probe_at = False, time.monotonic() + PROBE_AGAIN_S
            return super().count_tokens(text)
        with self._lock:
            self._counts[text] = n
            while len(self._counts) > COUNT_CACHE:
                self._counts.popitem(last=False)
        return n

    def count_tokens_many(self, texts: Seq[str]) -> list[int]:
        if self._tokenize_endpoint() is None:
            return super().count_tokens_many(texts)
        return [self.count_tokens(t) for t in texts]

    def render(self, prompt: str | Seq[Segment]) -> str:
        """The prompt text the server gets: the segments' texts in order."""
        if isinstance(prompt, str):
            return prompt
        if len(prompt) and not isinstance(prompt[0], Segment):
            return self.tokenizer.decode([int(t) for t in prompt])
        return "".join(s.text for s in prompt)

    # --- generation ------------------------------------------------------------------------
    def stream(self, prompt, params: SamplingParams | None = None, **kw) -> RemoteStream:
        """Start a completion; iterate for text pieces. The connection is opened here, so a
        server that is down fails the call before any text (after the retries)."""
        native = kw.pop("native", None)
        params = (params or SamplingParams(**kw)).validate()
        if self.api == "chat":
            return self._chat_stream(prompt, params, native or {})
        text = self.render(prompt)
        n = self.count_tokens(text)
        if n == 0:
            raise EmptyPrompt("the prompt is empty")
        if n >= self.context_window:
            raise PromptTooLong(n, self.context_window - 1)
        body = {"model": self.model_id, "prompt": text, "max_tokens": min(params.max_tokens, self.context_window - n),
                "temperature": params.temperature, "top_p": params.top_p, "stream": True,
                "stream_options": {"include_usage": True}}
        if params.stop:
            body["stop"] = params.stop
        if params.seed is not None:
            body["seed"] = params.seed
        body |= _sampling_fields(params, self.dialect)
        start = time.perf_counter()
        return RemoteStream(self, self._request("POST", "/v1/completions", json=body, stream=True), n, start)

    def generate(self, prompt, params: SamplingParams | None = None, **kw) -> Generation:
        s = self.stream(prompt, params, **kw)
        for _ in s:
            pass
        return s.result

    def _chat_stream(self, prompt, params: SamplingParams, native: dict) -> RemoteStream:
        """A chat completion of `prompt`'s messages. The prompt's bound (budget.upper) must
        leave the server's window room for a reply: recalled notes go first, the least relevant
        first, where it would not (the assembly fits the budget, so only a window smaller
        than the budget's bound assumed, or a factor calibrated above it, comes here)."""
        segs = [prompt] if isinstance(prompt, str) else list(prompt)
        if segs and not isinstance(segs[0], str | Segment):
            segs = [self.render(segs)]
        counts = [self.count_tokens(s if isinstance(s, str) else s.text) for s in segs]
        n, window, dropped = sum(counts), self.server_context, 0
        if n == 0:
            raise EmptyPrompt("the prompt is empty")
        while self.budget.upper(n) >= window:
            i = next((i for i, s in enumerate(segs) if getattr(s, "tier", "") == "recall" and getattr(s, "ref", "")
                      and not str(s.ref).startswith("recall:")), None)
            if i is None:
                raise PromptTooLong(self.budget.upper(n), window - 1)
            n -= counts.pop(i)
            segs.pop(i)
            dropped += 1
        # the request's own messages where a caller sends them as they are (api/native.py)
        messages = native.get("messages") or to_messages(
            segs if not (len(segs) == 1 and isinstance(segs[0], str)) else segs[0], self.chat)
        if not messages:
            raise EmptyPrompt("the prompt has no message")
        body = {"model": self.model_id, "messages": messages, **sampling_body(params, self.dialect),
                "stream": True, "stream_options": {"include_usage": True}}
        body["max_tokens"] = min(params.max_tokens, window - self.budget.upper(n))
        body |= {k: v for k, v in native.items() if v is not None and k != "messages"}
        if self._stream_usage is not True and len(self.budget._ratios) < CALIBRATION_PROBES:
            self._calibrate(body, n)
        for f in self._dropped_fields:
            body.pop(f, None)
        start = time.perf_counter()
        try:
            r = self._request("POST", "/v1/chat/completions", json=body, stream=True)
        except EngineRefused as exc:
            if exc.param not in ("stream_options",):
                raise
            self._dropped_fields.add(exc.param)  # usage in a stream is a nicety; the reply is not
            body.pop(exc.param)
            r = self._request("POST", "/v1/chat/completions", json=body, stream=True)
        s = RemoteStream(self, r, n, start, chat=True)
        s.extra = {"api": "chat", "messages": len(messages), "dropped_notes": dropped,
                   "bound_tokens": self.budget.upper(n), "window": window}
        return s

    def _calibrate(self, body: dict, counted: int) -> None:
        """Ask the server to count this prompt (a one-token reply, not streamed: every server
        reports usage there) and calibrate the budget with it. The request warms the server's
        prefix cache for the real one that follows, so it costs one token's work there."""
        probe = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "tools", "tool_choice",
                                                               "response_format")}
        probe |= {"max_tokens": 1, "stream": False}
        try:
            r = self.http.post("/v1/chat/completions", json=probe)
            usage = r.json().get("usage") or {} if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError, AttributeError):
            return  # the real request will say what is wrong
        self.budget.observe(counted, usage.get("prompt_tokens"))

    def _request(self, method: str, path: str, stream: bool = False, **kw) -> httpx.Response:
        """One call with retries: connection failures and 429/5xx answers are retried with
        exponential backoff; other 4xx answers are the caller's error and are not
        (`EngineRefused`, naming the parameter the server's answer names)."""
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = self.http.send(self.http.build_request(method, path, **kw), stream=stream)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if r.status_code < 400:
                return r
            detail = r.read().decode(errors="replace")[:300]
            r.close()
            last = f"HTTP {r.status_code}: {detail}"
            if r.status_code not in RETRY_STATUS:
                raise refusal_error(self.url, r.status_code, detail, kw.get("json") or {}, f"{method} {path}")
        raise EngineUnavailable(f"the inference server at {self.url} is unreachable after {self.retries + 1} "
                                f"tries ({method} {path}): {last}")


class RemoteStream:
    """Text pieces from a streamed completion; `.result` once exhausted. Closing it early
    closes the connection, which makes the server stop generating."""

    def __init__(self, engine: RemoteEngine, response: httpx.Response, prompt_tokens: int, start: float,
                 chat: bool = False):
        self._engine, self._response = engine, response
        self._chat = chat
        self._tools = ToolCalls()
        self._refusal = ""
        self.extra: dict = {}
        self._lines = response.iter_lines()
        self._start = start
        self._prompt_tokens = prompt_tokens
        self._parts: list[str] = []
        self._finish = ""
        self._usage: dict = {}
        self._timings: dict = {}
        self._ttft: float | None = None
        self._cancel = current_cancel_event()
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self.result is not None:
            raise StopIteration
        while True:
            if self._cancel is not None and self._cancel.is_set():
                self._finish = "cancelled"
                self._done()  # closing the connection makes the server stop generating
                raise StopIteration
            try:
                line = next(self._lines, None)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                self.close()
                raise EngineUnavailable(f"the inference server at {self._engine.url} broke off the reply after "
                                        f"{len(self._parts)} pieces: {type(exc).__name__}: {exc}") from exc
            if line is None or line.strip() == "data: [DONE]":
                if line is None and not self._finish:
                    self.close()
                    raise EngineUnavailable(f"the inference server at {self._engine.url} ended the stream without "
                                            f"finishing the reply ({len(self._parts)} pieces)")
                self._done()
                raise StopIteration
            if not line.startswith("data:"):
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                self.close()
                raise EngineUnavailable(f"the inference server at {self._engine.url} failed mid-reply: "
                                        f"{chunk['error']}")
            self._usage = chunk.get("usage") or self._usage
            self._timings = chunk.get("timings") or self._timings
            for choice in chunk.get("choices") or []:
                self._finish = choice.get("finish_reason") or self._finish
                if self._chat:
                    delta = choice.get("delta") or choice.get("message") or {}
                    self._tools.feed(delta.get("tool_calls"))
                    self._refusal += delta.get("refusal") or ""
                    piece = delta.get("content") or ""
                else:
                    piece = choice.get("text") or ""
                if piece:
                    if self._ttft is None:
                        self._ttft = time.perf_counter() - self._start
                    self._parts.append(piece)
                    return piece

    def _done(self) -> None:
        total = time.perf_counter() - self._start
        self._response.close()
        text = "".join(self._parts)
        u, t = self._usage, self._timings
        cached = cached_tokens(u, t)
        if self._chat:
            self._engine._stream_usage = bool(u.get("prompt_tokens"))
            self._engine.budget.observe(self._prompt_tokens, u.get("prompt_tokens"))
            if self._refusal or self._finish == "content_filter":
                why = self._refusal or "its content filter stopped the reply"
                raise EngineRefused(f"the inference server at {self._engine.url} refused to answer: {why}")
        prompt = u.get("prompt_tokens") or self._prompt_tokens
        completion = u.get("completion_tokens") or self._engine.count_tokens(text)
        ttft = self._ttft if self._ttft is not None else total
        server = {"url": self._engine.url, "model": self._engine.model_id, "prompt_tokens": u.get("prompt_tokens"),
                  "completion_tokens": u.get("completion_tokens"), "cached_tokens": cached, "ttft_s": ttft}
        if self._chat:
            server |= self.extra | {"counted_tokens": self._prompt_tokens, "budget": self._engine.budget.to_dict()}
        tools = self._tools.result()
        finish = self._finish if self._finish in ("length", "cancelled") else "tool_calls" if tools else "stop"
        stats = RemoteStats(prompt_tokens=prompt, completion_tokens=completion, reused_tokens=cached or 0,
                            prefilled_tokens=prompt - (cached or 0), ttft_s=ttft, total_s=total,
                            finish_reason=finish, server=server, tool_calls=tools)
        self.result = Generation(text, self._engine.encode(text), stats)

    def close(self) -> None:
        self._response.close()

    def __del__(self) -> None:
        self.close()


def _configured_sampling(config: Config) -> dict:
    """The AGENTMEM_SAMPLE_* settings given: a chat model's defaults beside its server's own."""
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
    return {n: getattr(config, f"sample_{n}") for n in names if getattr(config, f"sample_{n}") is not None}


def _window_from(path: Path) -> int:
    """The model's context length from its config.json, where the tokenizer files lie."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_CONTEXT
    return int(cfg.get("max_position_embeddings") or DEFAULT_CONTEXT)


def _tokenize_body(keys: tuple[str, ...], text: str) -> dict:
    """A tokenize request: the text under each key a server may read, no BOS/EOS added (a
    prompt's segments are counted one by one)."""
    return {**dict.fromkeys(keys, text), "add_special_tokens": False, "add_special": False}


def _sampling_fields(params: SamplingParams, dialect: str) -> dict:
    """Every sampling setting, off included (a server fills what is left out with its own
    defaults), under the names of the server's dialect: "llama" (llama.cpp's server and
    llama-cpp-python: `repeat_penalty`, top-k 0 is off) or "openai" (vLLM, SGLang:
    `repetition_penalty`, top-k -1 is off). A grammar does not pass: the server decodes freely
    and the caller checks what comes back."""
    llama = dialect == "llama"
    out = {"frequency_penalty": params.frequency_penalty, "presence_penalty": params.presence_penalty,
           "top_k": params.top_k or (0 if llama else -1), "min_p": params.min_p,
           "repeat_penalty" if llama else "repetition_penalty": params.repetition_penalty}
    if params.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    return out


def _dialect(http: httpx.Client) -> str | None:
    """"llama" for llama.cpp's servers (llama-cpp-python's `/extras/tokenize/count`, llama.cpp's
    `/props`), else "openai"; None while the server does not answer."""
    for method, path, kw in (("POST", "/extras/tokenize/count", {"json": {"input": "a"}}), ("GET", "/props", {})):
        try:
            if http.request(method, path, **kw).status_code == 200:
                return "llama"
        except httpx.HTTPError:
            return None
    return "openai"
