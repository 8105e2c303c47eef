"""Request and response bodies. The chat ones follow OpenAI's chat completions API, so its
official client works unchanged; fields OpenAI defines that agentmem does not use are
accepted and ignored, as OpenAI-compatible servers do."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["system", "user", "assistant", "tool", "developer"]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Role
    content: str | list[ContentPart] | None = ""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if p.type == "text")
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field("agentmem", max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, min_length=1, max_length=128, description="whose memory is used; none: stateless")
    session_id: str | None = Field(None, min_length=1, max_length=128,
                                   description="agentmem extension: continue this session of `user`")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None


class CacheStats(BaseModel):
    """agentmem extension: how the prompt was served."""
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    prefilled_tokens: int = 0
    cache_hit_ratio: float = 0.0
    ttft_s: float = 0.0
    memories_used: list[str] = []


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    session_id: str | None = None
    agentmem: CacheStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "agentmem"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- memory -------------------------------------------------------------------------------
class MemoryIn(BaseModel):
    text: str = Field(min_length=1)
    importance: float = Field(0.5, ge=0.0, le=1.0)
    kind: str = Field("fact", min_length=1, max_length=32)
    event_time: datetime | None = None


class MemoryPatch(BaseModel):
    text: str | None = Field(None, min_length=1)
    importance: float | None = Field(None, ge=0.0, le=1.0)


class SearchIn(BaseModel):
    query: str = Field(min_length=1)
    k: int = Field(10, ge=1, le=100)
    since: datetime | None = None
    until: datetime | None = None


class ContextIn(BaseModel):
    query: str = Field(min_length=1)


class CoreBlockIn(BaseModel):
    value: str
    limit: int | None = Field(None, ge=1, le=100_000)


class MessageIn(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str = Field(min_length=1)
    event_time: datetime | None = None


class MessagesIn(BaseModel):
    session_id: str | None = Field(None, min_length=1, max_length=128)
    messages: list[MessageIn] = Field(min_length=1)
