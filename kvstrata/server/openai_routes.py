"""The OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions (both with SSE
streaming and `stream_options.include_usage`), /v1/models and /v1/models/{id}."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvstrata.core import FinishReason, RequestOutput, SamplingParams
from kvstrata.server.engine_loop import EngineUnavailable, RequestGroup, RequestRejected
from kvstrata.server.errors import CLIENT_GONE, ERROR_RESPONSES, OpenAIError
from kvstrata.server.inputs import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    chat_prompt_ids,
    chat_text_chars,
    check_prompt_chars,
    completion_prompt_ids,
    completion_prompt_texts,
    completion_text_chars,
    sampling_params,
)
from kvstrata.server.logprob_shapes import (
    CompletionShape,
    TokenTexts,
    chat_logprobs,
    new_records,
)
from kvstrata.server.protocol import ChatCompletionRequest, CompletionRequest
from kvstrata.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
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
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    bounds = state.limits.prompt_bounds(state.config)
    check_prompt_chars(bounds, chat_text_chars(body.messages), "messages")
    prompt_ids = await asyncio.to_thread(chat_prompt_ids, state.tokenizer, body.messages)
    state.limits.check_prompt(prompt_ids, "messages", bounds)
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = state.limits.max_tokens([len(prompt_ids)], requested, default=None)
    params = sampling_params(body, max_tokens, state.limits, state.tokenizer is not None)
    if body.logprobs:
        params = dataclasses.replace(params, logprobs=body.top_logprobs or 0)
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    group = state.submit(request, request_id, [prompt_ids] * params.n, params)
    texts = TokenTexts(state.tokenizer)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _chat_events(state, group, request_id, created, include_usage, params, texts)
        return EventStream(events, on_close=group.close)

    outs = await final_outputs(request, group)
    if outs is None:
        return Response(status_code=CLIENT_GONE)
    choices = [
        ChatChoice(
            index=i,
            message=ChatResponseMessage(content=out.text),
            finish_reason=_reason(out.finish_reason),
            logprobs=chat_logprobs(out.logprobs, texts) if out.logprobs is not None else None,
        )
        for i, out in enumerate(outs)
    ]
    return ChatCompletionResponse(
        id=request_id, created=created, model=state.model_name, choices=choices,
        usage=Usage.of(outs, state.config.rank, params.n),
    )  # fmt: skip


def check_supported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """400 naming the first field set to something the engine does not implement yet."""
    name = body.unsupported_field()
    if name is None:
        return
    if name in body.OFF_VALUES:
        off = " or ".join(json.dumps(v) for v in body.OFF_VALUES[name])
        message = f"'{name}' is not supported; it is accepted only as {off} (off)"
    else:
        message = f"'{name}' is not supported unless it equals n (or is absent)"
    raise OpenAIError(400, message, name, "unsupported_parameter")


def _chat_events(
    state: ServerState, group: RequestGroup, request_id: str, created: int, include_usage: bool,
    params: SamplingParams, texts: TokenTexts,
) -> AsyncGenerator[str, None]:  # fmt: skip
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse_event(
            ChatCompletionChunk(
                id=request_id, created=created, model=state.model_name, choices=choices,
                usage=usage,
            )
        )  # fmt: skip

    def choice(delta: Delta) -> ChatChunkChoice | None:
        records = new_records(delta.output, len(delta.token_ids))
        if not (delta.text or delta.finish_reason or records):
            return None
        return ChatChunkChoice(
            index=delta.index, delta=ChatDelta(content=delta.text or None),
            finish_reason=delta.finish_reason,
            logprobs=chat_logprobs(records, texts) if records else None,
        )  # fmt: skip

    openings = [
        chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
        for i in range(params.n)
    ]
    return _events(state, group, include_usage, chunk, choice, openings, params.n)


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request, state: StateDep) -> Any:
    state.check_model(body.model)
    check_supported(body)
    echo_logprobs = body.echo and body.logprobs is not None
    if echo_logprobs and state.dispatcher is not None:
        raise OpenAIError(
            400, "'echo' with 'logprobs' (the prompt's logprobs) is not supported on a PD "
            "decode rank: a prefill rank computes the prompt", "echo", "unsupported_parameter",
        )  # fmt: skip
    bounds = state.limits.prompt_bounds(state.config)
    check_prompt_chars(bounds, completion_text_chars(body), "prompt")
    prompts = await asyncio.to_thread(completion_prompt_ids, state.tokenizer, body)
    for prompt_ids in prompts:
        state.limits.check_prompt(prompt_ids, "prompt", bounds)
    max_tokens = state.limits.max_tokens(
        [len(p) for p in prompts], body.max_tokens, default=COMPLETION_DEFAULT_MAX_TOKENS
    )
    params = sampling_params(body, max_tokens, state.limits, state.tokenizer is not None)
    params = dataclasses.replace(
        params, logprobs=body.logprobs, prompt_logprobs=body.logprobs if echo_logprobs else None
    )
    request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    # Choice i * n + j is choice j of prompt i (OpenAI's numbering).
    choices_of = [prompt for prompt in prompts for _ in range(params.n)]
    echoes = completion_prompt_texts(state.tokenizer, body, prompts) if body.echo else None
    shape = CompletionShape(params.n, echoes, TokenTexts(state.tokenizer), echo_logprobs)
    group = state.submit(request, request_id, choices_of, params)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _completion_events(state, group, request_id, created, include_usage, shape)
        return EventStream(events, on_close=group.close)

    outs = await final_outputs(request, group)
    if outs is None:
        return Response(status_code=CLIENT_GONE)
    choices = [
        CompletionChoice(
            index=i,
            text=shape.echo(i) + out.text,
            finish_reason=_reason(out.finish_reason),
            logprobs=shape.logprobs(i, out, out.output_ids, 0, first=True),
        )
        for i, out in enumerate(outs)
    ]
    return CompletionResponse(
        id=request_id, created=created, model=state.model_name, choices=choices,
        usage=Usage.of(outs, state.config.rank, params.n),
    )  # fmt: skip


def _completion_events(
    state: ServerState, group: RequestGroup, request_id: str, created: int, include_usage: bool,
    shape: CompletionShape,
) -> AsyncGenerator[str, None]:  # fmt: skip
    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse_event(
            CompletionResponse(
                id=request_id, created=created, model=state.model_name, choices=choices,
                usage=usage,
            )
        )  # fmt: skip

    # Per choice: the summed texts of the tokens sent so far, where the next token's
    # text_offset is (offsets follow each token's own text, as in the whole response).
    sent_offsets: dict[int, int] = {}

    def choice(delta: Delta) -> CompletionChoice | None:
        # With echo and logprobs the prompt goes out with the first delta (its logprobs
        # come with the first output), else in an opening event of its own.
        first = delta.index not in sent_offsets
        lead = shape.echo(delta.index) if first and shape.echo_logprobs else ""
        offset = sent_offsets.get(delta.index, 0)
        logprobs = shape.logprobs(delta.index, delta.output, delta.token_ids, offset, first)
        sent_offsets[delta.index] = offset + sum(len(shape.texts(t)) for t in delta.token_ids)
        if not (lead or delta.text or delta.finish_reason or logprobs):
            return None
        return CompletionChoice(
            index=delta.index, text=lead + delta.text, finish_reason=delta.finish_reason,
            logprobs=logprobs,
        )  # fmt: skip

    openings = []
    if shape.echoes is not None and not shape.echo_logprobs:
        total = len(shape.echoes) * shape.n
        openings = [
            chunk([CompletionChoice(index=i, text=shape.echo(i), finish_reason=None)])
            for i in range(total)
        ]
    return _events(state, group, include_usage, chunk, choice, openings, shape.n)


async def _events(
    state: ServerState,
    group: RequestGroup,
    include_usage: bool,
    chunk: Callable[[list[Any], Usage | None], str],
    choice: Callable[[Delta], Any],
    openings: list[str],
    n: int,
) -> AsyncGenerator[str, None]:
    """The SSE stream of both APIs: `openings`, a chunk per delta that `choice` makes one
    of (new text, logprobs or a finish reason), the usage chunk if asked for (`n` choices
    per prompt), then [DONE]; an engine refusal mid-stream is an error event. The group
    closes when the stream ends, however it ends."""
    with group:
        try:
            for opening in openings:
                yield opening
            finals: dict[int, RequestOutput] = {}
            async for delta in deltas(group):
                item = choice(delta)
                if item is not None:
                    yield chunk([item], None)
                if delta.output.finished:
                    finals[delta.index] = delta.output
            if include_usage:
                ordered = [finals[i] for i in sorted(finals)]
                yield chunk([], Usage.of(ordered, state.config.rank, n))
        except (RequestRejected, EngineUnavailable) as e:
            yield stream_error(e)
        yield DONE_EVENT


def _reason(reason: FinishReason | None) -> str | None:
    return reason.value if reason is not None else None
