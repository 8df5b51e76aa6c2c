"""`Retention`: how long a request's cached pages should outlive it, as a hint the
`priority` eviction order reads (SGLang's `priority` / `retention_seconds` semantics): a
priority in [0, 99], evicted after every lower one, that falls to 0 once the pages went
`retention_s` without a hit (None: it holds while they are cached)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PRIORITY = 99


@dataclass(frozen=True)
class Retention:
    priority: int = 0
    retention_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [0, {MAX_PRIORITY}], got {self.priority}")
        if self.retention_s is not None and not self.retention_s > 0:
            raise ValueError(f"retention_s must be > 0 (or None), got {self.retention_s}")

    def effective_priority(self, idle_s: float) -> int:
        """The priority after `idle_s` without a hit."""
        if self.retention_s is not None and idle_s > self.retention_s:
            return 0
        return self.priority

    def stronger(self, other: Retention) -> Retention:
        """The one a page shared by both requests keeps: the higher priority; at equal
        priority the longer retention (None, for as long as cached, is the longest)."""
        if self.priority != other.priority:
            return self if self.priority > other.priority else other
        if self.retention_s is None or other.retention_s is None:
            return self if self.retention_s is None else other
        return self if self.retention_s >= other.retention_s else other


NO_RETENTION = Retention()
