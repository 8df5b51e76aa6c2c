"""The OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions (both with SSE
streaming and `stream_options.include_usage`, over one shared path once a request is
checked; `answers.py` holds what differs), /v1/models and /v1/models/{id}."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any, NamedTuple

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvstrata.core import RequestOutput, SamplingParams
from kvstrata.http.chat_prompt import chat_prompt_ids
from kvstrata.http.errors import CLIENT_GONE, ERROR_RESPONSES, OpenAIError
from kvstrata.http.grammar_inputs import grammar_param
from kvstrata.http.inputs import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    chat_text_chars,
    check_num_prompts,
    check_prompt_chars,
    completion_num_prompts,
    completion_prompt_ids,
    completion_prompt_texts,
    completion_text_chars,
    sampling_params,
)
from kvstrata.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
)
from kvstrata.http.reasoning import prompt_opens_thinking
from kvstrata.http.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
)
from kvstrata.http.responses_api import ResponsesRequest
from kvstrata.http.streaming import DONE_EVENT, EventStream, stream_error
from kvstrata.http.tool_prompt import tool_grammar, tool_request
from kvstrata.runtime.engine_loop import RequestGroup
from kvstrata.runtime.request_group import GroupError, final_outputs
from kvstrata.server.answers import Answer, ChatAnswer, CompletionAnswer
from kvstrata.server.chat_output import ChatOutput
from kvstrata.server.generated_turns import conversation_key
from kvstrata.server.logprob_shapes import CompletionShape, TokenTexts
from kvstrata.server.state import ServerState, StateDep, deltas

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
    plan = await chat_plan(body, state)
    return await _answer(state, request, body, plan.answer, plan.prompts, plan.params)


class ChatPlan(NamedTuple):
    """A checked chat request, ready to submit: its answer's shape, its prompt once per
    choice, its sampling."""

    answer: ChatAnswer
    prompts: list[list[int]]
    params: SamplingParams


async def chat_plan(body: ChatCompletionRequest, state: ServerState) -> ChatPlan:
    """Check a chat request and build what serving it takes (400 naming the field that
    is wrong); the Responses API serves its requests through this too."""
    check_supported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    check_num_prompts(1, body.n, state.config)
    tools = tool_request(body, state.tool_format) if body.tools or body.tool_choice else None
    template_kwargs = body.chat_template_kwargs or {}
    generated = state.turns.generated_in(body.messages)  # read here, on the event loop
    state.metrics.spliced_turns.inc(len(generated))
    prompts = await _checked_prompts(
        state,
        "messages",
        chat_text_chars(body.messages),
        lambda: [
            chat_prompt_ids(state.tokenizer, body.messages, tools, template_kwargs, generated)
        ],
    )
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = state.limits.max_tokens([len(prompts[0])], requested, default=None)
    params = sampling_params(body, max_tokens, state.limits, state.tokenizer is not None)
    if body.logprobs:
        params = dataclasses.replace(params, logprobs=body.top_logprobs or 0)
    grammar_field = grammar_param(body)
    tool_calls = tool_grammar(tools) if tools is not None else None
    if tools is not None and tool_calls is not None:
        if params.grammar is not None:
            message = f"tool_choice {tools.choice!r} and {grammar_field} both constrain the output"
            raise OpenAIError(400, message, "tool_choice", "invalid_value")
        params, grammar_field = dataclasses.replace(params, grammar=tool_calls), "tools"
    state.limits.check_cost([len(prompts[0])], params, state.config)
    await state.compile_grammar(params, grammar_field)
    fmt = tools.fmt if tools is not None and tools.active else None
    thinking = None
    if state.reasoning_format is not None and state.tokenizer is not None:
        tail = state.tokenizer.decode(prompts[0][-16:], skip_special_tokens=False)
        thinking = prompt_opens_thinking(tail)
    output = ChatOutput(fmt, thinking)
    remember = None  # with --chat-generated-turns 0 nothing is kept: no key to hash
    if state.turns.max_turns > 0:
        remember = functools.partial(state.remember_answer, conversation_key(body.messages))
    answer = ChatAnswer(state.model_name, params.n, TokenTexts(state.tokenizer), output, remember)
    return ChatPlan(answer, prompts * params.n, params)


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request, state: StateDep) -> Any:
    state.check_model(body.model)
    check_supported(body)
    echo_logprobs = body.echo and body.logprobs is not None
    if echo_logprobs and state.decode_sender is not None:
        raise OpenAIError(
            400,
            "'echo' with 'logprobs' (the prompt's logprobs) is not supported on a PD "
            "decode rank: a prefill rank computes the prompt",
            "echo",
            "unsupported_parameter",
        )
    check_num_prompts(completion_num_prompts(body), body.n, state.config)
    prompts = await _checked_prompts(
        state,
        "prompt",
        completion_text_chars(body),
        lambda: completion_prompt_ids(state.tokenizer, body),
    )
    max_tokens = state.limits.max_tokens(
        [len(p) for p in prompts], body.max_tokens, default=COMPLETION_DEFAULT_MAX_TOKENS
    )
    params = sampling_params(body, max_tokens, state.limits, state.tokenizer is not None)
    params = dataclasses.replace(
        params, logprobs=body.logprobs, prompt_logprobs=body.logprobs if echo_logprobs else None
    )
    state.limits.check_cost([len(p) for p in prompts], params, state.config)
    await state.compile_grammar(params, grammar_param(body))
    echoes = completion_prompt_texts(state.tokenizer, body, prompts) if body.echo else None
    shape = CompletionShape(params.n, echoes, TokenTexts(state.tokenizer), echo_logprobs)
    # Choice i * n + j is choice j of prompt i (OpenAI's numbering).
    choices_of = [prompt for prompt in prompts for _ in range(params.n)]
    answer = CompletionAnswer(state.model_name, shape)
    return await _answer(state, request, body, answer, choices_of, params)


def check_supported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """400 naming the first field set to something the engine does not implement yet, or
    `stream_options` without `stream` (as OpenAI and vLLM refuse it)."""
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(
            400,
            "'stream_options' is only allowed when 'stream' is true",
            "stream_options",
            "invalid_value",
        )
    refuse_unsupported(body)


def refuse_unsupported(body: ChatCompletionRequest | CompletionRequest | ResponsesRequest) -> None:
    """400 `unsupported_parameter` naming the first field set to a value the engine does
    not implement (any request schema: chat, completions, responses)."""
    name = body.unsupported_field()
    if name is None:
        return
    if name in body.OFF_VALUES:
        off = " or ".join(json.dumps(v) for v in body.OFF_VALUES[name])
        message = f"'{name}' is not supported; it is accepted only as {off} (off)"
    else:
        message = f"'{name}' is not supported unless it equals n (or is absent)"
    raise OpenAIError(400, message, name, "unsupported_parameter")


async def _checked_prompts(
    state: ServerState, param: str, num_chars: int, tokenize: Callable[[], list[list[int]]]
) -> list[list[int]]:
    """The prompts' token ids, each within the prompt bounds: the characters are checked
    before tokenizing (off the event loop), the tokens after. 400 naming `param`."""
    bounds = state.limits.prompt_bounds(state.config)
    check_prompt_chars(bounds, num_chars, param)
    prompts = await asyncio.to_thread(tokenize)
    for prompt_ids in prompts:
        state.limits.check_prompt(prompt_ids, param, bounds)
    return prompts


async def _answer(
    state: ServerState,
    request: Request,
    body: ChatCompletionRequest | CompletionRequest,
    answer: Answer,
    choice_prompts: list[list[int]],
    params: SamplingParams,
) -> Any:
    """The path both APIs share once a request is checked: submit one engine request per
    choice, then stream the answer or return it whole, in `answer`'s shape."""
    group = state.submit(request, answer.request_id, choice_prompts, params, user=body.user)
    if body.stream:
        options = body.stream_options or StreamOptions()
        events = _events(state, group, answer, options, params.n)
        return EventStream(events, on_close=group.close)
    outs = await final_outputs(request, group)
    if outs is None:
        return Response(status_code=CLIENT_GONE)
    choices = [answer.final_choice(i, out) for i, out in enumerate(outs)]
    return answer.response(choices, Usage.of(outs, state.config.rank, params.n))


async def _events(
    state: ServerState, group: RequestGroup, answer: Answer, options: StreamOptions, n: int
) -> AsyncGenerator[str, None]:
    """The SSE stream of both APIs: the answer's openings, a chunk per delta it makes a
    choice of (new text, logprobs or a finish reason; with `continuous_usage_stats` its
    choice's usage so far), the usage chunk if asked for (`n` choices per prompt), then
    [DONE]; an engine refusal mid-stream is an error event. The group closes when the
    stream ends, however it ends."""
    rank = state.config.rank
    with group:
        try:
            for opening in answer.openings():
                yield opening
            finals: dict[int, RequestOutput] = {}
            async for delta in deltas(group):
                choice = answer.stream_choice(delta)
                if choice is not None:
                    usage = (
                        Usage.of([delta.output], rank) if options.continuous_usage_stats else None
                    )
                    yield answer.chunk([choice], usage)
                if delta.output.finished:
                    finals[delta.index] = delta.output
            if options.include_usage:
                ordered = [finals[i] for i in sorted(finals)]
                yield answer.chunk([], Usage.of(ordered, state.config.rank, n))
        except GroupError as e:
            yield stream_error(e)
        yield DONE_EVENT
