"""The router over one prefill and two decode ranks (decode radix cache on, cache_aware with
the default 256-token digest chunk): a conversation of 150-250 tokens, shorter than one
chunk, keeps its decode rank turn after turn and hits its history there; and with the
only prefill rank gone, requests go to a decode rank without a prefill rank (none named,
and the decode ranks, as `kvstrata launch` starts them, know none of their own), which
prefills them itself, with the unified engine's tokens, instead of a 503."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fault_cluster import FaultCluster, wait_for
from fault_load import PAGE_SIZE, Outcome, Reference, generate, judge

COMMON = ("--page-size", str(PAGE_SIZE), "--max-model-len", "512", "--log-level", "warning")
NUM_TURNS = 4


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    # As `kvstrata launch` starts them: decode ranks know no prefill rank of their own.
    decode_flags = (*COMMON, "--num-kv-pages", "512", "--disaggregation-decode-enable-radix-cache")
    with FaultCluster(
        tiny_llama, tmp_path_factory.mktemp("decode-affinity"),
        prefill_flags=(*COMMON, "--num-kv-pages", "512"), decode_flags=decode_flags,
        router_flags=("--load-balance-method", "cache_aware"), num_prefill=1, num_decode=2,
    ) as started:  # fmt: skip
        yield started
        assert not started.tracebacks(), started.tracebacks()


def converse(client: httpx.Client, seed: int) -> list[Outcome]:
    """NUM_TURNS greedy turns: 150 tokens, then the history plus 12 new ones each turn."""
    rng = random.Random(seed)
    history = [rng.randrange(500) for _ in range(150)]
    outcomes = []
    for _ in range(NUM_TURNS):
        outcome = generate(client, history, stream=len(outcomes) % 2 == 1, max_new_tokens=8)
        assert outcome.kind == "completed", outcome.detail
        outcomes.append(outcome)
        history = history + outcome.output_ids + [rng.randrange(500) for _ in range(12)]
    assert len(outcomes[-1].prompt) < 256  # every turn shorter than one digest chunk
    return outcomes


def test_a_short_conversation_keeps_its_decode_rank(
    cluster: FaultCluster, reference: Reference
) -> None:
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        for seed in (1, 2):
            turns = converse(client, seed)
            assert len({turn.rank for turn in turns}) == 1, [turn.rank for turn in turns]
            cached = [turn.usage["prompt_tokens_details"]["cached_tokens"] for turn in turns]
            assert all(num_tokens > 0 for num_tokens in cached[1:]), cached
            judge(turns, reference)
    cluster.settle()


def test_without_its_prefill_rank_the_cluster_prefills_on_decode_ranks(
    cluster: FaultCluster, reference: Reference
) -> None:
    """Last of its module: the prefill rank stays dead."""
    (prefill,) = cluster.prefill
    prefill.kill()
    cluster.wait_router_sees(prefill, healthy=False)
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        prompts = [[(7 * i + j) % 500 for j in range(40 + i)] for i in range(4)]
        outcomes = [generate(client, p, stream=i % 2 == 1) for i, p in enumerate(prompts)]
    assert judge(outcomes, reference)["completed"] == len(prompts), [o.detail for o in outcomes]
    for outcome in outcomes:
        assert outcome.usage is not None
        assert outcome.usage["kvstrata"]["local_prefill_tokens"] > 0, outcome.usage
    wait_for(lambda: all(r["num_inflight"] == 0 for r in cluster.router_load()), "router idle")
    cluster.settle()
