"""Mooncake faults under a steady multi-turn load, on a 1 prefill + 2 decode cluster that
moves KV over the Mooncake Transfer Engine and keeps decode L3 in a Mooncake Store (the
test's own mooncake_master): the master killed and restarted, the master frozen beyond
the prefetch timeout (slow storage), clients leaving while their request waits for L3,
and a decode rank stopped while the prefill rank writes into it (transfer failure)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cluster_key import ROUTER_KEY
from fault_cluster import FaultCluster, wait_for
from fault_load import PAGE_SIZE, Load, Outcome, Reference, generate, judge, serves_correctly
from mooncake_fixtures import MooncakeMaster, require_mooncake

pytestmark = pytest.mark.slow

COMMON = (
    "--page-size", str(PAGE_SIZE), "--max-model-len", "256", "--log-level", "warning",
    "--disaggregation-transfer-backend", "mooncake",
    "--disaggregation-mooncake-config", json.dumps({"timeout_s": 2.0}),
)  # fmt: skip
PREFETCH_TIMEOUT_S = 1.5  # what admission waits for L3; a frozen store answers in 3 s


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    require_mooncake()
    started = MooncakeMaster(tmp_path_factory.mktemp("mooncake-master"))
    started.start()
    yield started
    started.kill()


@pytest.fixture(scope="module")
def cluster(
    tiny_llama: Path, master: MooncakeMaster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FaultCluster]:
    store = master.storage_options(timeout_s=3.0, retry_interval_s=0.5, setup_timeout_s=5.0)
    decode_flags = (
        *COMMON, "--num-kv-pages", "128", "--disaggregation-decode-enable-radix-cache",
        "--disaggregation-decode-enable-hicache", "--disaggregation-decode-hicache-ratio", "0.25",
        "--hicache-storage-backend", "mooncake",
        "--hicache-storage-backend-extra-config", json.dumps(store),
        "--hicache-storage-prefetch-policy", "timeout",
        "--hicache-prefetch-timeout-base-s", str(PREFETCH_TIMEOUT_S),
        "--hicache-prefetch-timeout-per-1k-tokens-s", "0", "--hicache-prefetch-threshold", "8",
    )  # fmt: skip
    with FaultCluster(
        tiny_llama, tmp_path_factory.mktemp("mooncake-logs"),
        prefill_flags=(*COMMON, "--num-kv-pages", "512"), decode_flags=decode_flags,
        router_flags=("--load-poll-timeout-s", "1"), num_decode=2,
    ) as started:  # fmt: skip
        yield started
        assert not started.tracebacks(), started.tracebacks()


def decode_total(cluster: FaultCluster, name: str) -> float:
    """A cache-tier counter summed over the decode ranks."""
    return sum(cluster.metric(rank, f"kvstrata_hicache_{name}") for rank in cluster.decode)


def finish(cluster: FaultCluster, load: Load, reference: Reference) -> None:
    outcomes = load.stop()
    kinds = judge(outcomes, reference)
    assert kinds["completed"] == len(outcomes) > 0, kinds  # storage faults are only misses
    cluster.settle()
    serves_correctly(cluster.url, reference)
    cluster.settle()


def test_master_killed_and_restarted_under_load(
    cluster: FaultCluster, master: MooncakeMaster, reference: Reference
) -> None:
    with Load(cluster.url, num_conversations=4, seed=11) as load:
        wait_for(lambda: load.num_done >= 4, "4 turns before the fault")
        errors = decode_total(cluster, "l3_num_errors") + decode_total(
            cluster, "l3_num_set_failures"
        )
        master.kill()
        try:
            wait_for(
                lambda: decode_total(cluster, "l3_num_errors")
                + decode_total(cluster, "l3_num_set_failures") > errors,
                "L3 calls fail with the master gone",
            )  # fmt: skip
            done = load.num_done
            wait_for(lambda: load.num_done >= done + 4, "4 turns without a master")
        finally:
            master.start()
        num_sets = decode_total(cluster, "l3_num_sets")
        wait_for(lambda: decode_total(cluster, "l3_num_sets") > num_sets,
                 "L3 writes reach the restarted master")  # fmt: skip
    finish(cluster, load, reference)


def test_frozen_master_beyond_the_prefetch_timeout(
    cluster: FaultCluster, master: MooncakeMaster, reference: Reference
) -> None:
    with Load(cluster.url, num_conversations=4, seed=12) as load:
        wait_for(lambda: load.num_done >= 4, "4 turns before the fault")
        timeouts = decode_total(cluster, "prefetch_timeouts")
        master.freeze()  # every store call now takes its full 3 s timeout
        try:
            wait_for(lambda: decode_total(cluster, "prefetch_timeouts") > timeouts,
                     "admission stops waiting for the frozen store")  # fmt: skip
            done = load.num_done
            wait_for(lambda: load.num_done >= done + 4, "4 turns with the store frozen")
        finally:
            master.thaw()
    finish(cluster, load, reference)


def test_clients_leaving_while_waiting_for_l3(
    cluster: FaultCluster, master: MooncakeMaster, reference: Reference
) -> None:
    leave = threading.Event()

    def client(seed: int) -> None:
        body = {"input_ids": [(seed * 7 + i) % 500 for i in range(40)], "stream": True,
                "sampling_params": {"max_new_tokens": 20, "temperature": 0}}  # fmt: skip
        with (
            httpx.Client(base_url=cluster.url, timeout=120) as http,
            http.stream("POST", "/generate", json=body) as response,
        ):
            assert response.status_code == 200
            leave.wait(60)  # then the connection closes: the request is aborted

    def num_prefetches() -> int:
        return sum(cluster.invariants(rank)["counts"]["prefetches"] for rank in cluster.decode)

    master.freeze()
    try:
        clients = [threading.Thread(target=client, args=(seed,)) for seed in range(4)]
        for thread in clients:
            thread.start()
        wait_for(lambda: num_prefetches() > 0, "a request waits for its L3 prefetch")
        leave.set()
        for thread in clients:
            thread.join(60)
    finally:
        master.thaw()
    cluster.settle()
    serves_correctly(cluster.url, reference)
    cluster.settle()


def test_transfer_into_a_stopped_decode_rank(cluster: FaultCluster, reference: Reference) -> None:
    """Rooms of decode rank 1 wait on a frozen prefill rank; decode rank 1 is stopped
    (SIGSTOP) and the prefill rank thawed, so it writes into a receiver that cannot
    answer. Each write fails in bounded time or lands, off the prefill rank's engine
    thread (which keeps serving the other rooms meanwhile); once rank 1 resumes, its
    requests complete exactly or fail clearly."""
    victim, prefill = cluster.decode[1], cluster.prefill[0]
    results: list[Outcome] = []

    def pinned(seed: int) -> None:  # straight to rank 1, its room on the prefill rank
        headers = {"X-Kvstrata-Prefill-Url": prefill.url, **ROUTER_KEY}
        with httpx.Client(base_url=victim.url, timeout=120, headers=headers) as http:
            prompt = [(seed * 11 + i) % 500 for i in range(40)]
            results.append(generate(http, prompt, stream=seed % 2 == 0))

    with Load(cluster.url, num_conversations=2, seed=13) as load:
        wait_for(lambda: load.num_done >= 4, "4 turns before the fault")
        prefill.freeze()
        try:
            clients = [threading.Thread(target=pinned, args=(seed,)) for seed in range(3)]
            for thread in clients:
                thread.start()
            wait_for(lambda: cluster.invariants(victim)["counts"]["decode_rooms"] >= 3,
                     "3 rooms of rank 1 wait on the prefill rank")  # fmt: skip
            victim.freeze()
            prefill.thaw()
            load.request_stop()
            # Idle: every write into the stopped receiver failed (bounded) or landed.
            wait_for(lambda: cluster.idle(prefill), "the prefill rank is idle")
        finally:
            prefill.thaw()
            victim.thaw()
        for thread in clients:
            thread.join(120)
        outcomes = load.stop()
    judge(outcomes + results, reference)  # exact, or a clear error
    assert len(results) == 3
    cluster.settle()
    serves_correctly(cluster.url, reference)
    cluster.settle()
