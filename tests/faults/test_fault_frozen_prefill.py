"""A frozen prefill rank costs its rooms a bounded wait (issue 27, item 6), real processes:
with the only prefill rank SIGSTOPped, requests on a decode rank whose transfer timeout is
the default 600 s end within --pd-prefill-answer-timeout-s of the freeze, prefilled by the
decode rank itself, with the unified tokens; rooms already waiting on the rank when it
froze are rescued the same way; /metrics counts the cause; nothing is left behind."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cluster_key import ROUTER_KEY
from fault_cluster import FaultCluster, wait_for
from fault_load import PAGE_SIZE, Outcome, Reference, generate, judge, serves_correctly
from test_fault_policy import failures, rooms

COMMON = ("--page-size", str(PAGE_SIZE), "--max-model-len", "256", "--log-level", "warning")
ANSWER_TIMEOUT_S = 2.0
PREFILL_URL_HEADER = "X-Kvstrata-Prefill-Url"


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    with FaultCluster(
        tiny_llama, tmp_path_factory.mktemp("frozen-logs"),
        prefill_flags=(*COMMON, "--num-kv-pages", "512"),
        decode_flags=(
            *COMMON, "--num-kv-pages", "256", "--disaggregation-decode-enable-radix-cache",
            "--pd-prefill-answer-timeout-s", str(ANSWER_TIMEOUT_S),
        ),
        router_flags=("--load-poll-timeout-s", "1"),
    ) as started:  # fmt: skip
        yield started
        assert not started.tracebacks(), started.tracebacks()


def send(cluster: FaultCluster, prompts: list[list[int]]) -> tuple[list[threading.Thread], list]:
    """Each prompt straight to the decode rank, its room named for the prefill rank."""
    results: list[Outcome] = []

    def one(prompt: list[int]) -> None:
        headers = {PREFILL_URL_HEADER: cluster.prefill[0].url, **ROUTER_KEY}
        with httpx.Client(base_url=cluster.decode[0].url, timeout=120, headers=headers) as http:
            results.append(generate(http, prompt, stream=len(results) % 2 == 0))

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    return threads, results


def test_rooms_on_a_frozen_prefill_rank_are_prefilled_here(
    cluster: FaultCluster, reference: Reference
) -> None:
    victim = cluster.prefill[0]
    # Rooms that wait on the rank when it freezes: it is stopped while they are in flight.
    waiting = [[7, 1, 2, 3, *range(20, 40)], [8, 1, 2, 3, *range(40, 60)]]
    victim.freeze()
    threads, results = send(cluster, waiting)
    wait_for(lambda: rooms(cluster) >= 1, "rooms wait on the frozen rank")
    # And rooms sent to it once it is frozen.
    later_threads, later = send(cluster, [[9, 4, 5, *range(60, 90)]])
    for thread in [*threads, *later_threads]:
        thread.join(120)  # well inside the 600 s transfer timeout: bounded by the watch
        assert not thread.is_alive(), "a request still waits on the frozen prefill rank"
    outcomes = results + later
    kinds = judge(outcomes, reference)
    assert kinds["completed"] == 3, [o.detail for o in outcomes]
    for outcome in outcomes:
        usage = outcome.usage["kvstrata"] if outcome.usage else {}
        assert usage["local_prefill_tokens"] > 0 and usage["transferred_tokens"] == 0, usage
    counted = failures(cluster)
    assert counted.get(("unresponsive", "recomputed"), 0) >= 2, counted
    cluster.heal()  # thawed, it confirms the aborts: the rooms' pages come back
    cluster.settle()
    serves_correctly(cluster.url, reference)
    cluster.settle()
