"""The commands the event loop sends a rank's engine thread (`EngineLoop`), one frozen
record each; the engine thread handles them in the order they were queued."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstrata.core import SamplingParams
from kvstrata.disagg.protocol import PrefillTask
from kvstrata.runtime.request_group import RequestGroup

if TYPE_CHECKING:
    from kvstrata.engine.load import EngineLoad


@dataclass(frozen=True)
class Add:
    group: RequestGroup
    prompts: list[list[int]]
    params: SamplingParams
    # Runs on the engine thread with the group's rids once they are in, before any step.
    then: Callable[[list[str]], None] | None = None


@dataclass(frozen=True)
class Abort:
    rids: list[str]


@dataclass(frozen=True)
class AbortAll:
    pass


@dataclass(frozen=True)
class Flush:
    wait: bool
    reply: concurrent.futures.Future[bool]


@dataclass(frozen=True)
class Load:
    reply: concurrent.futures.Future[EngineLoad]


@dataclass(frozen=True)
class Stop:
    reply: concurrent.futures.Future[None]


@dataclass(frozen=True)
class AddPrefill:
    group: RequestGroup
    task: PrefillTask
    add: Callable[[PrefillTask, str], object]  # the prefill role's `add_prefill_task`


@dataclass(frozen=True)
class Call:
    fn: Callable[[], Any]  # runs on the engine thread
    reply: concurrent.futures.Future[Any]


@dataclass(frozen=True)
class Fail:
    """The engine can no longer run (a tensor-parallel worker exited): the engine thread
    raises `error`, failing the engine as a step that raised would."""

    error: Exception


Command = Add | Abort | AbortAll | Flush | Load | Stop | AddPrefill | Call | Fail
