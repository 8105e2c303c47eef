"""The engine as the rest of agentmem sees it, and the one place that picks which one runs.

Assembly, the session and the REST service use a handful of an engine's members: its
tokenizer (`encode`, `decode`, `count_tokens`), its chat format (`chat.wraps`,
`chat.generation_prefix`, `format_message`, `chat_segments`), its `context_window`, and
`stream` / `generate`. `TextEngine` names that surface; the embedded `Engine` and
`RemoteEngine` (an OpenAI-compatible inference server) both have it, and nothing above them
needs to know which one runs. Reflection and compression read the embedded model's tensors,
so they always run on an embedded `Engine` (`local_engine`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from ..config import Config
from .sampler import SamplingParams
from .tokenizer import ChatFormat


@runtime_checkable
class TextEngine(Protocol):
    model_id: str
    chat: ChatFormat
    context_window: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def count_tokens(self, text: str) -> int: ...

    def format_message(self, role: str, content: str) -> str: ...

    def chat_segments(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list: ...

    def stream(self, prompt, params: SamplingParams | None = None, **kw) -> Iterator[str]:
        """An iterator of text pieces whose `.result` (a `Generation`) is set once exhausted;
        closing it early cancels the request."""
        ...

    def generate(self, prompt, params: SamplingParams | None = None, **kw): ...


def load_engine(config: Config | None = None) -> TextEngine:
    """The remote engine when `AGENTMEM_ENGINE_URL` is set, else the embedded one."""
    config = config or Config()
    if config.engine_url:
        from .remote import RemoteEngine

        return RemoteEngine.from_config(config)
    from .engine import Engine

    return Engine.load(config)


def local_engine(engine: TextEngine, config: Config) -> TextEngine:
    """An embedded engine for the jobs that run the model's tensors themselves (reflection's
    constrained decoding, LLMLingua): `engine` itself when it is embedded, else one loaded
    from `config`'s model (the default SmolLM2-135M) beside the remote one."""
    from .engine import Engine

    if isinstance(engine, Engine):
        return engine
    return Engine.load(config)
