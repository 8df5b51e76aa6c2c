"""The invariants of one rank: the engine's (engine/invariants.py, checked on the engine
thread) plus the event loop's PD tables, served as GET /debug/invariants; `InvariantWatch`
keeps the last report, which /metrics shows as gauges."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvstrata.engine import invariants as engine_invariants
from kvstrata.engine.invariants import InvariantReport, check_engine

if TYPE_CHECKING:
    from kvstrata.server.state import ServerState

# The rank's counts that are zero when nothing is in flight: the engine's and the PD
# tables the event loop keeps (`PrefillRoomTable.counts`, `DecodeRoomSender.counts`).
IN_FLIGHT = (
    *engine_invariants.IN_FLIGHT,
    "prefill_rooms_http",
    "dispatcher_targets",
    "dispatcher_active",
)


async def rank_invariants(state: ServerState) -> InvariantReport:
    """The engine's invariants (on the engine thread) plus the event loop's PD tables."""
    report = await state.engine_loop.call(check_engine)
    report.in_flight = IN_FLIGHT
    report.counts.update(state.prefill_rooms.counts)
    if state.decode_sender is not None:
        report.counts.update(state.decode_sender.counts)
    return report


class InvariantWatch:
    """Owns the last report of the rank's invariants and when it was made. /metrics shows
    it, checking again only once it is `interval_s` old: the full check walks every page
    and lock on the engine thread, which a scrape every few seconds would stall for
    ~0.1 s each at large pools. /debug/invariants always checks (and refreshes it)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.num_checks = 0
        self._report: InvariantReport | None = None
        self._checked_s = 0.0

    async def check(self, state: ServerState) -> InvariantReport:
        report = await rank_invariants(state)
        self._report, self._checked_s = report, time.monotonic()
        self.num_checks += 1
        return report

    async def for_metrics(self, state: ServerState) -> InvariantReport:
        fresh = time.monotonic() - self._checked_s < self.interval_s
        if self._report is not None and fresh:
            return self._report
        return await self.check(state)
