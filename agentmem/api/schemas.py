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


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Role
    content: str | list[ContentPart] | None = ""
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls, sent back
    tool_call_id: str | None = None  # a tool's result: which call it answers
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if p.type == "text")
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; checked by api/reply_format.py (400 with the reason)
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "function"
    function: FunctionDef | None = None


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "reply"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"  # text | json_object | json_schema
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(BaseModel):
    """Sampling fields left out take the model's defaults (generation_config.json, the model
    card, AGENTMEM_SAMPLE_*); ranges are OpenAI's and are checked with a 400 naming the
    field. top_k, min_p and repetition_penalty are extensions, as in vLLM."""
    model_config = ConfigDict(extra="ignore")
    model: str = Field("agentmem", max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
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
    content: str | None
    tool_calls: list[dict] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict | None = None


class CacheStats(BaseModel):
    """agentmem extension: how the prompt was served."""
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    prefilled_tokens: int = 0
    cache_hit_ratio: float = 0.0
    ttft_s: float = 0.0
    memories_used: list[str] = []
    finish_reason: str = ""  # the engine's own: also "repetition" (a loop cut to one cycle)


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
