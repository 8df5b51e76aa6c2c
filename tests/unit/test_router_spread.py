"""Routing that spreads a shared prefix (issue 18.0): a prefix every rank holds, or a match
below the cache threshold, does not steer `cache_aware` or `ttft`; equally loaded ranks
go to the emptiest cache, not the lowest index; `kvstrata simulate` frees each run."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from kvstrata.config import ConfigError, RouterConfig
from kvstrata.kvcache.digest_wire import DigestDelta, DigestReplica
from kvstrata.kvcache.hashing import page_hashes
from kvstrata.kvcache.radix import RadixCache
from kvstrata.router.cache_aware import CacheAware
from kvstrata.router.policy import RankLoad, RankView, RoutingRequest
from kvstrata.router.ttft import Ttft, TtftCosts
from kvstrata.sim.config import SimConfig
from kvstrata.sim.report import simulate

SEED = bytes(32)
PAGE, CHUNK = 4, 8
PROMPT = list(range(1, 33))  # 32 tokens: chunk boundaries after 8, 16, 24 and 32
BOUNDARIES = page_hashes(PROMPT, PAGE, SEED)[1::2]
COSTS = TtftCosts(prefill_s_per_token=1e-3, transfer_s_per_token=0.0, l2_s_per_token=1e-4,
                  l3_s_per_token=0.0)  # fmt: skip


def view(
    index: int, num_chunks: int = 0, cached_pages: int = 0, queued: int = 0,
    queued_tokens: int = 0,
) -> RankView:  # fmt: skip
    """Rank `index` holding the first `num_chunks` chunks of PROMPT in L1, with
    `cached_pages` pages cached in all."""
    copy = DigestReplica()
    hashes = tuple(BOUNDARIES[:num_chunks])
    copy.apply(DigestDelta("e", 1, None, True, CHUNK, PAGE, hashes, (), (), SEED))
    load = RankLoad(queued, 0, queued_tokens, 100, cached_pages, 0, 200)
    return RankView(index, f"http://127.0.0.1:{3001 + index}", True, load, digest=copy)


def request() -> RoutingRequest:
    return RoutingRequest(PROMPT)


# -- cache_aware --


def test_a_prefix_every_rank_holds_is_no_match_and_goes_to_the_emptiest_cache() -> None:
    # Every rank holds the first chunk (a shared system prompt); rank 0 caches the most.
    ranks = [view(0, 1, cached_pages=50), view(1, 1, cached_pages=10), view(2, 1, cached_pages=30)]
    decision = CacheAware(max_extra_reqs=4).choose(request(), ranks)
    assert (decision.index, decision.branch, decision.matched_tokens) == (1, "no_match", 8)


def test_the_match_beyond_the_common_part_still_wins() -> None:
    ranks = [view(0, 1), view(1, 1), view(2, 3, cached_pages=90)]
    decision = CacheAware(max_extra_reqs=4).choose(request(), ranks)
    assert (decision.index, decision.branch, decision.matched_tokens) == (2, "match", 24)


def test_a_match_below_the_threshold_is_routed_as_new() -> None:
    # Rank 0 alone holds 8 of 32 tokens (25%): below a 30% threshold it does not count.
    ranks = [view(0, 1, cached_pages=20), view(1, cached_pages=5), view(2, cached_pages=9)]
    decision = CacheAware(max_extra_reqs=4, cache_threshold=0.3).choose(request(), ranks)
    assert (decision.index, decision.branch) == (1, "no_match")
    # At 25% it does.
    decision = CacheAware(max_extra_reqs=4, cache_threshold=0.25).choose(request(), ranks)
    assert (decision.index, decision.branch, decision.matched_tokens) == (0, "match", 8)


def test_the_threshold_is_a_router_option_in_zero_one() -> None:
    urls = ("http://127.0.0.1:3001",)
    config = RouterConfig(decode=urls, dp_routing_cache_threshold=0.4)
    assert CacheAware.from_config(config).cache_threshold == 0.4
    assert Ttft.from_config(config).cache_threshold == 0.4
    with pytest.raises(ConfigError, match="--dp-routing-cache-threshold"):
        RouterConfig(decode=urls, dp_routing_cache_threshold=1.5).validate()


# -- ttft --


def test_ttft_ties_on_a_common_prefix_go_to_the_emptiest_cache() -> None:
    ranks = [view(0, 1, cached_pages=40), view(1, 1, cached_pages=4), view(2, 1, cached_pages=7)]
    decision = Ttft(COSTS, reuse_weight=4.0).choose(request(), ranks)
    assert (decision.index, decision.branch, decision.matched_tokens) == (1, "no_match", 8)
    assert decision.estimated_ttft_s == pytest.approx(0.024)  # its real 24 new tokens


def test_ttft_does_not_queue_behind_a_rank_for_a_match_below_the_threshold() -> None:
    # Rank 0 holds 8 of 32 tokens behind a queue of 20: 20 + 24 = 44 ms. Rank 1 is idle
    # and empty: 32 ms. Charging rank 1 for leaving the 8 tokens (4 x 8 ms) would keep
    # the request on rank 0; below the threshold the match is not worth it.
    ranks = [view(0, 1, queued=1, queued_tokens=20), view(1)]
    decision = Ttft(COSTS, reuse_weight=4.0, cache_threshold=0.3).choose(request(), ranks)
    assert (decision.index, decision.branch) == (1, "no_match")
    assert decision.estimated_ttft_s == pytest.approx(0.032)
    # Idle ranks either side: the lone holder's 8 tokens do not draw the request either.
    ranks = [view(0, 1, cached_pages=2), view(1)]
    decision = Ttft(COSTS, reuse_weight=4.0, cache_threshold=0.3).choose(request(), ranks)
    assert (decision.index, decision.branch) == (1, "no_match")


# -- the simulator --

# Blocks of 4 tokens. Four conversations of two turns, each behind the same system block
# 100, ten seconds apart (every request has finished and been polled before the next).
SHARED_TRACE = [
    {"timestamp": 20_000 * c + 10_000 * turn, "input_length": 8 + 4 * turn,
     "output_length": 1, "hash_ids": [100, 1 + c] + [11 + c] * turn}
    for c in range(4) for turn in range(2)
]  # fmt: skip
NUM_PROMPT_TOKENS = 4 * (8 + 12)


def sim_config(trace: Path, policy: str, **options: object) -> SimConfig:
    fields = dict(
        trace=str(trace), num_decode=4, policy=policy, block_size=4, page_size=2,
        dp_routing_digest_chunk_size=4, l1_tokens_per_rank=64, prefill_tokens_per_s=1000.0,
        transfer_tokens_per_s=1e15,
    )  # fmt: skip
    return SimConfig(**(fields | options))  # type: ignore[arg-type]


@pytest.fixture()
def shared_trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(entry) + "\n" for entry in SHARED_TRACE))
    return path


def test_new_conversations_behind_a_shared_prompt_spread_over_every_rank(
    shared_trace: Path,
) -> None:
    for result in simulate(
        sim_config(shared_trace, "cache_aware,ttft", dp_routing_cache_threshold=0.6)
    ):
        # Each conversation on its own rank; each second turn finds its whole first turn.
        assert result.requests_per_rank == [2, 2, 2, 2], result.policy
        assert result.hit_rate == pytest.approx(4 * 8 / NUM_PROMPT_TOKENS), result.policy
        assert result.branches == {"match": 4, "no_match": 4}, result.policy


def test_simulate_frees_each_run_before_the_next(shared_trace: Path) -> None:
    # No automatic collection (on a real trace none comes in time: the run's millions of
    # objects are old by then): the rank caches (radix nodes link parent <-> child)
    # alive after simulate are what it left behind.
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(0)
    try:
        simulate(sim_config(shared_trace, "round_robin,cache_aware,ttft"))
        assert [o for o in gc.get_objects() if isinstance(o, RadixCache)] == []
    finally:
        gc.set_threshold(*thresholds)
