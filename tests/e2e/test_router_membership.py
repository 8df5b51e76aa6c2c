"""Ranks that come and go, with real processes: ranks started with --register-with join
a router that started with none (in --rank order), requests keep being answered while a
rank deregisters on SIGTERM and registers again, a rank killed without deregistering is
removed by health watching, and /workers refuses callers without the cluster key and
every malformed body."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cluster_key import ROUTER_KEY
from server_harness import SERVER_FLAGS, ServerProcess, _free_port, spawn
from test_kv_events import wait_for

PROMPT = list(range(1, 41))


def spawn_rank(model: Path, logs: Path, index: int, router: ServerProcess) -> ServerProcess:
    rank = spawn(logs / f"rank{index}.log", _free_port(), "serve", "--model", str(model),
                 "--rank", str(index), "--register-with", router.base_url,
                 "--register-interval-s", "0.5", *SERVER_FLAGS)  # fmt: skip
    wait_for(f"{rank.base_url}/health", lambda body: body.get("status") == "ok", 180)
    return rank


def workers(router: ServerProcess) -> list[dict[str, Any]]:
    return httpx.get(f"{router.base_url}/workers", headers=ROUTER_KEY, timeout=5).json()


def wait_workers(router: ServerProcess, urls: list[str]) -> list[dict[str, Any]]:
    """Until the router lists exactly `urls`, in that order, all healthy."""
    return wait_for(f"{router.base_url}/get_load", lambda ranks: [
        r["url"] for r in ranks if r["healthy"]] == urls and len(ranks) == len(urls))  # fmt: skip


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("membership")
    proc = spawn(logs / "router.log", _free_port(), "router", "--wait-for-registrations",
                 "--remove-unhealthy-after-s", "1", "--unhealthy-after-failures", "1",
                 "--load-poll-interval-s", "0.2", "--log-level", "info")  # fmt: skip
    try:
        wait_for(f"{proc.base_url}/health", lambda body: body.get("num_decode") == 0)
        yield proc
    finally:
        proc.stop()


def test_workers_needs_the_key_and_a_strict_body(router: ServerProcess) -> None:
    url = f"{router.base_url}/workers"
    good = {"role": "decode", "url": "http://127.0.0.1:9", "rank": 0}
    refused = httpx.post(url, json=good, timeout=5)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_cluster_key"
    assert httpx.get(url, timeout=5).status_code == 401
    assert httpx.delete(f"{url}/decode-1", timeout=5).status_code == 401
    for bad in (
        good | {"extra": 1},
        good | {"role": "router"},
        good | {"url": "ftp://127.0.0.1:9"},
        good | {"url": "http://127.0.0.1:9/v1"},
        good | {"rank": -1},
        good | {"rank": "0"},
        {"role": "decode"},
        [good],
    ):
        response = httpx.post(url, json=bad, headers=ROUTER_KEY, timeout=5)
        assert response.status_code == 400, (bad, response.text)
        assert "error" in response.json()
    missing = httpx.delete(f"{url}/decode-999", headers=ROUTER_KEY, timeout=5)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "worker_id"
    assert workers(router) == []


def test_ranks_register_leave_and_die_under_load(
    router: ServerProcess, tiny_llama: Path, tmp_path: Path
) -> None:
    # Rank 1 first: the router's list is in --rank order, not in order of arrival.
    rank1 = spawn_rank(tiny_llama, tmp_path, 1, router)
    rank0 = spawn_rank(tiny_llama, tmp_path, 0, router)
    ranks = [rank0, rank1]
    try:
        wait_workers(router, [rank0.base_url, rank1.base_url])
        statuses: list[int] = []
        stop = threading.Event()

        def load() -> None:
            # A new prompt each time: a prompt sent again sticks to the rank that has it
            # cached (cache-aware routing), and a rank that joins later would get none.
            with httpx.Client(base_url=router.base_url, timeout=60) as http:
                while not stop.is_set():
                    n = len(statuses)
                    prompt = [3 + n % 500, 3 + n // 500 % 500, *PROMPT[2:]]
                    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}}
                    statuses.append(http.post("/generate", json=body).status_code)

        clients = [threading.Thread(target=load) for _ in range(3)]
        for client in clients:
            client.start()
        try:
            wait_for(f"{router.base_url}/get_load", lambda rs: all(r["num_routed"] for r in rs))
            assert rank1.stop() == 0  # SIGTERM: it deregisters first, then drains
            wait_workers(router, [rank0.base_url])
            assert "removed: deregistered" in router.log()
            ranks[1] = rank1 = spawn_rank(tiny_llama, tmp_path, 1, router)
            wait_workers(router, [rank0.base_url, rank1.base_url])
            num_before = len(statuses)
            wait_for(f"{router.base_url}/get_load", lambda rs: rs[1]["num_routed"] > 0)
            # Routed is not answered yet: the new rank's first requests may still run.
            deadline_s = time.monotonic() + 60
            while len(statuses) <= num_before and time.monotonic() < deadline_s:
                time.sleep(0.05)
            assert len(statuses) > num_before
        finally:
            stop.set()
            for client in clients:
                client.join()
        assert statuses and set(statuses) == {200}, sorted(set(statuses))
        # Killed: no goodbye. Health watching marks it unhealthy, the reaper removes it.
        rank1.proc.send_signal(signal.SIGKILL)
        rank1.proc.wait()
        wait_workers(router, [rank0.base_url])
        assert "removed: unhealthy for" in router.log()
    finally:
        for rank in ranks:
            rank.stop()
