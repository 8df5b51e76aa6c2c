"""The routing policies and the router's rank registry, exactly: which rank each policy
picks, how the router's own decisions since the last poll count, health transitions."""

from __future__ import annotations

import pytest

from kvstrata.config import ConfigError, RouterConfig
from kvstrata.router.policies import POLICIES, make_policy
from kvstrata.router.policy import (
    NoRankAvailable,
    RankLoad,
    RankView,
    RoundRobin,
    RoutingRequest,
    ShortestQueue,
    TotalTokens,
)
from kvstrata.router.workers import Role, WorkerRegistry

URLS = ("http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003")
NO_TOKENS = RoutingRequest()


def load(running: int = 0, waiting: int = 0, queued_tokens: int = 0) -> RankLoad:
    return RankLoad(running, waiting, queued_tokens, num_free_pages=100, num_cached_pages=0,
                    num_used_pages=0, num_total_pages=100)  # fmt: skip


def view(
    index: int, rank_load: RankLoad | None = None, healthy: bool = True, routed: int = 0,
    routed_tokens: int = 0,
) -> RankView:  # fmt: skip
    rank_load = rank_load if rank_load is not None else load()
    return RankView(
        index, URLS[index], healthy, rank_load,
        num_routed_since_poll=routed, num_routed_tokens_since_poll=routed_tokens,
    )  # fmt: skip


def picks(policy: RoundRobin, ranks: list[RankView], n: int) -> list[int]:
    return [policy.choose(NO_TOKENS, ranks).index for _ in range(n)]


# -- RankLoad --


def test_rank_load_parses_common_fields_and_keeps_the_rest() -> None:
    body = {"rank": 2, "num_running_reqs": 1, "num_waiting_reqs": 2, "num_queued_tokens": 30,
            "num_free_pages": 4, "num_cached_pages": 5, "num_used_pages": 6,
            "num_total_pages": 15, "digest": {"version": 3}}  # fmt: skip
    parsed = RankLoad.from_json(body)
    assert parsed.num_queued_reqs == 3
    assert parsed.num_queued_tokens == 30
    assert parsed.extra == {"rank": 2, "digest": {"version": 3}}
    # A rank that does not report local prefill (older, or not a decode rank) does none.
    assert parsed.max_local_prefill_tokens == 0
    assert parsed.to_json() == body | {"max_local_prefill_tokens": 0}


@pytest.mark.parametrize("bad", [None, "3", True, 1.5])
def test_rank_load_refuses_a_missing_or_non_integer_field(bad: object) -> None:
    body = load().to_json() | {"num_waiting_reqs": bad}
    with pytest.raises(ValueError, match="num_waiting_reqs"):
        RankLoad.from_json(body)


def test_rank_load_parses_the_local_prefill_limit_and_refuses_a_non_integer() -> None:
    body = load().to_json() | {"max_local_prefill_tokens": 512}
    assert RankLoad.from_json(body).max_local_prefill_tokens == 512
    with pytest.raises(ValueError, match="max_local_prefill_tokens"):
        RankLoad.from_json(body | {"max_local_prefill_tokens": "512"})


# -- round_robin --


def test_round_robin_cycles_in_index_order() -> None:
    ranks = [view(0), view(1), view(2)]
    assert picks(RoundRobin(), ranks, 7) == [0, 1, 2, 0, 1, 2, 0]


def test_round_robin_skips_unhealthy_ranks_and_takes_them_back() -> None:
    policy = RoundRobin()
    ranks = [view(0), view(1), view(2)]
    assert picks(policy, ranks, 2) == [0, 1]
    ranks[2] = view(2, healthy=False)
    assert picks(policy, ranks, 3) == [0, 1, 0]
    ranks[2] = view(2)
    assert picks(policy, ranks, 3) == [1, 2, 0]


def test_round_robin_ignores_load() -> None:
    ranks = [view(0, load(running=50)), view(1)]
    decision = RoundRobin().choose(NO_TOKENS, ranks)
    assert (decision.index, decision.url, decision.branch) == (0, URLS[0], "round_robin")
    assert decision.matched_tokens == 0


