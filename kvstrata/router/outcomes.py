"""`ForwardOutcomes`: what forwards tell the router about its ranks: requests, upstream
errors and cached tokens counted per rank, a rank whose forward failed taken out of
routing, observed TTFTs fed back to the estimate, and a body's strikes (poison.py)."""

from __future__ import annotations

import logging

from kvstrata.errors_text import describe_error
from kvstrata.router.attempt import Route
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.poison import (
    ENGINE_FAILURE,
    MAX_STRIKES,
    PoisonLedger,
    Strike,
    describe,
    quarantine_note,
)
from kvstrata.router.usage import CachedTokens
from kvstrata.router.workers import RankState, WorkerRegistry

logger = logging.getLogger("kvstrata.router")


class ForwardOutcomes:
    """The one way a forward's outcome reaches the metrics, the rank registry and the
    poison ledger; it holds no state of its own."""

    def __init__(
        self,
        workers: WorkerRegistry,
        metrics: RouterMetrics,
        poison: PoisonLedger,
        calibrate_ttft: bool,
    ) -> None:
        self.workers = workers
        self.metrics = metrics
        self.poison = poison
        self.calibrate_ttft = calibrate_ttft

    def strike(self, digest: bytes, rank: RankState, what: str) -> tuple[Strike, ...]:
        """An attempt of this body ended with its rank down: remember it (and count it)."""
        strikes = self.poison.strike(digest, rank.url, what)
        event = "engine_failed" if what == ENGINE_FAILURE else "died_holding"
        self.metrics.poison.labels(event).inc()
        if len(strikes) >= MAX_STRIKES:
            self.metrics.poison.labels("quarantined").inc()
            logger.warning(
                "a request body is quarantined for %.0f s: %s",
                self.poison.memory_s,
                describe(strikes),
            )
        return strikes

    def quarantined(self, strikes: tuple[Strike, ...]) -> str:
        return quarantine_note(strikes, self.poison.memory_s)

    def observe_ttft(self, route: Route, observed_s: float) -> None:
        estimated_s = route.decision.estimated_ttft_s
        if self.calibrate_ttft and estimated_s is not None:
            self.workers.observe_ttft(route.decode, estimated_s, observed_s)

    def count_usage(self, route: Route, usage: CachedTokens | None) -> None:
        """Estimated vs actual cached tokens, for answers whose usage the router saw."""
        if usage is None:
            return
        rank = route.decode
        labels = (rank.role.value, str(rank.index), rank.url)
        for kind, num_tokens in (
            ("prompt", usage.prompt_tokens),
            ("estimated", route.decision.matched_tokens),
            ("l1", usage.l1_tokens),
            ("l2", usage.l2_tokens),
            ("l3", usage.l3_tokens),
        ):
            self.metrics.usage_tokens.labels(*labels, kind).inc(num_tokens)

    def failed(self, rank: RankState, kind: str, error: Exception) -> None:
        """A forward to `rank` failed at the transport level: stop routing to it."""
        self.count_error(rank, kind)
        self.workers.on_forward_failed(rank, f"{kind}: {describe_error(error)}")

    def engine_failed(self, rank: RankState, where: str) -> None:
        """`rank` answered that its engine failed (`where`: how it said so): stop routing
        to it."""
        self.count_error(rank, "engine_failed")
        self.workers.on_forward_failed(rank, f"engine_failed: {where}")

    def count_request(self, route: Route) -> None:
        for rank in route.ranks:
            self.metrics.requests.labels(rank.role.value, str(rank.index), rank.url).inc()

    def count_error(self, rank: RankState, kind: str) -> None:
        labels = (rank.role.value, str(rank.index), rank.url, kind)
        self.metrics.upstream_errors.labels(*labels).inc()
