"""L3-aware `ttft`, exactly: rank 0 holds a prompt's prefix in L1 but owes 200 tokens of
prefill; rank 1 is idle and reads the same L3 store, which holds the prefix. Without
the store's answer the prefix is a prefill on rank 1 and rank 0 wins; with it rank 1
restores the prefix at L3's cost and wins; a rank reading another store gains nothing."""

from __future__ import annotations

import pytest

from kvstrata.kvcache.digest_wire import DigestDelta, DigestReplica
from kvstrata.router.policy import RankLoad, RankView, RoutingRequest
from kvstrata.router.prefix import estimate_prefix
from kvstrata.router.ttft import Ttft, TtftCosts, l3_tokens_beyond

SEED = bytes(32)
PAGE, CHUNK = 16, 64
PREFIX = list(range(1, 257))  # 256 tokens: 16 pages, 4 chunks
PROMPT = PREFIX + list(range(300, 340))  # 40 new tokens
COSTS = TtftCosts(prefill_s_per_token=1e-3, transfer_s_per_token=0.0, l2_s_per_token=1e-4,
                  l3_s_per_token=1e-5)  # fmt: skip


def view(index: int, held: list[int], store: str | None, unprefilled: int = 0) -> RankView:
    replica = DigestReplica()
    hashes = RoutingRequest(held).boundary_hashes(SEED, PAGE, CHUNK) if held else []
    replica.apply(DigestDelta("e", 1, None, True, CHUNK, PAGE, tuple(hashes), (), (), SEED))
    load = RankLoad(0, 0, 0, 1000, 0, 0, 1000, extra={"l3_store": store})
    return RankView(index, f"http://127.0.0.1:{3001 + index}", True, load,
                    num_unprefilled_tokens=unprefilled, digest=replica)  # fmt: skip


def request(l3_pages: dict[str, int]) -> RoutingRequest:
    routing = RoutingRequest(PROMPT)
    routing.l3_pages.update(l3_pages)
    return routing


@pytest.mark.parametrize(
    "l3_pages, rank1_store, expected",
    [
        ({}, "s", 0),  # no answer from the store: the prefix would be a prefill on rank 1
        ({"s": 16}, "s", 1),  # the store holds it: rank 1 restores 256 tokens from L3
        ({"s": 16}, "other", 0),  # rank 1 reads another store
    ],
)
def test_an_l3_held_prefix_is_routed_by_its_restore_cost(
    l3_pages: dict[str, int], rank1_store: str, expected: int
) -> None:
    ranks = [view(0, PREFIX, "s", unprefilled=200), view(1, [], rank1_store)]
    decision = Ttft(COSTS, reuse_weight=0.0).choose(request(l3_pages), ranks)
    assert decision.index == expected
    if expected == 1:
        # 256 L3 tokens (the prompt has 296: the cut at its last token does not bite),
        # 40 computed: 256 x 1e-5 + 40 x 1e-3.
        assert decision.estimated_ttft_s == pytest.approx(256 * 1e-5 + 40 * 1e-3)


def test_l3_counts_only_beyond_the_rank_own_match_and_before_the_last_token() -> None:
    rank = view(0, PREFIX[:128], "s")  # L1/L2: 2 chunks
    estimate = estimate_prefix(request({}), rank)
    assert estimate.matched_tokens == 128
    assert l3_tokens_beyond(request({"s": 16}), rank, estimate) == 256 - 128
    assert l3_tokens_beyond(request({"s": 4}), rank, estimate) == 0  # below the match
    whole = RoutingRequest(PREFIX)  # the store holds every page of the prompt
    whole.l3_pages["s"] = 16
    assert l3_tokens_beyond(whole, rank, estimate_prefix(whole, rank)) == 255 - 128