@pytest.mark.parametrize("policy_cls", [RoundRobin, ShortestQueue, TotalTokens])
def test_no_healthy_rank_raises(policy_cls: type) -> None:
    with pytest.raises(NoRankAvailable):
        policy_cls().choose(NO_TOKENS, [view(0, healthy=False), view(1, healthy=False)])
    with pytest.raises(NoRankAvailable):
        policy_cls().choose(NO_TOKENS, [])


# -- shortest_queue --


def test_shortest_queue_picks_fewest_running_plus_waiting() -> None:
    ranks = [view(0, load(running=2, waiting=1)), view(1, load(running=1, waiting=1)),
             view(2, load(running=0, waiting=3))]  # fmt: skip
    decision = ShortestQueue().choose(NO_TOKENS, ranks)
    assert (decision.index, decision.branch) == (1, "shortest_queue")


def test_shortest_queue_counts_decisions_since_the_last_poll() -> None:
    # Rank 0 looked idle at its last poll, but the router has sent it 3 requests since.
    ranks = [view(0, load(), routed=3), view(1, load(running=2))]
    assert ShortestQueue().choose(NO_TOKENS, ranks).index == 1


def test_shortest_queue_breaks_ties_by_tokens_then_index() -> None:
    ranks = [view(0, load(running=1, queued_tokens=90)), view(1, load(running=1, queued_tokens=10)),
             view(2, load(running=1, queued_tokens=10))]  # fmt: skip
    assert ShortestQueue().choose(NO_TOKENS, ranks).index == 1


def test_shortest_queue_skips_an_idle_unhealthy_rank() -> None:
    ranks = [view(0, load(), healthy=False), view(1, load(running=5))]
    assert ShortestQueue().choose(NO_TOKENS, ranks).index == 1


def test_a_rank_never_polled_counts_as_idle() -> None:
    ranks = [view(0, load(running=1)), RankView(1, URLS[1], True, None)]
    assert ShortestQueue().choose(NO_TOKENS, ranks).index == 1
    assert TotalTokens().choose(NO_TOKENS, ranks).index == 1


# -- total_tokens --


def test_total_tokens_picks_fewest_queued_tokens_not_fewest_requests() -> None:
    ranks = [
        view(0, load(running=1, queued_tokens=900)),
        view(1, load(running=4, queued_tokens=40)),
    ]
    decision = TotalTokens().choose(RoutingRequest([1, 2, 3]), ranks)
    assert (decision.index, decision.branch) == (1, "total_tokens")


def test_total_tokens_adds_tokens_routed_since_the_last_poll() -> None:
    ranks = [view(0, load(queued_tokens=100), routed=1, routed_tokens=500),
             view(1, load(queued_tokens=300))]  # fmt: skip
    assert TotalTokens().choose(NO_TOKENS, ranks).index == 1


def test_total_tokens_breaks_ties_by_requests_then_index() -> None:
    ranks = [view(0, load(running=2, queued_tokens=50)), view(1, load(running=1, queued_tokens=50)),
             view(2, load(running=1, queued_tokens=50))]  # fmt: skip
    assert TotalTokens().choose(NO_TOKENS, ranks).index == 1


# -- the registry: in-flight accounting and health --


def registry(num_decode: int = 2, num_prefill: int = 0) -> WorkerRegistry:
    return WorkerRegistry(URLS[:num_prefill], URLS[num_prefill : num_prefill + num_decode], 2)


def test_routed_since_poll_counts_only_decisions_after_the_poll_was_sent() -> None:
    workers = registry(num_decode=1)
    (rank,) = workers.decode
    for _ in range(3):
        workers.begin_request(rank, num_prompt_tokens=10)
    mark = workers.poll_mark(rank)  # a poll goes out; its answer counts those 3
    workers.begin_request(rank, num_prompt_tokens=7)
    workers.begin_request(rank, num_prompt_tokens=5)
    workers.on_poll_ok(rank, load(running=3, queued_tokens=30), mark)
    (seen,) = workers.views(Role.DECODE)
    assert (seen.num_routed_since_poll, seen.num_routed_tokens_since_poll) == (2, 12)
    assert (seen.estimated_queued_reqs, seen.estimated_queued_tokens) == (5, 42)
    assert seen.num_inflight == 5
    workers.end_request(rank)
    assert workers.views(Role.DECODE)[0].num_inflight == 4


