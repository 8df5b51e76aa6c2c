"""A transfer that fails costs a retry, not the request (`--disaggregation-kv-failure-policy`,
real processes): with the default `retry`, rooms on a prefill rank that is SIGSTOPped or
SIGKILLed mid-room move to the other prefill rank or are recomputed on the decode rank;
every request completes with the unified output, /metrics count cause and outcome, and no
page, lock or room is left behind."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cluster_key import ROUTER_KEY
from fault_cluster import FaultCluster, Proc, wait_for
from fault_load import PAGE_SIZE, Outcome, Reference, generate, judge, serves_correctly

COMMON = ("--page-size", str(PAGE_SIZE), "--max-model-len", "256", "--log-level", "warning")
TRANSFER_TIMEOUT_S = 3.0
PREFILL_URL_HEADER = "X-Kvstrata-Prefill-Url"


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    with FaultCluster(
        tiny_llama, tmp_path_factory.mktemp("policy-logs"),
        prefill_flags=(*COMMON, "--num-kv-pages", "512"),
        decode_flags=(
            *COMMON, "--num-kv-pages", "256", "--disaggregation-decode-enable-radix-cache",
            "--pd-transfer-timeout-s", str(TRANSFER_TIMEOUT_S),
        ),
        router_flags=("--load-poll-timeout-s", "1"), num_prefill=2,
    ) as started:  # fmt: skip
        yield started
        assert not started.tracebacks(), started.tracebacks()


def restart_decode_with(cluster: FaultCluster, *flags: str) -> None:
    """The decode rank again, with `flags` and both prefill ranks as its retry candidates."""
    decode = cluster.decode[0]
    base_argv = cluster.__dict__.setdefault("decode_argv", list(decode.child.argv))
    urls = ",".join(p.url for p in cluster.prefill)
    decode.kill()
    decode.child.argv = [*base_argv, "--prefill-urls", urls, *flags]
    decode.restart()
    cluster.wait_router_sees(decode, healthy=True)


def pinned(
    cluster: FaultCluster, prefill: Proc, num: int, seed: int
) -> tuple[list[threading.Thread], list[Outcome]]:
    """`num` requests sent straight to the decode rank, their first room on `prefill`."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(500) for _ in range(30)] for _ in range(num)]
    results: list[Outcome] = []

    def one(prompt: list[int], stream: bool) -> None:
        headers = {PREFILL_URL_HEADER: prefill.url, **ROUTER_KEY}
        with httpx.Client(base_url=cluster.decode[0].url, timeout=120, headers=headers) as http:
            results.append(generate(http, prompt, stream=stream))

    threads = [threading.Thread(target=one, args=(p, i % 2 == 0)) for i, p in enumerate(prompts)]
    for thread in threads:
        thread.start()
    return threads, results


def joined(threads: list[threading.Thread], results: list[Outcome]) -> list[Outcome]:
    for thread in threads:
        thread.join(90)
    return results


def rooms(cluster: FaultCluster) -> int:
    return cluster.invariants(cluster.decode[0])["counts"]["decode_rooms"]


def failures(cluster: FaultCluster) -> dict[tuple[str, str], float]:
    text = httpx.get(cluster.decode[0].url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("kvstrata_pd_kv_failures{"):
            labels, value = line.rsplit(" ", 1)
            cause = labels.split('cause="')[1].split('"')[0]
            outcome = labels.split('outcome="')[1].split('"')[0]
            out[(cause, outcome)] = float(value)
    return out


@pytest.mark.parametrize("fault", ["sigstop", "sigkill"])
def test_rooms_of_a_failing_prefill_rank_are_retried_on_the_other(
    cluster: FaultCluster, reference: Reference, fault: str
) -> None:
    restart_decode_with(cluster)  # the default policy: retry
    victim = cluster.prefill[1]
    victim.freeze()
    threads, results = pinned(cluster, victim, 4, seed=31)
    wait_for(lambda: rooms(cluster) >= 1, "rooms wait on the frozen rank")
    if fault == "sigkill":
        victim.kill()  # it dies under its rooms: their sends are cut
    kinds = judge(joined(threads, results), reference)
    assert kinds["completed"] == 4, [o.detail for o in results]
    counted = failures(cluster)
    cause = "timeout" if fault == "sigstop" else "unreachable"
    assert counted.get((cause, "retried"), 0) >= 1, counted
    assert all(outcome != "failed" for _, outcome in counted), counted
    cluster.heal()  # a frozen victim confirms the aborts: the old rooms' pages come back
    cluster.settle()
    serves_correctly(cluster.url, reference)
    cluster.settle()


def test_with_no_other_prefill_rank_the_decode_rank_recomputes(
    cluster: FaultCluster, reference: Reference
) -> None:
    restart_decode_with(cluster, "--disaggregation-kv-failure-policy", "recompute")
    victim = cluster.prefill[0]
    victim.kill()
    results = joined(*pinned(cluster, victim, 3, seed=32))
    assert judge(results, reference)["completed"] == 3, [o.detail for o in results]
    for outcome in results:
        usage = outcome.usage["kvstrata"] if outcome.usage else {}
        assert usage["local_prefill_tokens"] > 0 and usage["transferred_tokens"] == 0, usage
    assert failures(cluster).get(("unreachable", "recomputed"), 0) >= 3
    cluster.heal()
    cluster.settle()
    serves_correctly(cluster.url, reference)
    cluster.settle()
