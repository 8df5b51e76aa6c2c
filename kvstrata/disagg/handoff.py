"""How an engine's requests enter and leave it in each `--disaggregation-mode`: `null`
(unified: straight to the scheduler), `prefill` (PrefillHandoff) and `decode`
(DecodeHandoff). The engine calls these hooks and never branches on the mode itself."""

from __future__ import annotations

from typing import Protocol

from kvstrata.core import Batch, FinishReason, Request
from kvstrata.engine.scheduler import Scheduler


class Handoff(Protocol):
    @property
    def num_unfinished(self) -> int:
        """Requests held here, outside the scheduler."""
        ...

    def add(self, req: Request) -> None:
        """Take a new request."""
        ...

    def before_step(self) -> None:
        """Run once per engine step, before scheduling."""
        ...

    def before_release(self, req: Request, reason: FinishReason) -> bool:
        """A scheduler-held request finished (for `reason`) and still holds its pages.
        True: the handoff keeps them and releases them itself later (its `num_unfinished`
        counts the request meanwhile)."""
        ...

    def holds(self, req: Request) -> bool: ...

    def drop(self, req: Request) -> None:
        """Release a request this handoff holds (abort or failure)."""
        ...

    def close(self) -> None:
        """Release transport resources at shutdown."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counters for /metrics (name -> value), e.g. bytes sent by PD transfer."""
        ...

    def take_expired(self) -> list[Request]:
        """Held requests that waited too long to be let in; the engine fails them."""
        ...

    def observe_step(self, batch: Batch, step_s: float) -> None:
        """`batch` ran in `step_s` seconds, measured up to its sampled tokens on the host."""
        ...

    @property
    def max_local_prefill_tokens(self) -> int:
        """Decode: the most uncached prompt tokens this rank would now compute itself
        instead of asking a prefill rank (0 elsewhere)."""
        ...


class SchedulerEntry:
    """Requests go straight to the scheduler; nothing is held outside it. The unified
    mode's handoff, and the entry half of the prefill mode's."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    @property
    def num_unfinished(self) -> int:
        return 0

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def before_step(self) -> None:
        pass

    def before_release(self, req: Request, reason: FinishReason) -> bool:
        return False

    def holds(self, req: Request) -> bool:
        return False

    def drop(self, req: Request) -> None:
        raise RuntimeError(f"request {req.rid} is not held outside the scheduler")

    def close(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def take_expired(self) -> list[Request]:
        return []

    def observe_step(self, batch: Batch, step_s: float) -> None:
        pass

    @property
    def max_local_prefill_tokens(self) -> int:
        return 0
