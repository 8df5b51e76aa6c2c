"""The prefill rank's PD endpoints: `POST /pd/prefill` runs a room and answers once the
decode rank's pages are written; `POST /pd/abort` promises a room will not be written
(any more): it answers once no write into it is in flight. Rank-to-rank only (the
cluster key, middleware.py), not in the public API document; bodies are checked against
disagg/wire.py and this rank's limits before anything reaches the engine."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Protocol, cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from kvstrata.core import GrammarKind, GrammarSpec
from kvstrata.disagg.protocol import PrefillTask
from kvstrata.disagg.transport.base import TransferError
from kvstrata.disagg.transport.endpoints import ShmEndpoint
from kvstrata.disagg.transport.ipc import check_shm_endpoint
from kvstrata.disagg.wire import IpcShmEndpoint, TaskLimits, TaskRefused, WireAbort, parse_task
from kvstrata.engine.grammar_compiler import GrammarError
from kvstrata.http.errors import (
    CLIENT_GONE,
    OpenAIError,
    error_response,
    status_error_response,
    validation_message,
)
from kvstrata.http.tracing import Tracer
from kvstrata.pd.prefill_rooms import PrefillActiveRoom, PrefillRoomTable
from kvstrata.pd.room_trace import PREFILL_REQUEST_SPAN, record_prefill
from kvstrata.runtime.request_group import (
    EngineUnavailable,
    GroupClosed,
    GroupError,
    final_outputs,
)

if TYPE_CHECKING:
    from kvstrata.engine.engine import Engine
    from kvstrata.http.inputs import RequestLimits
    from kvstrata.runtime.engine_loop import EngineLoop

router = APIRouter(include_in_schema=False)  # rank-to-rank endpoints, not a public API


class PrefillRankState(Protocol):
    """What these endpoints read of the rank they serve (its `ServerState`)."""

    @property
    def prefill_rooms(self) -> PrefillRoomTable: ...

    @property
    def engine_loop(self) -> EngineLoop: ...

    @property
    def limits(self) -> RequestLimits: ...

    @property
    def tracer(self) -> Tracer: ...


def prefill_rank_state(request: Request) -> PrefillRankState:
    """FastAPI dependency: the rank's state, as `build_app` attached it."""
    state: PrefillRankState = request.app.state.kvstrata
    return state


StateDep = Annotated[PrefillRankState, Depends(prefill_rank_state)]


@router.post("/pd/prefill")
async def pd_prefill(request: Request, state: StateDep) -> Any:
    try:
        task = await _checked_task(await request.body(), state)
    except ClientDisconnect:  # the decode rank gave the room up before it was sent whole
        return Response(status_code=CLIENT_GONE)
    except OpenAIError as e:
        return error_response(e.status_code, e.message, e.param, e.code)
    rooms = state.prefill_rooms
    if task.room in rooms.aborted or task.room in rooms.active:
        return error_response(409, f"room {task.room} was aborted or is already running")
    rid = f"pf-{uuid.uuid4().hex}"
    span = state.tracer.request_span(
        PREFILL_REQUEST_SPAN, request.headers, {"kvstrata.room": task.room}
    )
    submitted_s = time.monotonic()
    try:
        group = rooms.submit(rid, task)
    except EngineUnavailable as e:
        span.end()
        return error_response(503, str(e))
    rooms.active[task.room] = PrefillActiveRoom(rid, group)
    collected = False
    try:
        try:
            outs = await final_outputs(request, group)
        except GroupError as e:
            return status_error_response(e)
        except GroupClosed:  # /pd/abort closed the group before its final output
            outs = None
        if outs is None or task.room in rooms.aborted:
            rooms.tombstone(task.room)
            return Response(status_code=CLIENT_GONE)
        first_token_s = time.monotonic()
        await rooms.wait_settled(rid)  # the write landed or failed (bounded)
        try:
            collected = True
            result = await rooms.collect(rid)
        except TransferError as e:
            return error_response(502, f"room {task.room}: {e}")
        page_bytes = state.engine_loop.engine.pool.page_bytes  # fixed at start-up
        record_prefill(span, submitted_s, outs[0], first_token_s, result, page_bytes)
    finally:
        span.end()
        rooms.active.pop(task.room, None)
        if not collected:  # nobody will collect the room's outcome: drop it
            with contextlib.suppress(EngineUnavailable):
                await rooms.forget(rid)
    return JSONResponse(result.to_json())


@router.post("/pd/abort")
async def pd_abort(request: Request, state: StateDep) -> Any:
    try:
        room = WireAbort.model_validate_json(await request.body()).room
    except ClientDisconnect:
        return Response(status_code=CLIENT_GONE)
    except ValidationError as e:
        message, param = validation_message(list(e.errors()))
        return error_response(400, message, param, "invalid_value")
    rooms = state.prefill_rooms
    rooms.tombstone(room)
    active = rooms.active.get(room)
    if active is not None:
        active.group.close()
    await rooms.wait_write_settled(room)  # after the abort above: a write in flight ends
    return {"room": room, "aborted": active is not None}


async def _checked_task(body: bytes, state: PrefillRankState) -> PrefillTask:
    """The task in `body`, or OpenAIError(400) naming the field: schema, this rank's limits
    (vocabulary, context, page size, pool layout), then the transport endpoint itself."""
    engine = state.engine_loop.engine
    if state.prefill_rooms.role is None:
        raise OpenAIError(400, "this rank is not a prefill rank", code="not_a_prefill_rank")
    try:
        wire = parse_task(body)
        _task_limits(engine).check(wire)
    except ValidationError as e:
        message, param = validation_message(list(e.errors()))
        raise OpenAIError(400, message, param, "invalid_value") from None
    except TaskRefused as e:
        raise OpenAIError(400, f"invalid prefill task: {e}", e.param, "invalid_value") from None
    state.limits.check_prompt(wire.token_ids, "token_ids")  # the context length
    task = wire.to_task()
    grammar = wire.sampling.grammar
    if grammar is not None:  # compiled here, off the engine thread (its cache serves it)
        spec = GrammarSpec(GrammarKind(grammar.kind), grammar.source)
        try:
            await asyncio.to_thread(engine.sampler.grammars.compile, spec)
        except GrammarError as e:
            raise OpenAIError(
                400, f"invalid prefill task: {e}", "sampling", "invalid_grammar"
            ) from None
    endpoint = task.decode_endpoint
    if isinstance(wire.decode_endpoint, IpcShmEndpoint) and "shm_path" in endpoint:
        # Each decode worker's pool file (the sender checks it again when it maps it).
        pools = [endpoint, *cast(list[ShmEndpoint], endpoint.get("tp_slices", []))]
        try:
            for pool in pools:
                await asyncio.to_thread(check_shm_endpoint, pool)
        except TransferError as e:
            raise OpenAIError(400, str(e), "decode_endpoint", "invalid_endpoint") from None
    return task


def _task_limits(engine: Engine) -> TaskLimits:
    pool = engine.pool.data  # its shape and dtype never change
    return TaskLimits(
        vocab_size=engine.model_config.vocab_size,
        page_size=engine.config.pool.page_size,
        pool_shape=list(pool.shape),
        dtype=str(pool.dtype),
        kv_scales=engine.pool.scales.fingerprint,
        backend=engine.config.pd.transfer_backend,
        device_type=pool.device.type,
        tp_size=engine.config.model.tp_size,
    )
