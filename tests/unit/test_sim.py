"""The routing simulator on a handmade trace, against hand-computed hit rates and TTFTs;
and its trace tokens: ids chain, the last block is truncated, hashes are memoized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.__main__ import main
from kvstrata.kvcache.hashing import page_hashes
from kvstrata.sim.config import SimConfig
from kvstrata.sim.report import percentile, simulate
from kvstrata.sim.trace import SIM_NAMESPACE, TraceRequest, TraceTokens, load_trace

# Blocks of 4 tokens, pages of 2, chunks of 4. Ten seconds apart: every request has
# finished (and been polled) before the next arrives.
TRACE = [
    {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]},
    {"timestamp": 10_000, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]},
    {"timestamp": 20_000, "input_length": 6, "output_length": 1, "hash_ids": [1, 3]},
    {"timestamp": 30_000, "input_length": 5, "output_length": 1, "hash_ids": [4, 5]},
]
NUM_PROMPT_TOKENS = 8 + 8 + 6 + 5


@pytest.fixture()
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(entry) + "\n" for entry in TRACE))
    return path


def config(trace: Path, **options: object) -> SimConfig:
    fields = dict(
        trace=str(trace), block_size=4, page_size=2, dp_routing_digest_chunk_size=4,
        l1_tokens_per_rank=64, prefill_tokens_per_s=1000.0, transfer_tokens_per_s=1e15,
    )  # fmt: skip
    return SimConfig(**(fields | options))  # type: ignore[arg-type]


def test_one_rank_hits_what_a_single_cache_would(trace: Path) -> None:
    (result,) = simulate(config(trace, num_decode=1, policy="round_robin"))
    # r1 repeats r0 (8 cached), r2 shares block 1 (4 cached; its 2-token block 3 is
    # new), r3 shares nothing.
    assert result.hit_rate == pytest.approx(12 / NUM_PROMPT_TOKENS)
    assert result.hit_rate_l1 == result.hit_rate and result.hit_rate_l2 == 0.0
    # TTFT = new tokens / 1000 per s: 8, 0, 2 and 5 ms.
    assert result.ttft_mean_s == pytest.approx((0.008 + 0.0 + 0.002 + 0.005) / 4)
    assert (result.ttft_p50_s, result.ttft_p99_s) == (pytest.approx(0.002), pytest.approx(0.008))


def test_round_robin_scatters_the_prefix_and_cache_aware_keeps_it(trace: Path) -> None:
    results = simulate(config(trace, num_decode=2, policy="round_robin,cache_aware"))
    by_policy = {r.policy: r for r in results}
    # round robin: r0 -> 0, r1 -> 1 (a miss), r2 -> 0 (block 1: 4), r3 -> 1.
    assert by_policy["round_robin"].hit_rate == pytest.approx(4 / NUM_PROMPT_TOKENS)
    assert by_policy["round_robin"].requests_per_rank == [2, 2]
    # cache_aware: r1 and r2 follow r0's prefix to rank 0; r3 matches nothing.
    aware = by_policy["cache_aware"]
    assert aware.hit_rate == pytest.approx(12 / NUM_PROMPT_TOKENS)
    assert aware.estimated_hit_rate == aware.hit_rate  # the digest was exact
    assert aware.branches == {"match": 2, "no_match": 2}


def test_evicted_prefixes_are_served_from_l2(trace: Path) -> None:
    # L1 of 5 pages, L2 of 10 (write-through). r2 (7 tokens with its output: 4 pages, 2
    # cached) evicts the last page of block 2 from L1; r3 (3 pages) evicts the rest of
    # block 2 and r2's page. A repeat of r0 then finds block 1 in L1, block 2 in L2.
    repeat = {"timestamp": 40_000, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}
    trace.write_text(trace.read_text() + json.dumps(repeat) + "\n")
    sim = config(trace, num_decode=1, policy="cache_aware", l1_tokens_per_rank=10)
    (result,) = simulate(sim)
    num_tokens = NUM_PROMPT_TOKENS + 8
    assert result.hit_rate == pytest.approx((12 + 8) / num_tokens)
    assert result.hit_rate_l2 == pytest.approx(4 / num_tokens)
    assert result.estimated_hit_rate == result.hit_rate  # L2 pages are in the digest


def test_the_router_forgets_what_the_digest_shows_evicted(trace: Path) -> None:
    # One rank, L1 of 5 pages, no L2: r1 and r2 evict r0's blocks 1 and 2, so a repeat of
    # r0 hits nothing. The router must see that too: once polls answered after r0 ended,
    # its memory of where it sent r0 gives way to the digest.
    entries = [
        {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 10_000, "input_length": 8, "output_length": 1, "hash_ids": [4, 5]},
        {"timestamp": 20_000, "input_length": 8, "output_length": 1, "hash_ids": [6, 7]},
        {"timestamp": 30_000, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]},
    ]
    trace.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    sim = config(trace, num_decode=1, policy="cache_aware", l1_tokens_per_rank=10, l2_ratio=0.0)
    (result,) = simulate(sim)
    assert result.hit_rate == 0.0
    assert result.estimated_hit_rate == 0.0


def test_the_cli_writes_json(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as exited:
        main(["simulate", "--trace", str(trace), "--num-decode", "2", "--policy", "ttft",
              "--block-size", "4", "--page-size", "2", "--dp-routing-digest-chunk-size", "4",
              "--l1-tokens-per-rank", "64", "--json-out", str(out)])  # fmt: skip
    assert exited.value.code == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["policy"] == "ttft" and result["num_requests"] == 4


def test_trace_tokens_share_exactly_what_the_hash_ids_share(trace: Path) -> None:
    requests = load_trace(trace)
    tokens = TraceTokens(block_size=4, page_size=2)
    r0, _, r2, _ = requests
    assert tokens.token_ids(r0) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert tokens.token_ids(r2) == [4, 5, 6, 7, 12, 13]  # block 3 cut to 2 tokens
    for request in requests:
        expected = page_hashes(tokens.token_ids(request), 2, SIM_NAMESPACE)
        assert tokens.page_hashes(request) == expected
    assert len(tokens.page_hashes(TraceRequest(9, 0.0, 5, 1, (4, 5)))) == 2  # memoized


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile([], 99)) == (50, 99, 0)


@pytest.mark.parametrize("updates", ["events", "poll"])
def test_pushed_events_show_an_eviction_that_a_slow_poll_misses(trace: Path, updates: str) -> None:
    # The eviction trace one second apart, polls every 100 s: only pushed events tell the
    # router, before the repeat of r0 arrives, that r1 and r2 evicted r0's blocks.
    entries = [
        {"timestamp": 1000 * i, "input_length": 8, "output_length": 1, "hash_ids": ids}
        for i, ids in enumerate(([1, 2], [4, 5], [6, 7], [1, 2]))
    ]
    trace.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    sim = config(
        trace, num_decode=1, policy="cache_aware", l1_tokens_per_rank=10, l2_ratio=0.0,
        load_poll_interval_s=100.0, digest_updates=updates,
    )  # fmt: skip
    (result,) = simulate(sim)
    assert result.hit_rate == 0.0
    # Polling: the router still counts r0's prefix as routed there (8 of 32 tokens).
    assert result.estimated_hit_rate == (0.0 if updates == "events" else 8 / 32)
