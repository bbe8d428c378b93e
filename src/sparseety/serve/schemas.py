"""Request and response bodies, shaped like OpenAI's; ``sparsity`` is SparSEEty's extra body field.

Generation is greedy: ``temperature``, ``top_p`` and ``seed`` are accepted for compatibility and do not
change the tokens (``seed`` seeds seeded policies such as ``random``). Fields an OpenAI client may send
that the server does not use are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from sparseety.ratio import Ratio
from sparseety.request_json import Role


class SparsityRequest(BaseModel):
    """Per-request override of the server's sparsity and tracing.

    Attributes
    ----------
    policy : KV policy name (``sparseety policies list``); options of the server's policy do not carry over.
    budget : slots kept per layer and KV head; or ``ratio``, the fraction of the prompt removed.
    options : policy options, ``{"sinks": 4}``.
    tier : tier this request is traced at when it is sampled or forced.
    trace : force tracing of this request (tier 3 unless ``tier`` says otherwise); the header
        ``X-Sparseety-Trace: 1`` does the same.
    """

    model_config = ConfigDict(extra="forbid")

    policy: str | None = Field(None, min_length=1, max_length=64)
    budget: StrictInt | None = Field(None, gt=0, le=1 << 20)
    ratio: Ratio | None = None
    options: dict[str, str | int | float | bool] | None = Field(None, max_length=32)
    tier: StrictInt | None = Field(None, ge=1, le=3)
    trace: StrictBool = False


class StreamOptions(BaseModel):
    """``include_usage``: send a last chunk with the usage block (and ``usage: null`` on the others)."""

    include_usage: StrictBool = False


class TextPart(BaseModel):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message."""

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., max_length=256)
    max_tokens: StrictInt | None = Field(None, description="Largest number of generated tokens (1 to the server's "
                                         "--max-tokens-limit).")
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False, description="Accepted; generation is greedy.")
    top_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False, description="Accepted; generation is greedy.")
    n: StrictInt | None = Field(None, description="Only 1 (greedy generation gives one answer).")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1, description="Seed of seeded policies; generation stays greedy.")
    user: str | None = None
    sparsity: SparsityRequest | None = None


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is a synonym of ``max_tokens``."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, description="A synonym of max_tokens.")


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: a raw-text prompt (a list holds exactly one prompt)."""

    prompt: str | list[str]


class SparsityUsage(BaseModel):
    """What sparsity did to this request."""

    model_config = ConfigDict(extra="allow")

    policy: str
    evicted_positions: int | None
    eviction_events: int | None
    kv_cache_bytes_peak: int
    kv_cache_bytes_dense: int
    draft_rejected: int
    pruned_tokens: int | None = None


class Usage(BaseModel):
    """OpenAI's usage block plus ``sparsity``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    sparsity: SparsityUsage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sparseety"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class TraceList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in ((400, "Bad request body"), (401, "No API key"), (403, "Wrong API key"),
                         (404, "Unknown model or trace"), (409, "Request id in use"), (413, "Body too large"),
                         (429, "Queue full"), (503, "Shutting down"))
}
