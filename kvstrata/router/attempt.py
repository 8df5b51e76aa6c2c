"""One try of a forwarded request: its `Route` (the decode rank, and the prefill rank in a
PD cluster), its `Lease` on the ranks' in-flight counts, and the breaker tickets whose
verdict it gives, each released exactly once however the try ends."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.router.breaker import CircuitBreakers
from kvstrata.router.policy import RoutingDecision, RoutingRequest
from kvstrata.router.prefix import first_chunk_page_hashes, routed_boundary_hashes
from kvstrata.router.workers import RankState, RoutedRequest, WorkerRegistry


@dataclass(frozen=True)
class Route:
    """Where one request goes: the decode rank that answers it and the prefill rank that
    computes its prompt (None: the decode rank is a unified rank)."""

    decode: RankState
    prefill: RankState | None
    decision: RoutingDecision

    @property
    def ranks(self) -> list[RankState]:
        return [self.decode] if self.prefill is None else [self.decode, self.prefill]


class Lease:
    """One forwarded request's place in the ranks' in-flight and routed counts (and its
    prefix in the decode rank's routed prefixes); released once."""

    def __init__(self, workers: WorkerRegistry, route: Route, request: RoutingRequest) -> None:
        self._workers = workers
        self._held: list[tuple[RankState, RoutedRequest]] = []
        num_tokens = request.num_prompt_tokens
        decode_view = route.decode.view()
        hashes = routed_boundary_hashes(request, decode_view)
        pages = first_chunk_page_hashes(request, decode_view)
        num_new = num_tokens - route.decision.matched_tokens
        routed = workers.begin_request(route.decode, num_tokens, hashes, num_new, pages)
        self._held.append((route.decode, routed))
        if route.prefill is not None:
            self._held.append((route.prefill, workers.begin_request(route.prefill, num_tokens)))

    def first_token(self) -> None:
        if self._held:
            rank, routed = self._held[0]  # the decode rank
            self._workers.first_token(rank, routed)

    def release(self) -> None:
        for rank, routed in self._held:
            self._workers.end_request(rank, routed)
        self._held = []


class Attempt:
    """One try of a request on one route: its lease and one breaker ticket per rank. The
    tickets get exactly one verdict (success, failure or none) however the try ends."""

    def __init__(
        self,
        workers: WorkerRegistry,
        breakers: CircuitBreakers,
        route: Route,
        routing: RoutingRequest,
    ) -> None:
        self.route = route
        self.lease = Lease(workers, route, routing)
        self._breakers = breakers
        self._tickets = [breakers.on_sent(rank.url) for rank in route.ranks]

    def succeeded(self) -> None:
        for ticket in self._tickets:
            self._breakers.on_success(ticket)
        self._tickets = []

    def failed(self, decode_only: bool = False) -> None:
        """The route failed the request and the lease ends. `decode_only`: the decode
        rank's connection broke, which says nothing of the prefill rank; a 502/503 counts
        against both (the decode rank may be answering for its prefill rank)."""
        for ticket in self._tickets[: 1 if decode_only else None]:
            self._breakers.on_failure(ticket)
        self._tickets = self._tickets[1:] if decode_only else []
        self.abandoned()

    def abandoned(self) -> None:
        """No verdict (the client left, the handler was cancelled); the lease ends."""
        for ticket in self._tickets:
            self._breakers.on_abandoned(ticket)
        self._tickets = []
        self.lease.release()
