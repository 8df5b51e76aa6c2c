"""The native endpoints of a rank: /generate (token ids or text in, ids and text out),
/tokenize and /detokenize (vLLM's shapes), /version, /health, /server_info, /metrics,
/flush_cache (and vLLM's /reset_prefix_cache), /get_load (what the router polls) and
/debug/invariants."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvstrata.http.errors import CLIENT_GONE, ERROR_RESPONSES, OpenAIError
from kvstrata.http.grammar_inputs import grammar_param
from kvstrata.http.inputs import (
    GENERATE_DEFAULT_MAX_NEW_TOKENS,
    check_prompt_chars,
    generate_prompt_ids,
    sampling_params,
)
from kvstrata.http.protocol import DetokenizeRequest, GenerateRequest, TokenizeRequest
from kvstrata.http.responses import (
    DetokenizeResponse,
    ErrorResponse,
    FlushResponse,
    GenerateLogprob,
    GenerateResponse,
    HealthResponse,
    LoadResponse,
    TokenizeResponse,
    Usage,
    VersionResponse,
)
from kvstrata.http.streaming import DONE_EVENT, EventStream, sse_event, stream_error
from kvstrata.runtime.engine_loop import RequestGroup
from kvstrata.runtime.request_group import GroupError, final_outputs
from kvstrata.server.logprob_shapes import generate_logprobs, new_records
from kvstrata.server.state import Delta, ServerState, StateDep, deltas
from kvstrata.version import kvstrata_version

if TYPE_CHECKING:
    from kvstrata.model.tokenizer import Tokenizer

router = APIRouter()


@router.post("/generate", response_model=GenerateResponse, responses=ERROR_RESPONSES)
async def generate(body: GenerateRequest, request: Request, state: StateDep) -> Any:
    bounds = state.limits.prompt_bounds(state.config)
    check_prompt_chars(bounds, len(body.text or ""), "text")
    prompt_ids = await asyncio.to_thread(generate_prompt_ids, state.tokenizer, body)
    param = "input_ids" if body.input_ids is not None else "text"
    state.limits.check_prompt(prompt_ids, param, bounds)
    fields = body.sampling_params
    max_tokens = state.limits.max_tokens(
        [len(prompt_ids)], fields.max_new_tokens, default=GENERATE_DEFAULT_MAX_NEW_TOKENS
    )
    params = sampling_params(fields, max_tokens, state.limits, state.tokenizer is not None)
    if body.return_logprob:
        params = dataclasses.replace(params, logprobs=body.top_logprobs_num)
    state.limits.check_cost([len(prompt_ids)], params, state.config)
    await state.compile_grammar(params, grammar_param(fields))
    request_id = f"gen-{uuid.uuid4().hex}"
    group = state.submit(request, request_id, [prompt_ids], params)
    if body.stream:
        return EventStream(_generate_events(state, group, request_id), on_close=group.close)

    outs = await final_outputs(request, group)
    if outs is None:
        return Response(status_code=CLIENT_GONE)
    (out,) = outs
    return GenerateResponse(
        id=request_id,
        text=out.text,
        output_ids=out.output_ids,
        finish_reason=out.finish_reason.value if out.finish_reason is not None else None,
        usage=Usage.of(outs, state.config.rank),
        output_token_logprobs=generate_logprobs(out.logprobs) if out.logprobs is not None else None,
    )


async def _generate_events(
    state: ServerState, group: RequestGroup, request_id: str
) -> AsyncGenerator[str, None]:
    # Each event carries the new text and token ids; the last one also the usage.
    with group:
        try:
            async for delta in deltas(group):
                finished = delta.output.finished
                yield sse_event(
                    GenerateResponse(
                        id=request_id,
                        text=delta.text,
                        output_ids=delta.token_ids,
                        finish_reason=delta.finish_reason,
                        usage=Usage.of([delta.output], state.config.rank) if finished else None,
                        output_token_logprobs=_delta_logprobs(delta),
                    )
                )
        except GroupError as e:
            yield stream_error(e)
        yield DONE_EVENT


def _delta_logprobs(delta: Delta) -> list[GenerateLogprob] | None:
    if delta.output.logprobs is None:
        return None
    return generate_logprobs(new_records(delta.output, len(delta.token_ids)) or [])


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, state: StateDep) -> TokenizeResponse:
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
    param = "prompt" if body.prompt is not None else "messages"
    num_chars = len(body.prompt or "") + sum(len(m.text()) for m in body.messages or ())
    check_prompt_chars(state.limits.prompt_bounds(state.config), num_chars, param)
    tokens = await asyncio.to_thread(_tokenize, state.tokenizer, body)
    return TokenizeResponse(
        tokens=tokens, count=len(tokens), max_model_len=state.limits.max_seq_len
    )


def _tokenize(tokenizer: Tokenizer | None, body: TokenizeRequest) -> list[int]:
    """The request's token ids. Blocking: run off the loop."""
    param = "prompt" if body.prompt is not None else "messages"
    if tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer", param)
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return tokenizer.encode(body.prompt, add_special_tokens=add_special)
    rendered = [{"role": m.role, "content": m.text()} for m in body.messages or ()]
    try:
        text = tokenizer.render_chat(rendered, body.add_generation_prompt)
    except Exception as e:  # the template is model data run on client data: any failure is a 400
        raise OpenAIError(400, f"the chat template failed: {e}", "messages") from e
    return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, state: StateDep) -> DetokenizeResponse:
    state.check_model(body.model)
    if state.tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer", "tokens")
    vocab_size = state.limits.vocab_size
    bad = next((t for t in body.tokens if t >= vocab_size), None)
    if bad is not None:
        raise OpenAIError(
            400,
            f"token id {bad} is outside the vocabulary [0, {vocab_size})",
            "tokens",
            "invalid_token_id",
        )
    tokenizer = state.tokenizer
    text = await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)
    return DetokenizeResponse(prompt=text)


