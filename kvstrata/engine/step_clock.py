"""`StepClock`: the host seconds an engine's steps spend by part (the cache tiers' poll,
the role's work before the batch: PD rooms and local prefill, the stepper: schedule, run,
commit), summed for /metrics, so that a slow decode step can be traced to its part."""

from __future__ import annotations

import time


class StepClock:
    PARTS = ("tiers", "role", "stepper")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self._mark_s = 0.0

    def start(self) -> None:
        self._mark_s = time.perf_counter()

    def lap(self, part: str) -> None:
        """Add the time since the last mark to `part`."""
        now_s = time.perf_counter()
        self.seconds[part] += now_s - self._mark_s
        self._mark_s = now_s

    def metrics(self) -> dict[str, float]:
        return {f"step_seconds_{part}": s for part, s in self.seconds.items()}
