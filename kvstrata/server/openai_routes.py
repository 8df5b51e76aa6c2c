"""The OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions (both with SSE
streaming and `stream_options.include_usage`), /v1/models and /v1/models/{id}."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvstrata.core import FinishReason
from kvstrata.server.engine_loop import EngineUnavailable, RequestGroup, RequestRejected
from kvstrata.server.errors import CLIENT_GONE, ERROR_RESPONSES, OpenAIError
from kvstrata.server.inputs import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    chat_prompt_ids,
    chat_text_chars,
    check_prompt_chars,
    completion_prompt_ids,
    completion_text_chars,
    sampling_params,
)
from kvstrata.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
)
from kvstrata.server.state import Delta, ServerState, StateDep, deltas, final_outputs
from kvstrata.server.streaming import DONE_EVENT, EventStream, sse_event, stream_error

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: StateDep) -> ModelList:
    return ModelList(data=[_model_card(state)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
async def retrieve_model(model_id: str, state: StateDep) -> ModelCard:
    state.check_model(model_id)  # 404 model_not_found for any other id
    return _model_card(state)


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.model_name, created=state.created_s, max_model_len=state.limits.max_seq_len
    )


@router.post(
    "/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES
)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep) -> Any:
    state.check_model(body.model)
    check_supported(body)
    bounds = state.limits.prompt_bounds(state.config)
    check_prompt_chars(bounds, chat_text_chars(body.messages), "messages")
    prompt_ids = await asyncio.to_thread(chat_prompt_ids, state.tokenizer, body.messages)
    state.limits.check_prompt(prompt_ids, "messages", bounds)
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = state.limits.max_tokens([len(prompt_ids)], requested, default=None)
    params = sampling_params(body, max_tokens, state.tokenizer is not None)
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    group = state.submit(request, request_id, [prompt_ids], params)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _chat_events(state, group, request_id, created, include_usage)
        return EventStream(events, on_close=group.close)

    outs = await final_outputs(request, group)
    if outs is None:
        return Response(status_code=CLIENT_GONE)
    choices = [
        ChatChoice(
            index=i,
            message=ChatResponseMessage(content=out.text),
            finish_reason=_reason(out.finish_reason),
        )
        for i, out in enumerate(outs)
    ]
    return ChatCompletionResponse(
        id=request_id, created=created, model=state.model_name, choices=choices,
        usage=Usage.of(outs, state.config.rank),
    )  # fmt: skip


def check_supported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """400 naming the first field set to something the engine does not implement yet."""
    name = body.unsupported_field()
    if name is not None:
        off = " or ".join(json.dumps(v) for v in body.OFF_VALUES[name])
        raise OpenAIError(
            400, f"'{name}' is not supported yet; it is accepted only as {off} (off)", name,
            "unsupported_parameter",
        )  # fmt: skip


def _chat_events(
    state: ServerState, group: RequestGroup, request_id: str, created: int, include_usage: bool
) -> AsyncGenerator[str, None]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse_event(
            ChatCompletionChunk(
                id=request_id, created=created, model=state.model_name, choices=choices,
                usage=usage,
            )
        )  # fmt: skip

    def choice(delta: Delta) -> ChatChunkChoice:
        return ChatChunkChoice(
            index=delta.index, delta=ChatDelta(content=delta.text or None),
            finish_reason=delta.finish_reason,
        )  # fmt: skip

    opening = chunk([ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))])
    return _events(state, group, include_usage, chunk, choice, opening)


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request, state: StateDep) -> Any:
    state.check_model(body.model)
    check_supported(body)
    bounds = state.limits.prompt_bounds(state.config)
    check_prompt_chars(bounds, completion_text_chars(body), "prompt")
    prompts = await asyncio.to_thread(completion_prompt_ids, state.tokenizer, body)
    for prompt_ids in prompts:
        state.limits.check_prompt(prompt_ids, "prompt", bounds)
    max_tokens = state.limits.max_tokens(
        [len(p) for p in prompts], body.max_tokens, default=COMPLETION_DEFAULT_MAX_TOKENS
    )
    params = sampling_params(body, max_tokens, state.tokenizer is not None)
    request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    group = state.submit(request, request_id, prompts, params)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _completion_events(state, group, request_id, created, include_usage)
        return EventStream(events, on_close=group.close)

    outs = await final_outputs(request, group)
    if outs is None:
        return Response(status_code=CLIENT_GONE)
    choices = [
        CompletionChoice(index=i, text=out.text, finish_reason=_reason(out.finish_reason))
        for i, out in enumerate(outs)
    ]
    return CompletionResponse(
        id=request_id, created=created, model=state.model_name, choices=choices,
        usage=Usage.of(outs, state.config.rank),
    )  # fmt: skip


def _completion_events(
    state: ServerState, group: RequestGroup, request_id: str, created: int, include_usage: bool
) -> AsyncGenerator[str, None]:
    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse_event(
            CompletionResponse(
                id=request_id, created=created, model=state.model_name, choices=choices,
                usage=usage,
            )
        )  # fmt: skip

    def choice(delta: Delta) -> CompletionChoice:
        return CompletionChoice(
            index=delta.index, text=delta.text, finish_reason=delta.finish_reason
        )

    return _events(state, group, include_usage, chunk, choice)


async def _events(
    state: ServerState,
    group: RequestGroup,
    include_usage: bool,
    chunk: Callable[[list[Any], Usage | None], str],
    choice: Callable[[Delta], Any],
    opening: str | None = None,
) -> AsyncGenerator[str, None]:
    """The SSE stream of both APIs: `opening`, a chunk per delta with new text or a finish
    reason, the usage chunk if asked for, then [DONE]; an engine refusal mid-stream is an
    error event. The group closes when the stream ends, however it ends."""
    with group:
        try:
            if opening is not None:
                yield opening
            finals = []
            async for delta in deltas(group):
                if delta.text or delta.finish_reason:
                    yield chunk([choice(delta)], None)
                if delta.output.finished:
                    finals.append(delta.output)
            if include_usage:
                yield chunk([], Usage.of(finals, state.config.rank))
        except (RequestRejected, EngineUnavailable) as e:
            yield stream_error(e)
        yield DONE_EVENT


def _reason(reason: FinishReason | None) -> str | None:
    return reason.value if reason is not None else None
