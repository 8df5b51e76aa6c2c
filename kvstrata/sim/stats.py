"""The nearest-rank percentile both simulator reports (routing and agentic) summarize
their samples with."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))
    return ordered[int(rank) - 1]
