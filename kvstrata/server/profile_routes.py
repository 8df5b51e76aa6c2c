"""`POST /start_profile` and `POST /stop_profile` (SGLang's and vLLM's names): a torch
profiler trace of this rank's engine steps, written under `--profile-dir` only."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from kvstrata.engine.step_profiler import (
    MAX_PROFILE_STEPS,
    ProfileStarted,
    ProfileStateError,
    ProfileStopped,
    StepProfiler,
)
from kvstrata.http.errors import OpenAIError
from kvstrata.server.state import ServerState, StateDep

router = APIRouter()


class StartProfileRequest(BaseModel):
    """No output path: a trace goes under --profile-dir, never where a caller says."""

    model_config = ConfigDict(extra="forbid", strict=True)

    num_steps: int | None = Field(default=None, ge=1, le=MAX_PROFILE_STEPS)


def _profiler(state: ServerState) -> StepProfiler:
    if state.profiler is None:
        raise OpenAIError(400, "profiling is off on this rank: start it with --profile-dir DIR")
    return state.profiler


@router.post("/start_profile")
async def start_profile(state: StateDep, body: StartProfileRequest | None = None) -> ProfileStarted:
    profiler = _profiler(state)
    num_steps = body.num_steps if body is not None else None
    loop = state.engine_loop
    try:
        return await loop.run(profiler.start, loop.engine, num_steps)
    except ProfileStateError as e:
        raise OpenAIError(409, str(e), code="profile_running") from e


@router.post("/stop_profile")
async def stop_profile(state: StateDep) -> ProfileStopped:
    """Stops the running profile (or names the one its step budget stopped) and answers
    once its trace is written."""
    profiler = _profiler(state)
    loop = state.engine_loop
    try:
        stopped = await loop.run(profiler.stop, loop.engine)
    except ProfileStateError as e:
        raise OpenAIError(400, str(e), code="no_profile") from e
    writer = profiler.writer
    if writer is not None:
        await asyncio.to_thread(writer.join)
    return stopped