@router.get("/version", response_model=VersionResponse)
async def version() -> VersionResponse:
    return VersionResponse(version=kvstrata_version())


@router.get("/health", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
async def health(state: StateDep) -> HealthResponse:
    if not state.engine_loop.is_healthy:
        raise OpenAIError(503, state.engine_loop.failure or "the engine is not running")
    return HealthResponse()


@router.get("/server_info")
async def server_info(state: StateDep) -> dict[str, Any]:
    return state.info


@router.get("/get_load", response_model=LoadResponse, responses={503: {"model": ErrorResponse}})
async def get_load(
    state: StateDep,
    digest_chunk_size: Annotated[
        int | None, Query(description="Include the cache digest at this chunk size (tokens).")
    ] = None,
    digest_epoch: Annotated[str | None, Query(description="The caller's digest epoch.")] = None,
    digest_version: Annotated[
        int | None, Query(description="The caller's digest version: answer only the changes.")
    ] = None,
) -> LoadResponse:
    load = await state.engine_loop.load()
    digest, digest_error = None, None
    if digest_chunk_size is not None:
        engine = state.engine_loop.engine
        try:
            delta = await state.engine_loop.run(
                engine.cache_digest, digest_chunk_size, digest_epoch, digest_version
            )
            digest = delta.to_json() if delta is not None else None
        except ValueError as e:  # a bad chunk size: the load still answers
            digest_error = str(e)
    return LoadResponse(
        rank=state.config.rank,
        num_running_reqs=load.num_running_reqs,
        num_waiting_reqs=load.num_waiting_reqs,
        num_queued_tokens=load.num_queued_tokens,
        num_free_pages=load.num_free_pages,
        num_cached_pages=load.num_cached_pages,
        num_used_pages=load.num_used_pages,
        num_total_pages=load.num_total_pages,
        num_locked_pages=load.num_locked_pages,
        num_pd_rooms=load.num_pd_rooms,
        max_local_prefill_tokens=load.max_local_prefill_tokens,
        digest=digest,
        digest_error=digest_error,
    )


@router.get("/metrics", response_class=Response)
async def metrics(state: StateDep) -> Response:
    load = await state.engine_loop.load()
    cache = await state.engine_loop.run(state.engine_loop.engine.metrics)
    sender = state.decode_sender
    failures = sender.failures.counts if sender is not None else None
    invariants = await state.invariants.for_metrics(state)
    text = state.metrics.render(load, cache, invariants, failures)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


@router.get("/debug/invariants", responses={503: {"model": ErrorResponse}})
async def debug_invariants(state: StateDep) -> dict[str, Any]:
    """Pages per tier add up, and every lock, room and prefetch has a live request:
    `{ok, idle, violations, counts}`, checked between two engine steps."""
    return (await state.invariants.check(state)).to_json()


_FLUSH_RESPONSES: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorResponse},
    503: {"model": ErrorResponse},
}


# /reset_prefix_cache: vLLM's name for the same (aiperf's --reset-kv-cache posts it).
@router.post("/reset_prefix_cache", response_model=FlushResponse, responses=_FLUSH_RESPONSES)
@router.post("/flush_cache", response_model=FlushResponse, responses=_FLUSH_RESPONSES)
async def flush_cache(
    state: StateDep,
    wait: Annotated[bool, Query(description="Wait until no request runs, then flush.")] = False,
) -> FlushResponse:
    if not await state.engine_loop.flush_cache(wait):
        raise OpenAIError(
            409, "requests are in flight; retry when idle or pass ?wait=true", code="busy"
        )
    return FlushResponse(flushed=True)
