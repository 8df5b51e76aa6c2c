"""Pushed cache events between real processes: a router that polls only once a minute
still sees at once a prefix a rank cached behind its back, a flush that emptied it (new
epoch: the router's copy is cleared), and a rank that was killed and came back (the
stream ends, the router subscribes again and starts from the new epoch's snapshot).
Also: GET /kv_events refuses callers without the cluster key and bad parameters."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cluster_key import ROUTER_KEY
from server_harness import SERVER_FLAGS, ServerProcess, _free_port, spawn

CHUNK = 32
PROMPT = list(range(1, 81))  # 80 tokens: boundaries after 32 and 64
POLL_S = "60"  # the router's polls: far too rare to explain anything seen here


def wait_for(url: str, condition: Any, timeout_s: float = 60.0) -> Any:
    """GET `url` until `condition(json)` holds (bounded) and return that json."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            body = httpx.get(url, timeout=5).json()
            if condition(body):
                return body
        except (httpx.TransportError, ValueError):
            body = None
        assert time.monotonic() < deadline_s, f"{url} never satisfied the condition: {body}"
        time.sleep(0.02)


def spawn_rank(model: Path, logs: Path, port: int) -> ServerProcess:
    rank = spawn(logs / "rank.log", port, "serve", "--model", str(model), *SERVER_FLAGS)
    wait_for(f"{rank.base_url}/health", lambda body: body.get("status") == "ok", 180)
    return rank


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    logs = tmp_path_factory.mktemp("kv-events")
    rank = spawn_rank(tiny_llama, logs, _free_port())
    router = spawn(logs / "router.log", _free_port(), "router", "--decode", rank.base_url,
                   "--model", str(tiny_llama), "--load-balance-method", "cache_aware",
                   "--dp-routing-digest-chunk-size", str(CHUNK),
                   "--load-poll-interval-s", POLL_S, "--log-level", "info")  # fmt: skip
    procs = [rank, router]
    try:
        wait_for(f"{router.base_url}/get_load", lambda ranks: ranks[0]["events_live"])
        yield procs
    finally:
        for proc in procs:  # the restart test replaces the rank in this list
            proc.stop()


def router_rank(router: ServerProcess) -> dict[str, Any]:
    (rank,) = httpx.get(f"{router.base_url}/get_load", timeout=5).json()
    return rank


def generate(url: str) -> dict[str, Any]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_kv_events_needs_the_cluster_key_and_valid_parameters(cluster: list[Any]) -> None:
    rank = cluster[0]
    url = f"{rank.base_url}/kv_events"
    refused = httpx.get(url, timeout=5)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_cluster_key"
    for params, param in (
        ({"digest_chunk_size": 24}, "digest_chunk_size"),  # not a multiple of the page (16)
        ({"digest_chunk_size": 0}, "digest_chunk_size"),
        ({"heartbeat_s": 0}, "heartbeat_s"),
        ({"digest_chunk_size": CHUNK, "since": 3}, "since"),
    ):
        bad = httpx.get(url, params=params, headers=ROUTER_KEY, timeout=5)
        assert bad.status_code == 400, (params, bad.text)
        assert bad.json()["error"]["param"] == param
    other_size = httpx.get(url, params={"digest_chunk_size": 2 * CHUNK}, headers=ROUTER_KEY)
    assert other_size.status_code == 409  # the router streams at CHUNK already


def test_a_prefix_cached_behind_the_routers_back_is_pushed_to_it(cluster: list[Any]) -> None:
    rank, router = cluster
    before = router_rank(router)
    generate(rank.base_url)  # straight to the rank: the router routed nothing
    seen = wait_for(f"{router.base_url}/get_load",
                    lambda ranks: ranks[0]["digest"]["num_entries"] == 2)  # fmt: skip
    (seen,) = seen
    assert seen["digest"]["epoch"] == before["digest"]["epoch"]
    assert seen["digest"]["version"] > before["digest"]["version"]
    assert seen["num_routed"] == 0 and seen["events_live"]
    # Through the router now: cache_aware finds the pushed prefix; the rank serves it.
    usage = generate(router.base_url)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 64


def test_a_flush_clears_the_routers_copy_at_once(cluster: list[Any]) -> None:
    rank, router = cluster
    before = router_rank(router)
    assert before["digest"]["num_entries"] > 0
    assert httpx.post(f"{rank.base_url}/flush_cache?wait=true", timeout=30).status_code == 200
    old_epoch = before["digest"]["epoch"]
    (after,) = wait_for(f"{router.base_url}/get_load",
                        lambda ranks: ranks[0]["digest"]["epoch"] != old_epoch)  # fmt: skip
    assert after["digest"]["num_entries"] == 0 and after["num_routed_prefixes"] == 0


def test_a_restarted_rank_is_followed_from_its_new_snapshot(
    cluster: list[Any], tiny_llama: Path, tmp_path: Path
) -> None:
    rank, router = cluster
    generate(router.base_url)
    (before,) = wait_for(f"{router.base_url}/get_load",
                         lambda ranks: ranks[0]["digest"]["num_entries"] == 2)  # fmt: skip
    port = int(rank.base_url.rsplit(":", 1)[1])
    rank.proc.send_signal(signal.SIGKILL)
    rank.proc.wait()
    wait_for(f"{router.base_url}/get_load", lambda ranks: not ranks[0]["events_live"])
    cluster[0] = spawn_rank(tiny_llama, tmp_path, port)
    (after,) = wait_for(f"{router.base_url}/get_load", lambda ranks: ranks[0]["events_live"]
                        and ranks[0]["digest"]["epoch"] != before["digest"]["epoch"])  # fmt: skip
    assert after["digest"]["num_entries"] == 0 and after["num_routed_prefixes"] == 0
    usage = generate(router.base_url)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # nothing was left to hit
