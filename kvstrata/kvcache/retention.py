"""`Retention`: how long a request's cached pages should outlive it, as a hint the
`priority` eviction order reads (SGLang's `priority` / `retention_seconds` semantics): a
priority in [0, 99], evicted after every lower one, that falls to 0 once the pages went
`retention_s` without a hit (None: it holds while they are cached). Priority -1 is the
cache's own (`EVICT_FIRST`, never a request's): pages that go before any unhinted page."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

MAX_PRIORITY = 99
EVICT_FIRST_PRIORITY = -1


@dataclass(frozen=True)
class Retention:
    priority: int = 0
    retention_s: float | None = None

    def __post_init__(self) -> None:
        if not EVICT_FIRST_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [0, {MAX_PRIORITY}], got {self.priority}")
        if self.retention_s is not None and not self.retention_s > 0:
            raise ValueError(f"retention_s must be > 0 (or None), got {self.retention_s}")

    def effective_priority(self, idle_s: float) -> int:
        """The priority after `idle_s` without a hit."""
        if self.retention_s is not None and idle_s > self.retention_s:
            return min(self.priority, 0)
        return self.priority

    @property
    def is_kept(self) -> bool:
        """Whether the hint asks for more than plain recency (a positive priority)."""
        return self.priority > 0

    def stronger(self, other: Retention) -> Retention:
        """The one a page shared by both requests keeps: the higher priority; at equal
        priority the longer retention (None, for as long as cached, is the longest)."""
        if self.priority != other.priority:
            return self if self.priority > other.priority else other
        if self.retention_s is None or other.retention_s is None:
            return self if self.retention_s is None else other
        return self if self.retention_s >= other.retention_s else other


NO_RETENTION = Retention()


class HeldHint(NamedTuple):
    """The hint a cached page holds and when it was last hit (monotonic seconds, the
    cache's clock): what travels with a page demoted from L1 to L2."""

    retention: Retention
    last_access_s: float

    def effective_priority(self, now_s: float) -> int:
        return self.retention.effective_priority(now_s - self.last_access_s)


# A closed sub-agent's private pages (kvcache/sessions.py): first to go, in recency order.
EVICT_FIRST = Retention(EVICT_FIRST_PRIORITY)
