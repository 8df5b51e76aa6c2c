"""`EventQueue`: the discrete-event loop both simulators run (routing over a trace,
sessions over an agentic workload): handlers at virtual times, in time order (ties in
the order they were scheduled), with the shared `SimClock` set to each one's time."""

from __future__ import annotations

import gc
import heapq
import itertools
from collections.abc import Callable
from typing import Any

from kvstrata.sim.cache import SimClock


class EventQueue:
    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def at(self, time_s: float, handler: Callable[..., None], *args: Any) -> None:
        """Call `handler(time_s, *args)` at virtual time `time_s`."""
        heapq.heappush(self._events, (time_s, next(self._seq), handler, args))

    def run(self) -> None:
        """Until no event is left. The caches hold millions of small objects and make no
        garbage cycles worth chasing mid-run: the cyclic collector would spend most of the
        run re-scanning them, so it is off meanwhile."""
        gc.disable()
        try:
            while self._events:
                now, _, handler, args = heapq.heappop(self._events)
                self.clock.now_s = now
                handler(now, *args)
        finally:
            gc.enable()