def test_a_burst_between_polls_spreads_over_idle_ranks() -> None:
    workers = registry(num_decode=3)
    for rank in workers.decode:
        workers.on_poll_ok(rank, load(), workers.poll_mark(rank))
    policy = ShortestQueue()
    chosen = []
    for _ in range(6):
        decision = policy.choose(NO_TOKENS, workers.views(Role.DECODE))
        workers.begin_request(workers.decode[decision.index], num_prompt_tokens=0)
        chosen.append(decision.index)
    assert chosen == [0, 1, 2, 0, 1, 2]


def test_health_follows_polls_and_failed_forwards() -> None:
    workers = registry(num_decode=2)
    rank0, rank1 = workers.decode
    assert not rank0.healthy and not workers.is_ready  # never answered yet
    for rank in (rank0, rank1):
        workers.on_poll_ok(rank, load(), workers.poll_mark(rank))
    assert workers.num_healthy(Role.DECODE) == 2 and workers.is_ready
    workers.on_poll_failed(rank0, "ConnectError")
    assert rank0.healthy  # one failure is under the threshold of 2
    workers.on_poll_failed(rank0, "ConnectError")
    assert not rank0.healthy and rank0.last_error == "ConnectError"
    workers.on_poll_ok(rank0, load(), workers.poll_mark(rank0))
    assert rank0.healthy and rank0.num_consecutive_failures == 0
    workers.on_forward_failed(rank1, "connect: refused")  # one failed forward is enough
    assert not rank1.healthy
    assert [v.healthy for v in workers.views(Role.DECODE)] == [True, False]
    assert RoundRobin().choose(NO_TOKENS, workers.views(Role.DECODE)).index == 0


def test_a_disaggregated_cluster_without_a_healthy_prefill_rank_is_degraded() -> None:
    workers = registry(num_decode=1, num_prefill=1)
    assert not workers.is_ready  # no decode rank answered yet
    (decode,) = workers.decode
    workers.on_poll_ok(decode, load(), workers.poll_mark(decode))
    assert not workers.is_ready  # the prefill rank has not been heard from yet
    (prefill,) = workers.prefill
    workers.on_poll_ok(prefill, load(), workers.poll_mark(prefill))
    assert workers.is_ready and not workers.is_degraded
    workers.on_forward_failed(prefill, "connect: refused")
    # Ready: the decode rank prefills requests itself while no prefill rank is healthy.
    assert workers.is_ready and workers.is_degraded


# -- configuration --


def test_every_load_balance_method_has_a_policy() -> None:
    config = RouterConfig(decode=URLS[:1])
    choices = next(f for f in config.__dataclass_fields__.values()
                   if f.name == "load_balance_method").metadata["choices"]  # fmt: skip
    assert set(choices) <= set(POLICIES)
    for name in choices:
        policy = make_policy(RouterConfig(decode=URLS[:1], load_balance_method=name))
        assert policy.name == name
        # Without --model only policies that never tokenize; cache_aware and ttft need it.
        assert policy.needs_tokens == (name in ("cache_aware", "ttft"))


def test_router_config_normalises_url_lists_and_refuses_bad_ones() -> None:
    config = RouterConfig(prefill=[f"{URLS[0]}/"], decode=[f"{URLS[1]},{URLS[2]}"])  # type: ignore[arg-type]
    assert config.prefill == (URLS[0],)
    assert config.decode == (URLS[1], URLS[2])
    with pytest.raises(ConfigError, match="--decode"):
        RouterConfig(prefill=URLS[:1])
    with pytest.raises(ConfigError, match="twice"):
        RouterConfig(prefill=URLS[:1], decode=URLS[:1])
    with pytest.raises(ConfigError, match="http"):
        RouterConfig(decode=("127.0.0.1:80",))
    with pytest.raises(ConfigError, match="--load-balance-method"):
        RouterConfig(decode=URLS[:1], load_balance_method="random")
