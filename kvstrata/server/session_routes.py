"""Agent sessions on a rank (kvcache/sessions.py): `GET /sessions/{id}` (its state and
context), `DELETE /sessions/{id}` (close it: its own pages stop being retained) and
`POST /sessions/{id}/prefetch` (move its context up to L1 before its next turn)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter

from kvstrata.engine.engine import Engine
from kvstrata.http.errors import ERROR_RESPONSES, OpenAIError
from kvstrata.server.state import StateDep
from kvstrata.session_ref import check_session_id

router = APIRouter()


@router.get("/sessions/{session_id}", responses=ERROR_RESPONSES)
async def get_session(session_id: str, state: StateDep) -> dict[str, Any]:
    _check(session_id)
    info = await state.engine_loop.call(lambda engine: engine.sessions.info(session_id))
    if info is None:
        raise _not_found(session_id)
    return {"object": "session", **dataclasses.asdict(info)}


@router.delete("/sessions/{session_id}", responses=ERROR_RESPONSES)
async def close_session(session_id: str, state: StateDep) -> dict[str, Any]:
    _check(session_id)
    if not await state.engine_loop.call(lambda engine: engine.sessions.close(session_id)):
        raise _not_found(session_id)
    return {"id": session_id, "object": "session", "closed": True}


@router.post("/sessions/{session_id}/prefetch", responses=ERROR_RESPONSES)
async def prefetch_session(session_id: str, state: StateDep) -> dict[str, Any]:
    _check(session_id)

    def start(engine: Engine) -> Any:
        return engine.session_prefetch.start(session_id)

    started = await state.engine_loop.call(start)
    if started is None:
        raise _not_found(session_id)
    return {"object": "session.prefetch", **dataclasses.asdict(started)}


def _check(session_id: str) -> None:
    try:
        check_session_id(session_id)
    except ValueError as e:
        raise OpenAIError(400, str(e), "session_id", "invalid_session") from None


def _not_found(session_id: str) -> OpenAIError:
    message = f"no session {session_id!r} on this rank (never seen, or forgotten)"
    return OpenAIError(404, message, "session_id", "session_not_found")
