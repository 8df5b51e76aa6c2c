"""Which route a request's next attempt takes: the policies choose among the ranks it may go
to (healthy, breaker closed or probing, not tried where another is left), unless the
session step (session_routing.py) keeps a session's turn on its home; in a PD cluster
with no prefill rank to take it, the decode rank computes the prompt itself; and the 503
when nothing is left names every rank and why it was not used."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from kvstrata.http.errors import OpenAIError
from kvstrata.router.attempt import Route
from kvstrata.router.breaker import CircuitBreakers
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.policy import (
    NoRankAvailable,
    Policy,
    RankView,
    RoutingDecision,
    RoutingRequest,
)
from kvstrata.router.retry import Attempts
from kvstrata.router.session_routing import SessionAffinity
from kvstrata.router.workers import RankState, Role, WorkerRegistry

Urls = AbstractSet[str]
# The prefill "decision" of a PD route without a prefill rank (a metrics label).
LOCAL_PREFILL = "local_prefill"
logger = logging.getLogger("kvstrata.router")


class RouteChooser:
    """Routes over the registry's ranks, as the policies and the breakers allow."""

    def __init__(
        self,
        workers: WorkerRegistry,
        metrics: RouterMetrics,
        policy: Policy,
        prefill_policy: Policy,
        breakers: CircuitBreakers,
        sessions: SessionAffinity | None = None,
    ) -> None:
        """`sessions` None: no session step (turns are placed by the policy alone)."""
        self.workers = workers
        self.metrics = metrics
        self.policy = policy
        self.prefill_policy = prefill_policy
        self.breakers = breakers
        self.sessions = sessions if sessions is not None else SessionAffinity(metrics, None)
        self._prefilling_locally = False  # the last PD route had no prefill rank (logged)

    def route(self, request: RoutingRequest, attempts: Attempts | None = None) -> Route:
        """The best route that avoids ranks whose breaker is open and, where another is
        left, the ranks of the request's failed attempts (a decode rank's failure need not
        be its own: in a PD cluster it may answer for its prefill rank), never a route
        tried before. In a PD cluster where no prefill rank may take the request, the route
        has none: the decode rank prefills it itself. Raises OpenAIError(503) when no
        decode rank is left, or every route was tried."""
        tried = frozenset() if attempts is None else attempts.tried_urls
        avoid = self._avoid(Role.DECODE, tried) if self.workers.is_disaggregated else tried
        views = self._views(Role.DECODE, avoid)

        def pick(shown: Sequence[RankView]) -> RoutingDecision:
            return self._choose(Role.DECODE, self.policy, request, avoid, shown)

        decision = self.sessions.route(request, views, pick, self._home(request, avoid))
        decode = self.workers.decode[decision.index]
        prefill = self._prefill_rank(request, tried) if self.workers.is_disaggregated else None
        if attempts is not None and (decode.url, _url(prefill)) in attempts.tried_routes:
            raise OpenAIError(
                503,
                "every route of this request failed: " + "; ".join(attempts.failures),
                code="no_healthy_rank",
            )
        self.metrics.matched_tokens.inc(decision.matched_tokens)
        return Route(decode, prefill, decision)

    def _prefill_rank(self, request: RoutingRequest, tried: Urls) -> RankState | None:
        """The prefill rank of a PD route; None when none may take the request (none is
        healthy, registered or has its breaker closed): the decode rank computes the prompt
        then, which is slower than a transfer but not a failed request. (A route that
        answered 502/503 says nothing sure of its prefill rank: its decode rank may be at
        fault. A prefill rank failing its rooms while it answers polls is taken out by its
        breaker, and then routes go without one.)"""
        avoid = self._avoid(Role.PREFILL, tried)
        views = self._views(Role.PREFILL, avoid)
        try:
            decision = self._choose(Role.PREFILL, self.prefill_policy, request, avoid, views)
        except OpenAIError as e:
            labels = (Role.PREFILL.value, LOCAL_PREFILL, "no_prefill_rank")
            self.metrics.decisions.labels(*labels).inc()
            if not self._prefilling_locally:
                logger.warning("%s: decode ranks prefill requests locally", e.message)
            self._prefilling_locally = True
            return None
        if self._prefilling_locally:
            logger.info("a prefill rank takes requests again")
        self._prefilling_locally = False
        return self.workers.prefill[decision.index]

    def _home(self, request: RoutingRequest, avoid: Urls) -> RoutingDecision | None:
        """The decode rank holding the conversation the request continues, if it may take
        it (else the policy chooses, and that rank answers that it holds none)."""
        for index, rank in enumerate(self.workers.decode):
            if rank.url == request.home_url and self.may_send(rank, avoid):
                self.metrics.decisions.labels(Role.DECODE.value, "home", "home").inc()
                return RoutingDecision(index, rank.url, "home", policy="home")
        return None

    def _avoid(self, role: Role, tried: Urls) -> Urls:
        """`tried`, unless no rank of `role` would be left: then none."""
        if any(self.may_send(rank, tried) for rank in self.workers.of(role)):
            return tried
        return frozenset()

    def may_send(self, rank: RankState, avoid: Urls) -> bool:
        return rank.healthy and rank.url not in avoid and self.breakers.allows(rank.url)

    def _views(self, role: Role, avoid: Urls) -> list[RankView]:
        """The ranks of `role` as policies see them: one the request may not go to is
        shown as unhealthy, which every policy skips; the indices stay the registry's."""
        return [
            view if self.may_send(rank, avoid) else dataclasses.replace(view, healthy=False)
            for rank, view in zip(self.workers.of(role), self.workers.views(role))
        ]

    def _choose(
        self,
        role: Role,
        policy: Policy,
        request: RoutingRequest,
        avoid: Urls,
        views: Sequence[RankView],
    ) -> RoutingDecision:
        try:
            decision = policy.choose(request, views)
        except NoRankAvailable:
            raise OpenAIError(
                503, self.no_rank_reason(role, avoid), code="no_healthy_rank"
            ) from None
        label = decision.policy or policy.name
        self.metrics.decisions.labels(role.value, label, decision.branch).inc()
        return decision

    def no_rank_reason(self, role: Role, avoid: Urls) -> str:
        """Why no rank of `role` may take a request: each rank and its reason."""
        ranks = self.workers.of(role)
        if not ranks:
            return f"no {role.value} rank is registered"
        reasons = "; ".join(f"{rank.url}: {self._why_not(rank, avoid)}" for rank in ranks)
        return f"no healthy {role.value} rank ({reasons})"

    def _why_not(self, rank: RankState, avoid: Urls) -> str:
        if rank.url in avoid:
            return f"failed this request ({rank.last_error or 'answered an error'})"
        if rank.healthy and not self.breakers.allows(rank.url):
            return f"circuit breaker {self.breakers.state(rank.url).value}"
        if rank.healthy:
            return "healthy, but the policy took none"  # never: policies take any healthy rank
        return f"unhealthy: {rank.last_error or 'it has not answered a poll yet'}"


def _url(rank: RankState | None) -> str | None:
    return None if rank is None else rank.url
