"""`RemoteEngine`: an OpenAI-compatible inference server (vLLM, SGLang, llama.cpp's server,
TGI) in place of the embedded engine.

Each prompt goes to `/v1/completions` as the rendered text of its segments, in assembly
order, streamed. The assembly puts the stable part first (persona, core blocks, summary,
recent turns), so the server's own prefix cache reuses it from turn to turn; the embedded
engine's chunk-KV blending does not apply here. Tokens are counted with the model's own
tokenizer files (by path; default: the default model's, in the embedded engine's cache), so
budgets match what the server sees.

What the server reports (prompt tokens, cached tokens where it says: `usage.
prompt_tokens_details.cached_tokens` for vLLM/SGLang, `timings.cache_n` for llama.cpp's
server) lands in the turn's stats; time to first token is measured here.

Failures: connecting and the server's 429/5xx answers before any text are retried with
exponential backoff (nothing was generated yet, so the request is still idempotent); a
stream cut after text has flowed is not retried. Either way `EngineUnavailable` says which
server and why; the session has already stored the user's message.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..config import Config
from .engine import ChatText, Generation, GenerationStats, Segment
from .errors import EmptyPrompt, EngineUnavailable, PromptTooLong
from .sampler import SamplingParams
from .tokenizer import ChatFormat, chat_format, load_tokenizer

RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
DEFAULT_CONTEXT = 8192


@dataclass
class RemoteStats(GenerationStats):
    """The embedded engine's stats, filled from the server's report: `reused_tokens` is the
    server's cached prefix where it reports one. `server` keeps the raw figures (None where
    the server did not say)."""

    server: dict = field(default_factory=dict)


class RemoteEngine(ChatText):
    def __init__(self, url: str, tokenizer, *, model: str | None = None, api_key: str | None = None,
                 context_window: int = DEFAULT_CONTEXT, timeout_s: float = 120.0, connect_timeout_s: float = 5.0,
                 retries: int = 3, backoff_s: float = 0.25):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.tokenizer = tokenizer
        self.chat: ChatFormat = chat_format(tokenizer)
        self.context_window = context_window
        self.retries, self.backoff_s = retries, backoff_s
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
        if path is None:
            from .weights import resolve_model_dir

            path = resolve_model_dir(config.model_path, config.cache_dir)
        window = config.context_window or _window_from(Path(path))
        return cls(config.engine_url, load_tokenizer(Path(path)), model=config.engine_model,
                   api_key=config.engine_api_key, context_window=window, timeout_s=config.engine_timeout_s,
                   retries=config.engine_retries)

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
        params = (params or SamplingParams(**kw)).validate()
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
        body |= _sampling_fields(params)
        start = time.perf_counter()
        return RemoteStream(self, self._request("POST", "/v1/completions", json=body, stream=True), n, start)

    def generate(self, prompt, params: SamplingParams | None = None, **kw) -> Generation:
        s = self.stream(prompt, params, **kw)
        for _ in s:
            pass
        return s.result

    def _request(self, method: str, path: str, stream: bool = False, **kw) -> httpx.Response:
        """One call with retries: connection failures and 429/5xx answers are retried with
        exponential backoff; other 4xx answers are the caller's error and are not."""
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
                raise EngineUnavailable(f"the inference server at {self.url} refused {method} {path}: {last}")
        raise EngineUnavailable(f"the inference server at {self.url} is unreachable after {self.retries + 1} "
                                f"tries ({method} {path}): {last}")


class RemoteStream:
    """Text pieces from a streamed completion; `.result` once exhausted. Closing it early
    closes the connection, which makes the server stop generating."""

    def __init__(self, engine: RemoteEngine, response: httpx.Response, prompt_tokens: int, start: float):
        self._engine, self._response = engine, response
        self._lines = response.iter_lines()
        self._start = start
        self._prompt_tokens = prompt_tokens
        self._parts: list[str] = []
        self._finish = ""
        self._usage: dict = {}
        self._timings: dict = {}
        self._ttft: float | None = None
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self.result is not None:
            raise StopIteration
        while True:
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
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None and "cache_n" in t:
            cached = t["cache_n"]
        prompt = u.get("prompt_tokens") or self._prompt_tokens
        completion = u.get("completion_tokens") or self._engine.count_tokens(text)
        ttft = self._ttft if self._ttft is not None else total
        server = {"url": self._engine.url, "model": self._engine.model_id, "prompt_tokens": u.get("prompt_tokens"),
                  "completion_tokens": u.get("completion_tokens"), "cached_tokens": cached, "ttft_s": ttft}
        stats = RemoteStats(prompt_tokens=prompt, completion_tokens=completion, reused_tokens=cached or 0,
                            prefilled_tokens=prompt - (cached or 0), ttft_s=ttft, total_s=total,
                            finish_reason="length" if self._finish == "length" else "stop", server=server)
        self.result = Generation(text, self._engine.encode(text), stats)

    def close(self) -> None:
        self._response.close()

    def __del__(self) -> None:
        self.close()


def _window_from(path: Path) -> int:
    """The model's context length from its config.json, where the tokenizer files lie."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_CONTEXT
    return int(cfg.get("max_position_embeddings") or DEFAULT_CONTEXT)


def _sampling_fields(params: SamplingParams) -> dict:
    """The sampling settings that differ from off, under the names OpenAI-compatible servers
    take (top_k, min_p and repetition_penalty as vLLM and llama.cpp's server do). A grammar
    does not pass: the server decodes freely and the caller checks what comes back."""
    out = {"frequency_penalty": params.frequency_penalty, "presence_penalty": params.presence_penalty,
           "top_k": params.top_k, "min_p": params.min_p}
    out = {k: v for k, v in out.items() if v}
    if params.repetition_penalty != 1.0:
        out["repetition_penalty"] = params.repetition_penalty
    if params.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    return out
