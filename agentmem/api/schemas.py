"""Request and response bodies. The chat ones follow OpenAI's chat completions API, so its
official client works unchanged; fields OpenAI defines that agentmem does not use are
accepted and ignored, as OpenAI-compatible servers do."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from ..tiers.archive import clean_text
from ..tiers.schema import to_db_time
from ..tiers.sizes import KIND_CHARS, MAX_BLOCK_LIMIT, SESSION_ID_CHARS, USER_ID_CHARS
from .roles import Role


def _storable_time(t: datetime) -> datetime:
    to_db_time(t)  # InvalidInput (a ValueError) when its UTC form is out of range: a 422
    return t


Time = Annotated[datetime, AfterValidator(_storable_time)]


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
    user: str | None = Field(None, min_length=1, max_length=USER_ID_CHARS,
                             description="whose memory is used; none: stateless")
    session_id: str | None = Field(None, min_length=1, max_length=SESSION_ID_CHARS,
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
    kind: str = Field("fact", min_length=1, max_length=KIND_CHARS)
    event_time: Time | None = None


class MemoryPatch(BaseModel):
    text: str | None = Field(None, min_length=1)
    importance: float | None = Field(None, ge=0.0, le=1.0)


class SearchIn(BaseModel):
    query: str = Field(min_length=1)
    k: int = Field(10, ge=1, le=100)
    since: Time | None = None
    until: Time | None = None


class ContextIn(BaseModel):
    query: str = Field(min_length=1)


class CoreBlockIn(BaseModel):
    value: str
    limit: int | None = Field(None, ge=1, le=MAX_BLOCK_LIMIT)
    version: int | None = Field(None, ge=0, description="the block's version as read (0: it must not exist yet); "
                                "a 409 if another writer changed it since")


class MessageIn(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str = Field(min_length=1)
    event_time: Time | None = None


class MessagesIn(BaseModel):
    session_id: str | None = Field(None, min_length=1, max_length=SESSION_ID_CHARS)
    messages: list[MessageIn] = Field(min_length=1)


def storable(value: str, param: str) -> str:
    """`value` if the tokenizer and the database can take it, else a 400 naming `param`
    (for fields whose schema cannot say it, such as chat content parts)."""
    from .errors import ApiError

    try:
        return clean_text(value, param, allow_empty=True)
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_text", param=param) from None
