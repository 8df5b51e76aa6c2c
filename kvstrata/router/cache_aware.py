"""`cache_aware` (DESIGN section 7, the reference design's policy): the longest digest
match, overridden by load and by KV capacity; and `auto`, which routes cache-aware when
several decode ranks keep a cache, round robin otherwise."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstrata.router.policy import (
    Policy,
    RankView,
    RoundRobin,
    RoutingDecision,
    RoutingRequest,
    emptiest,
    healthy_ranks,
)
from kvstrata.router.prefix import (
    PrefixEstimate,
    distinguishing_tokens,
    estimate_prefix,
    has_room,
)

if TYPE_CHECKING:
    from kvstrata.config import RouterConfig

MATCH, OVERRIDE, CAPACITY_FALLBACK, NO_MATCH = "match", "override", "capacity_fallback", "no_match"


class CacheAware(Policy):
    """1. Each healthy rank's match: the deepest chunk boundary of the request in its
          digest (or among the prefixes routed to it since its last poll), less the part
          every healthy rank holds (a shared system prompt tells ranks apart no more
          than nothing does); a match below `cache_threshold` x the prompt counts as
          none.
    2. No such match anywhere: the least-loaded rank, ties to the one caching least
       (`no_match`), so new prefixes spread over every rank.
    3. Else the longest match, ties to the least loaded (`match`), unless it has more
       than `max_extra_reqs` queued requests beyond the least-loaded rank: then that
       rank (`override`).
    4. If the chosen rank lacks free KV pages for the unmatched tokens, the longest match
       among ranks that have room, ties to the least loaded (`capacity_fallback`); if
       none has room, the choice stands.
    Load is the estimated queued requests (polled + routed since), then tokens."""

    name = "cache_aware"
    needs_tokens = True
    uses_digests = True

    def __init__(self, max_extra_reqs: int, cache_threshold: float = 0.0) -> None:
        self.max_extra_reqs = max_extra_reqs
        self.cache_threshold = cache_threshold

    @classmethod
    def from_config(cls, config: RouterConfig) -> CacheAware:
        return cls(config.dp_routing_max_extra_reqs, config.dp_routing_cache_threshold)

    def choose(self, request: RoutingRequest, ranks: Sequence[RankView]) -> RoutingDecision:
        healthy = healthy_ranks(ranks)
        estimates = {rank.index: estimate_prefix(request, rank) for rank in healthy}
        own_tokens = distinguishing_tokens(request, estimates, self.cache_threshold)

        def best_match(candidates: Sequence[RankView]) -> RankView:
            return min(candidates, key=lambda r: (-own_tokens[r.index], r.spread_key))

        least = emptiest(healthy)
        best = best_match(healthy)
        if own_tokens[best.index] == 0:
            chosen, branch = least, NO_MATCH
        elif best.estimated_queued_reqs - least.estimated_queued_reqs > self.max_extra_reqs:
            chosen, branch = least, OVERRIDE
        else:
            chosen, branch = best, MATCH
        if not has_room(chosen, request, estimates[chosen.index]):
            roomy = [r for r in healthy if has_room(r, request, estimates[r.index])]
            if roomy:
                chosen, branch = best_match(roomy), CAPACITY_FALLBACK
        return self._decide(chosen, branch, estimates[chosen.index])

    def _decide(self, rank: RankView, branch: str, estimate: PrefixEstimate) -> RoutingDecision:
        return self.decide(rank, branch, matched_tokens=estimate.matched_tokens)


class Auto(Policy):
    """`cache_aware` when there is more than one rank and a healthy one serves a digest
    (it keeps a prefix cache); otherwise `round_robin`. Decided per request, so ranks
    that come up later or restart with other settings are followed."""

    name = "auto"
    uses_digests = True

    def __init__(self, cache_aware: CacheAware, needs_tokens: bool) -> None:
        self.cache_aware = cache_aware
        self.round_robin = RoundRobin()
        self.needs_tokens = needs_tokens

    @classmethod
    def from_config(cls, config: RouterConfig) -> Auto:
        # Tokenize only if the router has the model; requests carrying token ids are
        # matched either way, and the rest go least-loaded.
        return cls(CacheAware.from_config(config), needs_tokens=bool(config.model))

    def choose(self, request: RoutingRequest, ranks: Sequence[RankView]) -> RoutingDecision:
        caching = any(r.healthy and r.digest is not None for r in ranks)
        if len(ranks) > 1 and caching:
            return self.cache_aware.choose(request, ranks)
        return self.round_robin.choose(request, ranks)
