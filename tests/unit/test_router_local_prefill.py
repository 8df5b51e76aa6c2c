"""The `ttft` policy and decode ranks that prefill small requests themselves (local
prefill, issue 16.1), exactly: a rank whose reported `max_local_prefill_tokens` covers a
request's new tokens is estimated without their transfer, one below it pays it, and a
rank that does not report the field (an older one) is estimated as before."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from kvstrata.router.policy import RankLoad, RankView, RoutingRequest
from kvstrata.router.prefix import PrefixEstimate
from kvstrata.router.ttft import Ttft, TtftCosts, estimate_ttft_s
from kvstrata.router.workers import LoadInquirer, Role, WorkerRegistry

URLS = ("http://127.0.0.1:4001", "http://127.0.0.1:4002")
# 1 ms to compute a token, 0.5 ms more to move its KV from a prefill rank.
COSTS = TtftCosts(prefill_s_per_token=1e-3, transfer_s_per_token=5e-4, l2_s_per_token=1e-4,
                  l3_s_per_token=0.0)  # fmt: skip
PROMPT_32 = RoutingRequest(num_prompt_tokens=32)  # no token ids: nothing matches anywhere


def view(index: int, max_local_prefill_tokens: int = 0, queued_tokens: int = 0) -> RankView:
    load = RankLoad(0, 0, queued_tokens, 100, 0, 0, 100, max_local_prefill_tokens)
    return RankView(index, URLS[index], True, load)


def test_new_tokens_within_the_limit_pay_no_transfer() -> None:
    # 24 of 32 tokens expected in L1: 8 new. Computed there: 8 ms; via a prefill rank
    # 8 x 1.5 ms = 12 ms.
    estimate = PrefixEstimate(matched_tokens=24, l1_tokens=24)
    cases = {0: 0.012, 7: 0.012, 8: 0.008, 512: 0.008}
    for limit, expected_s in cases.items():
        assert estimate_ttft_s(view(0, limit), PROMPT_32, estimate, COSTS) == pytest.approx(
            expected_s
        ), limit


def test_a_rank_that_prefills_locally_wins_when_the_transfer_decides() -> None:
    policy = Ttft(COSTS, reuse_weight=0.0)
    # Equally loaded: rank 0 sends the 32 tokens through a prefill rank (48 ms), rank 1
    # computes them itself (32 ms). Without the limit the tie would go to rank 0.
    decision = policy.choose(PROMPT_32, [view(0), view(1, max_local_prefill_tokens=64)])
    assert (decision.index, decision.branch) == (1, "no_match")
    assert decision.estimated_ttft_s == pytest.approx(0.032)
    # 10 queued tokens there (10 ms + 32 ms = 42 ms) still beat the transfer; 20 do not
    # (52 ms > 48 ms).
    queued_10 = [view(0), view(1, max_local_prefill_tokens=64, queued_tokens=10)]
    assert policy.choose(PROMPT_32, queued_10).estimated_ttft_s == pytest.approx(0.042)
    queued_20 = [view(0), view(1, max_local_prefill_tokens=64, queued_tokens=20)]
    assert policy.choose(PROMPT_32, queued_20).index == 0


def test_a_request_beyond_the_limit_still_pays_the_transfer() -> None:
    # 100 new tokens, limit 64: both ranks send it to a prefill rank, 150 ms each, and
    # the tie goes to the lower index.
    policy = Ttft(COSTS, reuse_weight=0.0)
    decision = policy.choose(
        RoutingRequest(num_prompt_tokens=100), [view(0), view(1, max_local_prefill_tokens=64)]
    )
    assert (decision.index, decision.estimated_ttft_s) == (0, pytest.approx(0.150))


def test_the_limit_travels_from_get_load_to_the_policy_and_defaults_to_0() -> None:
    """Rank 0 answers /get_load as a rank from before local prefill (no field), rank 1
    reports 64: the poll's views carry 0 and 64, and the policy picks rank 1."""
    common = {"rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_queued_tokens": 0,
              "num_free_pages": 100, "num_cached_pages": 0, "num_used_pages": 0,
              "num_total_pages": 100}  # fmt: skip
    answers: dict[str, dict[str, Any]] = {
        "127.0.0.1:4001": common,
        "127.0.0.1:4002": common | {"rank": 1, "max_local_prefill_tokens": 64},
    }

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answers[f"{request.url.host}:{request.url.port}"])

    async def poll(workers: WorkerRegistry) -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            await LoadInquirer(workers, client, interval_s=1.0, timeout_s=1.0).poll_once()

    workers = WorkerRegistry((), URLS, unhealthy_after_failures=1)
    asyncio.run(poll(workers))
    views = workers.views(Role.DECODE)
    assert [v.healthy for v in views] == [True, True]
    limits = [v.load.max_local_prefill_tokens for v in views if v.load is not None]
    assert limits == [0, 64]
    decision = Ttft(COSTS, reuse_weight=0.0).choose(PROMPT_32, views)
    assert (decision.index, decision.estimated_ttft_s) == (1, pytest.approx(0.032))
