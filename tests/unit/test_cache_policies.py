"""cache_aware, ttft and auto, exactly: every branch of cache_aware (match, override,
capacity fallback, no match, unhealthy rank), ttft against hand-computed estimates, the
router's memory of prefixes routed since the last poll, TTFT calibration, usage parsing."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvstrata.config import RouterConfig
from kvstrata.kvcache.digest_wire import TIER_L1, TIER_L2, DigestDelta, DigestReplica
from kvstrata.kvcache.hashing import page_hashes
from kvstrata.router.cache_aware import Auto, CacheAware
from kvstrata.router.policies import make_policy
from kvstrata.router.policy import RankLoad, RankView, RoutingRequest
from kvstrata.router.prefix import estimate_prefix
from kvstrata.router.ttft import Ttft, TtftCosts
from kvstrata.router.usage import SseUsage, usage_of
from kvstrata.router.workers import Role, WorkerRegistry

SEED = bytes(32)
PAGE, CHUNK = 4, 8
URLS = tuple(f"http://127.0.0.1:{3001 + i}" for i in range(3))
PROMPT = list(range(1, 33))  # 32 tokens: boundaries after 8, 16, 24 and 32
BOUNDARIES = page_hashes(PROMPT, PAGE, SEED)[1::2]


def replica(num_chunks: int = 0, num_l1_chunks: int | None = None) -> DigestReplica:
    """A digest holding the first `num_chunks` chunks of PROMPT (the first
    `num_l1_chunks` of them in L1, the rest in L2)."""
    num_l1_chunks = num_chunks if num_l1_chunks is None else num_l1_chunks
    hashes = BOUNDARIES[:num_chunks]
    copy = DigestReplica()
    copy.apply(DigestDelta("e", 1, None, True, CHUNK, PAGE, tuple(hashes[:num_l1_chunks]),
                           tuple(hashes[num_l1_chunks:]), (), SEED))  # fmt: skip
    return copy


def view(
    index: int, num_chunks: int = 0, queued: int = 0, queued_tokens: int = 0,
    free_pages: int = 100, healthy: bool = True, num_l1_chunks: int | None = None,
    ttft_scale: float = 1.0,
) -> RankView:  # fmt: skip
    load = RankLoad(queued, 0, queued_tokens, free_pages, 0, 0, 100)
    return RankView(index, URLS[index], healthy, load, digest=replica(num_chunks, num_l1_chunks),
                    ttft_scale=ttft_scale)  # fmt: skip


def request(tokens: Sequence[int] = PROMPT) -> RoutingRequest:
    return RoutingRequest(tokens)


# -- estimates --


def test_the_estimate_is_the_deepest_chunk_present_split_by_tier() -> None:
    estimate = estimate_prefix(request(), view(0, num_chunks=3, num_l1_chunks=1))
    assert (estimate.matched_tokens, estimate.l1_tokens, estimate.l2_tokens) == (24, 8, 16)
    assert estimate_prefix(request(PROMPT[:7]), view(0, num_chunks=3)).matched_tokens == 0
    other = request([99, *PROMPT[1:]])  # first token differs: every chained hash differs
    assert estimate_prefix(other, view(0, num_chunks=4)).matched_tokens == 0
    assert estimate_prefix(RoutingRequest(), view(0, num_chunks=4)).matched_tokens == 0


# -- cache_aware: every branch --


def test_cache_aware_picks_the_longest_match() -> None:
    ranks = [view(0, num_chunks=1), view(1, num_chunks=3, queued=2), view(2)]
    decision = CacheAware(max_extra_reqs=2).choose(request(), ranks)
    assert (decision.index, decision.branch, decision.matched_tokens) == (1, "match", 24)
    assert decision.policy == "cache_aware"


def test_cache_aware_ties_go_to_the_least_loaded() -> None:
    ranks = [view(0, num_chunks=2, queued=3), view(1, num_chunks=2, queued=1)]
    assert CacheAware(max_extra_reqs=4).choose(request(), ranks).index == 1


def test_cache_aware_overrides_to_the_least_loaded_beyond_the_bound() -> None:
    ranks = [view(0, queued=1), view(1, num_chunks=3, queued=4), view(2, queued=2)]
    decision = CacheAware(max_extra_reqs=2).choose(request(), ranks)
    assert (decision.index, decision.branch, decision.matched_tokens) == (0, "override", 0)
    # Exactly at the bound the match stands.
    assert CacheAware(max_extra_reqs=3).choose(request(), ranks).branch == "match"


def test_cache_aware_falls_back_to_the_best_rank_with_room() -> None:
    # Rank 1 matches 3 chunks but has 1 free page; the 8 unmatched tokens need 2.
    ranks = [view(0, num_chunks=1), view(1, num_chunks=3, free_pages=1), view(2)]
    decision = CacheAware(max_extra_reqs=4).choose(request(), ranks)
    assert (decision.index, decision.branch, decision.matched_tokens) == (
        0, "capacity_fallback", 8,
    )  # fmt: skip
    # Nobody has room: the choice stands.
    tight = [view(0, free_pages=0), view(1, num_chunks=3, free_pages=1)]
    assert CacheAware(max_extra_reqs=4).choose(request(), tight).index == 1


def test_cache_aware_without_a_match_takes_the_least_loaded() -> None:
    ranks = [view(0, queued=2), view(1, queued=1), view(2, queued=1, queued_tokens=5)]
    decision = CacheAware(max_extra_reqs=4).choose(request(), ranks)
    assert (decision.index, decision.branch) == (1, "no_match")


def test_cache_aware_skips_an_unhealthy_rank_holding_the_prefix() -> None:
    ranks = [view(0, num_chunks=1, queued=3), view(1, num_chunks=4, healthy=False), view(2)]
    decision = CacheAware(max_extra_reqs=4).choose(request(), ranks)
    assert (decision.index, decision.branch, decision.matched_tokens) == (0, "match", 8)


def test_auto_routes_cache_aware_only_with_several_caching_ranks() -> None:
    config = RouterConfig(decode=URLS, load_balance_method="auto")
    auto = make_policy(config)
    assert isinstance(auto, Auto) and not auto.needs_tokens  # no --model: no tokenizer
    caching = [view(0), view(1, num_chunks=2)]
    assert auto.choose(request(), caching).policy == "cache_aware"
    plain = [RankView(i, URLS[i], True, None) for i in range(2)]
    assert [auto.choose(request(), plain).index for _ in range(3)] == [0, 1, 0]
    assert auto.choose(request(), caching[:1]).policy == "round_robin"


# -- the router's own decisions between polls --


def registry_with_digests(num_decode: int = 3) -> WorkerRegistry:
    workers = WorkerRegistry((), URLS[:num_decode], 2)
    for rank in workers.decode:
        workers.on_poll_ok(rank, RankLoad(0, 0, 0, 100, 0, 0, 100), workers.poll_mark(rank))
        workers.on_digest(rank, DigestDelta("e", 0, None, True, CHUNK, PAGE, (), (), (), SEED))
    return workers


def route(workers: WorkerRegistry, policy: CacheAware, tokens: list[int]) -> int:
    routing = request(tokens)
    decision = policy.choose(routing, workers.views(Role.DECODE))
    rank = workers.decode[decision.index]
    hashes = routing.boundary_hashes(SEED, PAGE, CHUNK)
    workers.begin_request(rank, len(tokens), hashes, len(tokens) - decision.matched_tokens)
    return decision.index


def test_a_burst_sharing_a_new_prefix_follows_its_first_request() -> None:
    workers, policy = registry_with_digests(), CacheAware(max_extra_reqs=2)
    # Nothing is cached anywhere yet: the first goes least-loaded, the next ones sharing
    # its prefix follow it (until the override bound), others spread.
    assert route(workers, policy, PROMPT) == 0
    assert route(workers, policy, PROMPT[:16] + [7] * 8) == 0
    assert route(workers, policy, [5] * 16) == 1
    assert route(workers, policy, PROMPT[:24]) == 0
    assert route(workers, policy, PROMPT) == 2  # rank 0 is 3 requests ahead: override


def test_routed_prefixes_are_forgotten_once_a_later_poll_answered() -> None:
    workers = registry_with_digests(num_decode=1)
    (rank,) = workers.decode
    routed = workers.begin_request(rank, 32, BOUNDARIES, 32)
    assert set(rank.routed.counts) == set(BOUNDARIES)
    early = workers.poll_mark(rank)  # sent while the request runs: its answer may not
    workers.end_request(rank, routed)  # show the prefix yet, so the router keeps it
    workers.on_poll_ok(rank, RankLoad(0, 0, 0, 100, 0, 0, 100), early)
    workers.settle_routed(rank, early)
    assert set(rank.routed.counts) == set(BOUNDARIES)
    late = workers.poll_mark(rank)
    workers.on_poll_ok(rank, RankLoad(0, 0, 0, 100, 0, 0, 100), late)
    rank.digest, rank.digest_dropped = None, True  # its delta was out of sequence:
    workers.settle_routed(rank, late)  # the routed prefixes stay until a snapshot
    assert set(rank.routed.counts) == set(BOUNDARIES)
    rank.digest_dropped = False
    workers.settle_routed(rank, late)
    assert rank.routed.counts == {}


# -- ttft --

COSTS = TtftCosts(prefill_s_per_token=1e-3, transfer_s_per_token=0.0, l2_s_per_token=1e-4,
                  l3_s_per_token=0.0)  # fmt: skip


def test_ttft_trades_a_cached_prefix_against_a_queue() -> None:
    policy = Ttft(COSTS, reuse_weight=0.0)
    # rank 0: 32 new tokens, empty queue: 32 ms. rank 1: 8 new tokens after a queue of 20
    # tokens: 28 ms. The match wins.
    ranks = [view(0), view(1, num_chunks=3, queued=1, queued_tokens=20)]
    decision = policy.choose(request(), ranks)
    assert (decision.index, decision.branch, decision.matched_tokens) == (1, "match", 24)
    assert decision.estimated_ttft_s == pytest.approx(0.028)
    # A queue of 30 tokens: 38 ms, so the idle rank (32 ms) wins although it has nothing.
    ranks = [view(0), view(1, num_chunks=3, queued=1, queued_tokens=30)]
    decision = policy.choose(request(), ranks)
    assert (decision.index, decision.branch) == (0, "no_match")
    assert decision.estimated_ttft_s == pytest.approx(0.032)


def test_ttft_charges_leaving_the_longest_prefix_for_its_future_hits() -> None:
    # As above (38 ms vs 32 ms), but leaving rank 1 gives up 24 cached tokens: with a
    # reuse weight of 1 that costs 24 ms more, so rank 0 scores 56 ms and rank 1 stays.
    ranks = [view(0), view(1, num_chunks=3, queued=1, queued_tokens=30)]
    decision = Ttft(COSTS, reuse_weight=1.0).choose(request(), ranks)
    assert (decision.index, decision.estimated_ttft_s) == (1, pytest.approx(0.038))
    # A long enough queue still moves the request: 100 queued tokens = 108 ms > 56 ms.
    ranks = [view(0), view(1, num_chunks=3, queued=1, queued_tokens=100)]
    assert Ttft(COSTS, reuse_weight=1.0).choose(request(), ranks).index == 0


def test_ttft_charges_l2_hits_a_host_copy_and_scales_by_observed_speed() -> None:
    policy = Ttft(COSTS, reuse_weight=0.0)
    # 24 tokens from L2 (2.4 ms) + 8 new (8 ms) = 10.4 ms vs 24 from L1 + 8 new behind
    # 3 queued tokens = 11 ms.
    ranks = [view(0, num_chunks=3, num_l1_chunks=0), view(1, num_chunks=3, queued_tokens=3)]
    decision = policy.choose(request(), ranks)
    assert (decision.index, decision.estimated_ttft_s) == (0, pytest.approx(0.0104))
    # Rank 0 observed twice as slow as the others: 20.8 ms.
    slow = [view(0, num_chunks=3, num_l1_chunks=0, ttft_scale=2.0),
            view(1, num_chunks=3, queued_tokens=3), view(2)]  # fmt: skip
    assert policy.choose(request(), slow).index == 1
    # Within the deadband of the median (1.2 vs 1.0) a scale changes nothing.
    close = [view(0, num_chunks=3, num_l1_chunks=0, ttft_scale=1.2),
             view(1, num_chunks=3, queued_tokens=3), view(2)]  # fmt: skip
    assert policy.choose(request(), close).index == 0


def test_ttft_counts_new_tokens_routed_since_the_poll_and_not_yet_prefilled() -> None:
    workers = registry_with_digests(num_decode=2)
    policy = Ttft(COSTS, reuse_weight=0.0)
    rank0 = workers.decode[0]
    routed = workers.begin_request(rank0, 100, (), num_new_tokens=100)
    assert policy.choose(request(), workers.views(Role.DECODE)).index == 1
    # A later poll shows nothing waiting (the rank is computing it): still busy.
    workers.on_poll_ok(rank0, RankLoad(1, 0, 0, 100, 0, 0, 100), workers.poll_mark(rank0))
    assert policy.choose(request(), workers.views(Role.DECODE)).index == 1
    workers.first_token(rank0, routed)  # its prefill is done: rank 0 is free again
    rank1 = workers.decode[1]
    workers.on_poll_ok(rank1, RankLoad(0, 1, 5, 100, 0, 0, 100), workers.poll_mark(rank1))
    assert policy.choose(request(), workers.views(Role.DECODE)).index == 0


def test_observed_ttft_moves_a_ranks_scale_by_an_ewma() -> None:
    workers = registry_with_digests(num_decode=1)
    (rank,) = workers.decode
    workers.observe_ttft(rank, estimated_s=0.1, observed_s=0.3)  # ratio 3
    assert rank.ttft_scale == pytest.approx(0.8 * 1.0 + 0.2 * 3.0)
    workers.observe_ttft(rank, estimated_s=0.0, observed_s=5.0)  # no information
    assert rank.ttft_scale == pytest.approx(1.4)
    for _ in range(100):
        workers.observe_ttft(rank, estimated_s=0.01, observed_s=10.0)
    assert rank.ttft_scale == 10.0  # bounded


# -- usage read back from answers --


def test_usage_is_read_from_json_and_from_sse_split_anywhere() -> None:
    usage = {"prompt_tokens": 30, "kvstrata": {"cached_tokens_l1": 16, "cached_tokens_l2": 8,
                                               "cached_tokens_l3": 0, "rank": 1}}  # fmt: skip
    parsed = usage_of({"usage": usage})
    assert parsed is not None and (parsed.prompt_tokens, parsed.cached_tokens) == (30, 24)
    assert usage_of({"usage": None}) is None
    body = (b'data: {"text": "a", "usage": null}\n\n'
            b'data: {"text": "", "usage": ' + str(usage).replace("'", '"').encode() + b"}\n\n"
            b"data: [DONE]\n\n")  # fmt: skip
    for cut in range(1, len(body)):
        sniffer = SseUsage()
        sniffer.feed(body[:cut])
        sniffer.feed(body[cut:])
        assert sniffer.usage == parsed


def test_digest_tiers_reach_the_estimate_through_deltas() -> None:
    copy = replica(2)
    delta = DigestDelta("e", 2, 1, False, CHUNK, PAGE, (), (BOUNDARIES[0],), (BOUNDARIES[1],))
    assert copy.apply(delta)
    assert copy.entries == {BOUNDARIES[0]: TIER_L2}
    assert TIER_L1 not in copy.entries.values()
