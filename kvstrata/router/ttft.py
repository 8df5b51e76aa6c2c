"""`ttft`: kvstrata's cost-model policy. Estimates each rank's time to first token from
its queue, its expected cached prefix per tier (L1 and L2 from its digest, then what its
L3 store holds beyond that, router/l3.py) and the per-token costs of computing,
transferring (unless the rank prefills the request itself) and loading KV, scaled by what
the router observed of that rank, charges leaving the rank that holds the longest prefix
for the future hits that prefix would lose, and picks the minimum."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstrata.router.cache_aware import CAPACITY_FALLBACK, MATCH, NO_MATCH
from kvstrata.router.policy import (
    Policy,
    RankView,
    RoutingDecision,
    RoutingRequest,
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


@dataclass(frozen=True)
class TtftCosts:
    """Seconds per prompt token for each way its KV can reach the decode rank."""

    prefill_s_per_token: float  # computed (prefill rank or the rank itself)
    # Moved from the prefill rank (0 for a unified rank); not paid by tokens the decode
    # rank prefills itself (local prefill).
    transfer_s_per_token: float
    l2_s_per_token: float  # loaded back from the host (L2)
    l3_s_per_token: float  # read from storage (L3): a shared store serves any rank

    @classmethod
    def from_config(cls, config: RouterConfig) -> TtftCosts:
        # Unified ranks (no prefill ranks) compute their prompts themselves: no transfer.
        disaggregated = bool(config.prefill)
        return cls(
            prefill_s_per_token=1.0 / config.ttft_prefill_tokens_per_s,
            transfer_s_per_token=1.0 / config.ttft_transfer_tokens_per_s if disaggregated else 0.0,
            l2_s_per_token=1.0 / config.ttft_l2_tokens_per_s,
            l3_s_per_token=1.0 / config.ttft_l3_tokens_per_s,
        )

    def compute_s(
        self,
        num_new_tokens: int,
        num_l2_tokens: int,
        num_l3_tokens: int = 0,
        transferred: bool = True,
    ) -> float:
        """The request's own share of its TTFT, queue aside. L1 hits are free; the new
        tokens cross the wire only if `transferred` (a prefill rank computes them)."""
        transfer_s_per_token = self.transfer_s_per_token if transferred else 0.0
        return (
            num_new_tokens * (self.prefill_s_per_token + transfer_s_per_token)
            + num_l2_tokens * self.l2_s_per_token
            + num_l3_tokens * self.l3_s_per_token
        )


# A rank's observed/estimated TTFT ratio counts only when it is off from the cluster's
# median by more than this: noise around a common speed must not steer requests.
SCALE_DEADBAND = 0.25


def l3_tokens_beyond(request: RoutingRequest, rank: RankView, estimate: PrefixEstimate) -> int:
    """Prompt tokens the rank would read from its L3 store after its L1/L2 match: the
    store's leading pages of the prompt (router/l3.py asked), less the last token (a
    rank always computes at least one).

        [0, matched) L1/L2 | [matched, l3_end) L3 | [l3_end, prompt) computed"""
    store = rank.l3_store
    if store is None or rank.digest is None:
        return 0
    num_pages = request.l3_pages.get(store, 0)
    l3_end = min(num_pages * rank.digest.page_size, request.num_prompt_tokens - 1)
    return max(0, l3_end - estimate.matched_tokens)


def estimate_ttft_s(
    rank: RankView,
    request: RoutingRequest,
    estimate: PrefixEstimate,
    costs: TtftCosts,
    scale: float = 1.0,
    num_l3_tokens: int = 0,
) -> float:
    """(queue wait + own work) x `scale` (the rank's relative speed). The queue is the
    larger of: the tokens the rank reported waiting plus the new tokens the router sent it
    since; and the new tokens of the router's requests there still before their first
    token (which covers a long prompt being computed), at the prefill rate. A rank that
    reported it would prefill the request's new tokens itself pays no transfer for them."""
    polled = rank.load.num_queued_tokens if rank.load is not None else 0
    num_queued_tokens = max(
        polled + rank.num_routed_new_tokens_since_poll, rank.num_unprefilled_tokens
    )
    queue_s = num_queued_tokens * costs.prefill_s_per_token
    num_new_tokens = request.num_prompt_tokens - estimate.matched_tokens - num_l3_tokens
    # The rank decides again on its own match (L3 included, which digests do not show):
    # usually at least the router's, so within the limit here means local there.
    max_local_tokens = rank.load.max_local_prefill_tokens if rank.load is not None else 0
    transferred = num_new_tokens > max_local_tokens
    own_s = costs.compute_s(num_new_tokens, estimate.l2_tokens, num_l3_tokens, transferred)
    return scale * (queue_s + own_s)


def rank_ttft_s(
    request: RoutingRequest,
    rank: RankView,
    estimate: PrefixEstimate,
    costs: TtftCosts,
    scale: float = 1.0,
) -> float:
    """`estimate_ttft_s` with what the rank's L3 store holds beyond `estimate` counted:
    a shared store's prefix is every reader's, so it tells ranks apart by cost only."""
    num_l3_tokens = l3_tokens_beyond(request, rank, estimate)
    return estimate_ttft_s(rank, request, estimate, costs, scale, num_l3_tokens)


def relative_scales(ranks: Sequence[RankView]) -> dict[int, float]:
    """Each rank's observed/estimated TTFT ratio over the median of `ranks`, or 1 when
    within SCALE_DEADBAND of it."""
    median = statistics.median(r.ttft_scale for r in ranks)
    scales = {}
    for rank in ranks:
        relative = rank.ttft_scale / median
        scales[rank.index] = relative if abs(relative - 1) > SCALE_DEADBAND else 1.0
    return scales


class Ttft(Policy):
    """Each healthy rank's score is its estimated TTFT plus, for leaving the rank with the
    longest expected prefix, `reuse_weight` x the prefill time of the prefix tokens it
    gives up: the later requests sharing that prefix would miss where this one goes, and
    its copy would crowd the other rank's cache. Only a match of at least
    `cache_threshold` x the prompt, and only beyond the part every rank holds, counts,
    in the estimate and as given up (a shared system prompt is not worth a queue). The
    least score among ranks with KV room for the request wins (all ranks if none has
    room); ties go to the longer such match, then the least loaded, then the emptiest
    cache. Branches: `match` / `no_match` (whether the pick expects a hit),
    `capacity_fallback` (the least score overall lacked room)."""

    name = "ttft"
    needs_tokens = True
    uses_digests = True
    uses_l3 = True

    def __init__(self, costs: TtftCosts, reuse_weight: float, cache_threshold: float = 0.0) -> None:
        self.costs = costs
        self.reuse_weight = reuse_weight
        self.cache_threshold = cache_threshold

    @classmethod
    def from_config(cls, config: RouterConfig) -> Ttft:
        return cls(
            TtftCosts.from_config(config),
            config.ttft_reuse_weight,
            config.dp_routing_cache_threshold,
        )

    def choose(self, request: RoutingRequest, ranks: Sequence[RankView]) -> RoutingDecision:
        healthy = healthy_ranks(ranks)
        estimates = {rank.index: estimate_prefix(request, rank) for rank in healthy}
        own_tokens = distinguishing_tokens(request, estimates, self.cache_threshold)
        # Ranks are compared on what tells them apart: a match below the threshold counts
        # as the common part only, so a rank holding just a shared system prompt does not
        # draw every new conversation while the others stay empty.
        common = min(e.matched_tokens for e in estimates.values())
        counted = {i: e.cut(common + own_tokens[i]) for i, e in estimates.items()}
        scales = relative_scales(healthy)

        def ttft_s(rank: RankView, estimate: PrefixEstimate) -> float:
            return rank_ttft_s(request, rank, estimate, self.costs, scales[rank.index])

        score = self._scores({r.index: ttft_s(r, counted[r.index]) for r in healthy}, own_tokens)

        def cheapest(candidates: Sequence[RankView]) -> RankView:
            return min(
                candidates, key=lambda r: (score[r.index], -own_tokens[r.index], r.spread_key)
            )

        best = cheapest(healthy)
        branch = MATCH if own_tokens[best.index] else NO_MATCH
        if not has_room(best, request, estimates[best.index]):
            roomy = [r for r in healthy if has_room(r, request, estimates[r.index])]
            if roomy:
                best, branch = cheapest(roomy), CAPACITY_FALLBACK
        return self.decide(
            best,
            branch,
            matched_tokens=estimates[best.index].matched_tokens,
            estimated_ttft_s=ttft_s(best, estimates[best.index]),
        )

    def _scores(
        self, ttft_s: Mapping[int, float], own_tokens: Mapping[int, int]
    ) -> dict[int, float]:
        longest = max(own_tokens.values())
        lost_s_per_token = self.reuse_weight * self.costs.prefill_s_per_token
        return {
            index: ttft_s[index] + (longest - own_tokens[index]) * lost_s_per_token
            for index in ttft_s
        }
