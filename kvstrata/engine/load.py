"""`EngineLoad`: a snapshot of how busy one rank's engine is and how its L1 pages are
used (what /metrics, the loop's load reports and the router read)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of how busy the engine is and how its L1 pages are used."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_queued_tokens: int
    num_free_pages: int
    num_cached_pages: int
    num_total_pages: int
    num_locked_pages: int = 0  # cached pages pinned by running requests
    num_pd_rooms: int = 0  # decode: handoffs preallocated, in transfer or being released
    max_local_prefill_tokens: int = 0  # decode: uncached tokens it would prefill itself

    @property
    def num_used_pages(self) -> int:
        return self.num_total_pages - self.num_free_pages - self.num_cached_pages
