"""Prometheus metrics of the router, in a registry of its own: requests per rank, routing
decisions per policy branch, estimated vs actual cached tokens, upstream errors, retries
by cause, requests that took ranks down, per-client refusals, circuit breaker states and
transitions, sessions kept and moved, and per-rank health, load and digest gauges
refreshed from the worker registry on scrape."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvstrata.router.breaker import BreakerState, CircuitBreakers, Transition
from kvstrata.router.workers import WorkerRegistry

_RANK_LABELS = ("role", "rank", "url")
logger = logging.getLogger("kvstrata.router")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvstrata_router_requests",
            "Requests forwarded, per rank (prefill: paired with).",
            _RANK_LABELS,
            registry=r,
        )
        self.decisions = Counter(
            "kvstrata_router_decisions",
            "Routing decisions per policy and branch.",
            ("role", "policy", "branch"),
            registry=r,
        )
        self.matched_tokens = Counter(
            "kvstrata_router_estimated_matched_tokens",
            "Prompt tokens the policy expected the chosen decode rank to hold.",
            registry=r,
        )
        self.usage_tokens = Counter(
            "kvstrata_router_usage_tokens",
            "Answered requests whose usage the router read, per decode rank: prompt tokens, "
            "tokens the policy expected cached (estimated) and cached per tier (l1, l2, l3).",
            (*_RANK_LABELS, "kind"),
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvstrata_router_upstream_errors",
            "Failed forwards and polls, per rank and kind.",
            (*_RANK_LABELS, "kind"),
            registry=r,
        )
        self.healthy = Gauge(
            "kvstrata_router_rank_healthy",
            "1 if the router sends the rank requests.",
            _RANK_LABELS,
            registry=r,
        )
        self.inflight = Gauge(
            "kvstrata_router_rank_inflight_requests",
            "Forwarded and not yet answered.",
            _RANK_LABELS,
            registry=r,
        )
        self.load = Gauge(
            "kvstrata_router_rank_load",
            "The rank's last polled /get_load values.",
            (*_RANK_LABELS, "field"),
            registry=r,
        )
        self.digest_entries = Gauge(
            "kvstrata_router_rank_digest_entries",
            "Prefix hashes in the router's digest copy.",
            _RANK_LABELS,
            registry=r,
        )
        self.retries = Counter(
            "kvstrata_router_retries",
            "Requests sent again after an attempt failed before "
            "any byte reached the client, by the failure's cause.",
            ("cause",),
            registry=r,
        )
        self.retries_exhausted = Counter(
            "kvstrata_router_retries_exhausted",
            "Requests whose last attempt failed with no retry left (attempts used up or no "
            "untried rank), by that attempt's cause.",
            ("cause",),
            registry=r,
        )
        self.breaker_state = Gauge(
            "kvstrata_router_rank_breaker_state",
            "1 for the state the rank's circuit breaker is in (closed, open, half_open).",
            (*_RANK_LABELS, "state"),
            registry=r,
        )
        self.breaker_transitions = Counter(
            "kvstrata_router_breaker_transitions",
            "Circuit breaker state changes per rank.",
            (*_RANK_LABELS, "from_state", "to_state"),
            registry=r,
        )
        self.poison = Counter(
            "kvstrata_router_poison_events",
            "Requests that took ranks down: engine_failed (an attempt ended in a rank's "
            "engine failure: not retried), died_holding (its rank died holding it: retried "
            "only if no rank died holding that body before), quarantined (a body's second "
            "such attempt: it stops and identical bodies are refused), refused (a request "
            "refused for quarantine, sent to no rank).",
            ("event",),
            registry=r,
        )
        self.client_limited = Counter(
            "kvstrata_router_client_inflight_refusals",
            "Requests refused with 429: their client had --max-inflight-per-client in flight.",
            registry=r,
        )
        self.session_routes = Counter(
            "kvstrata_router_session_routes",
            "Turns of agent sessions routed, by outcome: kept (on its home rank), parent (a "
            "sub-agent's first turn on its parent's home), moved (off the home, by reason in "
            "kvstrata_router_session_moves), new (no home known: the policy placed it).",
            ("outcome",),
            registry=r,
        )
        self.session_moves = Counter(
            "kvstrata_router_session_moves",
            "Sessions moved off their home rank, by reason: gone (left the registry), "
            "unhealthy (it may not take the request: unhealthy, breaker open, or it failed "
            "this request), overloaded (more than --dp-routing-max-extra-reqs requests beyond "
            "the least-loaded rank), cheaper (another rank's estimated TTFT beyond "
            "--session-move-margin), response (a Responses API follow-up goes where its "
            "previous response is stored).",
            ("reason",),
            registry=r,
        )
        self.sessions = Gauge(
            "kvstrata_router_sessions", "Agent sessions the router tracks.", registry=r
        )
        self._breakers: CircuitBreakers | None = None
        self.ttft_scale = Gauge(
            "kvstrata_router_rank_ttft_scale",
            "Observed / estimated TTFT of the rank (EWMA).",
            _RANK_LABELS,
            registry=r,
        )

    def watch_breakers(self, breakers: CircuitBreakers, workers: WorkerRegistry) -> None:
        """Count `breakers`' transitions and show their states on scrape."""
        self._breakers = breakers

        def count(transition: Transition) -> None:
            rank = next((r for r in workers.ranks if r.url == transition.url), None)
            labels = ("", "") if rank is None else (rank.role.value, str(rank.index))
            self.breaker_transitions.labels(
                *labels, transition.url, transition.old.value, transition.new.value
            ).inc()
            logger.warning(
                "%s: circuit breaker %s -> %s",
                transition.url,
                transition.old.value,
                transition.new.value,
            )

        breakers.on_transition = count

    def render(self, workers: WorkerRegistry) -> bytes:
        for rank in workers.ranks:
            labels = (rank.role.value, str(rank.index), rank.url)
            if self._breakers is not None:
                state = self._breakers.state(rank.url)
                for each in BreakerState:
                    self.breaker_state.labels(*labels, each.value).set(int(each is state))
            self.healthy.labels(*labels).set(int(rank.healthy))
            self.inflight.labels(*labels).set(rank.num_inflight)
            self.ttft_scale.labels(*labels).set(rank.ttft_scale)
            if rank.digest is not None:
                self.digest_entries.labels(*labels).set(len(rank.digest.entries))
            if rank.load is not None:
                for name, value in rank.load.to_json().items():
                    if name.startswith("num_") and isinstance(value, int):
                        self.load.labels(*labels, name).set(value)
        return generate_latest(self.registry)
