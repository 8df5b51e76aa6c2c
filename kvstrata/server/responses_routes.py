"""The Responses API: `POST /v1/responses` (input items, instructions, tools, text format,
`previous_response_id`, `store`, the typed event stream), `GET` and `DELETE
/v1/responses/{id}`. A request is served as the chat request it amounts to
(`responses_api.chat_request`, `openai_routes.chat_plan`); the answer's id goes out in the
`X-Kvstrata-Response-Id` header too, so a router learns which rank holds it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvstrata.core import SamplingParams, SessionRef
from kvstrata.http.errors import CLIENT_GONE, ERROR_RESPONSES, OpenAIError
from kvstrata.http.protocol import ChatCompletionRequest, ChatMessage
from kvstrata.http.responses import Usage
from kvstrata.http.responses_api import RESPONSE_ID_HEADER, ResponsesRequest, chat_request
from kvstrata.http.streaming import EventStream, stream_error
from kvstrata.runtime.engine_loop import RequestGroup
from kvstrata.runtime.request_group import GroupError, final_outputs
from kvstrata.server.openai_routes import ChatPlan, chat_plan, refuse_unsupported
from kvstrata.server.response_output import (
    ResponseEvents,
    ResponseShape,
    assistant_message,
    output_items,
)
from kvstrata.server.state import ServerState, StateDep, deltas

router = APIRouter()


@router.post("/v1/responses", responses=ERROR_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request, state: StateDep) -> Any:
    state.check_model(body.model)
    refuse_unsupported(body)
    history: list[ChatMessage] = []
    response_id = f"resp_{uuid.uuid4().hex}"
    # A chain of responses is one agent session: its first response's id names it, unless
    # a session header names another (state.submit prefers the header).
    chain_session = SessionRef(response_id)
    if body.previous_response_id is not None:
        stored = state.responses.get(body.previous_response_id)
        if stored is None:
            raise OpenAIError(
                404,
                f"no response {body.previous_response_id!r} is stored here (never stored, "
                "expired, deleted, or on another rank)",
                "previous_response_id",
                "previous_response_not_found",
            )
        history = stored.conversation
        if stored.session_id is not None:
            chain_session = SessionRef(stored.session_id)
    chat = chat_request(body, history)
    plan = await chat_plan(chat, state)
    shape = ResponseShape(body, response_id, state.model_name)
    params = state.with_session(request, plan.params, body.user, chain_session)
    group = state.submit(request, response_id, plan.prompts, params)
    answer: Response
    if body.stream:
        events = _events(state, group, plan, shape, chat, params)
        answer = EventStream(events, on_close=group.close)
    else:
        outs = await final_outputs(request, group)
        if outs is None:
            return Response(status_code=CLIENT_GONE)
        choice = plan.answer.final_choice(0, outs[0])
        items = output_items(choice.message)
        usage = Usage.of(outs, state.config.rank)
        result = shape.envelope("completed", items, usage, choice.finish_reason)
        _store(state, shape, result, chat, items, params)
        answer = JSONResponse(result)
    answer.headers[RESPONSE_ID_HEADER] = shape.response_id
    return answer


@router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def get_response(response_id: str, state: StateDep) -> dict[str, Any]:
    stored = state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.body


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def delete_response(response_id: str, state: StateDep) -> dict[str, Any]:
    if not state.responses.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> OpenAIError:
    message = f"no response {response_id!r} is stored here (never stored, expired or deleted)"
    return OpenAIError(404, message, "response_id", "response_not_found")


def _store(
    state: ServerState,
    shape: ResponseShape,
    result: dict[str, Any],
    chat: ChatCompletionRequest,
    items: list[dict[str, Any]],
    params: SamplingParams,
) -> None:
    """Keep a finished response if asked: its object, and its conversation (without the
    instructions, which a follow-up does not inherit) with its output last."""
    if not shape.body.store:
        return
    messages = chat.messages[1:] if shape.body.instructions else chat.messages
    session = params.session.session_id if params.session is not None else None
    conversation = [*messages, assistant_message(items)]
    state.responses.put(shape.response_id, result, conversation, session)


async def _events(
    state: ServerState,
    group: RequestGroup,
    plan: ChatPlan,
    shape: ResponseShape,
    chat: ChatCompletionRequest,
    params: SamplingParams,
) -> AsyncGenerator[str, None]:
    """The typed stream. Nothing goes out before the engine's first output: a request
    refused before it is one error event, as on the chat stream (a router may then try
    another rank); one that fails later ends with response.failed."""
    stream = ResponseEvents(shape)
    started = False
    with group:
        try:
            async for delta in deltas(group):
                if not started:
                    started = True
                    for event in stream.openings():
                        yield event
                choice = plan.answer.stream_choice(delta)
                if choice is not None:
                    for event in stream.on_delta(choice.delta):
                        yield event
                if delta.output.finished:
                    usage = Usage.of([delta.output], state.config.rank)
                    for event in stream.closing(usage, delta.finish_reason):
                        yield event
                    result = shape.envelope("completed", stream.items, usage, delta.finish_reason)
                    _store(state, shape, result, chat, stream.items, params)
        except GroupError as e:
            yield stream.failed(e.code, str(e)) if started else stream_error(e)
