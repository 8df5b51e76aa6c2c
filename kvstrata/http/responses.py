"""Response schemas of the HTTP API (pydantic), OpenAI-compatible and native: what ranks
and routers answer, usage with where the prompt's KV came from, and the error body."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from kvstrata.core import RequestOutput


class KvstrataUsage(BaseModel):
    """Where the prompt's KV came from: cached per tier, received by PD transfer, or (on
    a decode rank) prefilled by the decode rank itself; and which rank served it."""

    cached_tokens_l1: int
    cached_tokens_l2: int
    cached_tokens_l3: int
    transferred_tokens: int
    local_prefill_tokens: int
    rank: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    kvstrata: KvstrataUsage

    @classmethod
    def of(cls, outputs: list[RequestOutput], rank: int, n: int = 1) -> Usage:
        """The summed usage of one HTTP call's requests, in choice order (`n` per prompt):
        completion tokens of every choice, each prompt (and its cache use) once."""
        completion = sum(len(out.output_ids) for out in outputs)
        outputs = outputs[::n]
        prompt = sum(len(out.prompt_ids) for out in outputs)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(out.cached_tokens for out in outputs)
            ),
            kvstrata=KvstrataUsage(
                cached_tokens_l1=sum(out.cache_usage.l1_tokens for out in outputs),
                cached_tokens_l2=sum(out.cache_usage.l2_tokens for out in outputs),
                cached_tokens_l3=sum(out.cache_usage.l3_tokens for out in outputs),
                transferred_tokens=sum(out.cache_usage.transferred_tokens for out in outputs),
                local_prefill_tokens=sum(out.cache_usage.local_prefill_tokens for out in outputs),
                rank=rank,
            ),
        )


FinishReasonText = Literal["stop", "length", "abort", "tool_calls"]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # The thinking of a reasoning model (--reasoning-parser), vLLM's and SGLang's field.
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: FinishReasonText | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(BaseModel):
    """A call as a stream sends it: whole, in one delta (OpenAI's shape: `index` orders a
    choice's calls; the client joins a call's deltas by it)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReasonText | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """The legacy shape: per token its text, logprob (null for the first prompt token of
    an echo), top alternatives by text (the sampled token included) and character offset."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReasonText | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    """Also the shape of each streamed completion chunk (`usage` only on the last)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class GenerateTopLogprob(BaseModel):
    token_id: int
    logprob: float


class GenerateLogprob(GenerateTopLogprob):
    top_logprobs: list[GenerateTopLogprob]


class GenerateResponse(BaseModel):
    """Also the shape of each streamed chunk: `text` and `output_ids` are then the new
    text and tokens of that chunk, `usage` is set on the last one."""

    id: str
    text: str
    output_ids: list[int]
    finish_reason: FinishReasonText | None
    usage: Usage | None = None
    output_token_logprobs: list[GenerateLogprob] | None = None  # with return_logprob


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvstrata"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class LoadResponse(BaseModel):
    """One rank's load, as the router polls it (see Engine.load)."""

    rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_queued_tokens: int
    num_free_pages: int
    num_cached_pages: int
    num_used_pages: int
    num_total_pages: int
    num_locked_pages: int = 0
    num_pd_rooms: int = 0
    # Decode rank: the most uncached prompt tokens it would now prefill itself (local
    # prefill) instead of sending them to a prefill rank; 0 elsewhere.
    max_local_prefill_tokens: int = 0
    # Only when asked for (?digest_chunk_size=N): the cache digest, or why there is none
    # (null digest and no error: this rank has no prefix cache). See DigestDelta.to_json.
    digest: dict[str, Any] | None = None
    digest_error: str | None = None


class FlushResponse(BaseModel):
    flushed: bool


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
