"""The HiRadixCache policies: when an L1 page is copied to L2 (`WritePolicy`) and how long
admission waits for an L3 prefetch (`PrefetchPolicy`)."""

from __future__ import annotations

from dataclasses import dataclass

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class WritePolicy:
    """When an L1 page is copied to L2: on insert, on its second hit, or on eviction."""

    on_insert: bool
    min_hits: int  # back up a matched page once it has this many hits (0: never)
    on_evict: bool

    @staticmethod
    def named(name: str) -> WritePolicy:
        return {
            "write_through": WritePolicy(on_insert=True, min_hits=0, on_evict=False),
            "write_through_selective": WritePolicy(on_insert=False, min_hits=2, on_evict=False),
            "write_back": WritePolicy(on_insert=False, min_hits=0, on_evict=True),
        }[name]


@dataclass(frozen=True)
class PrefetchPolicy:
    """How long admission waits for an L3 prefetch: not at all (best_effort), until it
    completes (wait_complete), or until `base_s + per_1k_tokens_s * tokens / 1000`."""

    name: str
    timeout_base_s: float
    timeout_per_1k_tokens_s: float
    threshold_tokens: int  # prefetch only when at least this many tokens could come
