"""The prefill rank's PD endpoints: `POST /pd/prefill` runs a room and answers once the
decode rank's pages are written; `POST /pd/abort` promises a room will not be written
(any more): it answers once no write into it is in flight. Rank-to-rank only: not part
of the public API document."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvstrata.disagg.prefill import PrefillHandoff
from kvstrata.disagg.protocol import PrefillTask
from kvstrata.disagg.transport.base import TransferError
from kvstrata.server.engine_loop import EngineUnavailable, RequestRejected
from kvstrata.server.errors import CLIENT_GONE, error_response
from kvstrata.server.state import StateDep, final_outputs

router = APIRouter(include_in_schema=False)  # rank-to-rank endpoints, not a public API


@router.post("/pd/prefill")
async def pd_prefill(body: dict[str, Any], request: Request, state: StateDep) -> Any:
    try:
        task = PrefillTask.from_json(body)
    except TypeError as e:
        return error_response(400, f"not a prefill task: {e}")
    rooms = state.pd_rooms
    if task.room in rooms.aborted or task.room in rooms.active:
        return error_response(409, f"room {task.room} was aborted or is already running")
    rid = f"pf-{uuid.uuid4().hex}"
    try:
        group = state.engine_loop.submit_prefill(rid, task)
    except EngineUnavailable as e:
        return error_response(503, str(e))
    rooms.active[task.room] = group
    collected = False
    try:
        try:
            outs = await final_outputs(request, group)
        except (RequestRejected, EngineUnavailable) as e:
            return error_response(400 if isinstance(e, RequestRejected) else 503, str(e))
        except KeyError:  # /pd/abort closed the group before its final output
            outs = None
        if outs is None or task.room in rooms.aborted:
            rooms.tombstone(task.room)
            return Response(status_code=CLIENT_GONE)
        settled = await state.engine_loop.call(lambda engine: engine.handoff.settled(rid))
        await asyncio.wrap_future(settled)  # the write landed or failed (bounded)
        try:
            collected = True
            result = await state.engine_loop.call(lambda engine: engine.collect_prefill_result(rid))
        except TransferError as e:
            return error_response(502, f"room {task.room}: {e}")
    finally:
        rooms.active.pop(task.room, None)
        if not collected:  # nobody will collect the room's outcome: drop it
            with contextlib.suppress(EngineUnavailable):
                await state.engine_loop.call(lambda engine: engine.handoff.forget(rid))
    return JSONResponse(result.to_json())


@router.post("/pd/abort")
async def pd_abort(body: dict[str, Any], state: StateDep) -> Any:
    room = str(body.get("room", ""))
    rooms = state.pd_rooms
    rooms.tombstone(room)
    group = rooms.active.get(room)
    if group is not None:
        group.close()
    # Once the engine thread ran this, it has processed the abort above (a room's write
    # starts only on that thread); then wait out a write already in flight.
    settled = await state.engine_loop.call(
        lambda engine: (
            engine.handoff.write_settled(room)
            if isinstance(engine.handoff, PrefillHandoff)
            else None
        )
    )
    if settled is not None:
        await asyncio.wrap_future(settled)
    return {"room": room, "aborted": group is not None}
