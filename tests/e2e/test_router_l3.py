"""L3-aware routing with real processes: two unified ranks write through to one shared
L3 directory; the `ttft` router learns each rank's store from its events. A prompt's
prefix is cached on rank X (L1, and L3 by write-through); while X owes the prefill of a
long request, the next request with that prefix goes to the idle rank, which restores the
prefix from L3 (usage.cached_tokens_l3) instead of computing it. Also: the rank-to-rank
`POST /hicache/storage/exists` needs the cluster key and a strict body."""

from __future__ import annotations

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

from kvstrata.kvcache.hashing import page_hashes

PAGE, CHUNK = 16, 64
PREFIX = list(range(1, 257))  # 16 pages, 4 chunks
L3_FLAGS = ("--enable-hierarchical-cache", "--hicache-ratio", "4",
            "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy",
            "wait_complete", "--hicache-prefetch-threshold", str(PAGE))  # fmt: skip
# The router's costs: prefill 1 ms/token, an L3 read 0.01 ms/token, leaving the rank
# with the longest match charged half a prefill of it (so the long request stays on X):
# the third request costs 0.24 s on X (200 tokens owed + 40 new), 0.17 s on the idle rank.
ROUTER_FLAGS = ("--load-balance-method", "ttft", "--ttft-prefill-tokens-per-s", "1000",
                "--ttft-l3-tokens-per-s", "100000", "--ttft-reuse-weight", "0.5",
                "--no-ttft-calibrate", "--dp-routing-digest-chunk-size", str(CHUNK))  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    logs = tmp_path_factory.mktemp("router-l3")
    l3_dir = logs / "l3"
    ranks = [
        spawn(logs / f"rank{i}.log", _free_port(), "serve", "--model", str(tiny_llama),
              "--rank", str(i), *SERVER_FLAGS, *L3_FLAGS, "--hicache-storage-dir", str(l3_dir))
        for i in range(2)
    ]  # fmt: skip
    procs = list(ranks)
    try:
        for rank in ranks:
            wait_for(f"{rank.base_url}/health", lambda body: body.get("status") == "ok", 180)
        router = spawn(logs / "router.log", _free_port(), "router", "--model", str(tiny_llama),
                       "--decode", *(r.base_url for r in ranks), *ROUTER_FLAGS)  # fmt: skip
        procs.append(router)
        wait_for(f"{router.base_url}/get_load", lambda rs: all(
            r["events_live"] and r["load"]["l3_store"] for r in rs))  # fmt: skip
        yield [*ranks, router]
    finally:
        for proc in procs:
            proc.stop()


def generate(url: str, prompt: list[int], max_new_tokens: int) -> dict[str, Any]:
    sampling = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    body = {"input_ids": prompt, "sampling_params": sampling}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def prefix_hashes(rank: ServerProcess) -> list[str]:
    load = httpx.get(f"{rank.base_url}/get_load", params={"digest_chunk_size": CHUNK}).json()
    namespace = bytes.fromhex(load["digest"]["namespace"])
    return [h.hex() for h in page_hashes(PREFIX, PAGE, namespace)]


def test_exists_needs_the_key_and_a_strict_body(cluster: list[Any]) -> None:
    url = f"{cluster[0].base_url}/hicache/storage/exists"
    hashes = prefix_hashes(cluster[0])
    assert httpx.post(url, json={"page_hashes": hashes}).status_code == 401
    for bad in ({"page_hashes": hashes, "x": 1}, {"page_hashes": ["zz"]}, {"page_hashes": "ab"},
                {"page_hashes": [h.upper() for h in hashes[:1]]}, {}):  # fmt: skip
        response = httpx.post(url, json=bad, headers=ROUTER_KEY)
        assert response.status_code == 400, (bad, response.text)
    answer = httpx.post(url, json={"page_hashes": hashes}, headers=ROUTER_KEY).json()
    assert answer["num_pages"] == 0 and answer["store"].startswith("file:")


def test_an_l3_held_prefix_goes_to_the_idle_rank_and_is_restored_there(
    cluster: list[Any],
) -> None:
    *ranks, router = cluster
    stores = {r["load"]["l3_store"] for r in httpx.get(f"{router.base_url}/get_load").json()}
    assert len(stores) == 1  # one shared directory: one store
    first = generate(router.base_url, [*PREFIX, *range(400, 410)], 2)
    x = first["usage"]["kvstrata"]["rank"]
    url = f"{ranks[x].base_url}/hicache/storage/exists"
    hashes = prefix_hashes(ranks[x])
    body = {"page_hashes": hashes}
    # Write-through to L3 runs in the background: wait (bounded) until the store holds it.
    deadline_s = time.monotonic() + 60
    while httpx.post(url, json=body, headers=ROUTER_KEY).json()["num_pages"] < len(hashes):
        assert time.monotonic() < deadline_s, "the prefix never reached L3"
        time.sleep(0.02)
    # The router counts the first request as seen by X once X's stream settles.
    wait_for(f"{router.base_url}/get_load", lambda rs: rs[x]["num_routed_since_poll"] == 0)
    # A long request with the prefix: X holds it in L1, so it goes there and stays long.
    long_answer: dict[str, Any] = {}
    long_request = threading.Thread(target=lambda: long_answer.update(
        generate(router.base_url, [*PREFIX, *range(200, 400)], 560)))  # fmt: skip
    long_request.start()
    try:
        wait_for(f"{router.base_url}/get_load", lambda rs: rs[x]["num_inflight"] == 1)
        third = generate(router.base_url, [*PREFIX, *range(420, 460)], 2)
        still_running = long_request.is_alive()
    finally:
        long_request.join()
    assert long_answer["usage"]["kvstrata"]["rank"] == x
    assert still_running, "the long request ended before the third was routed"
    usage = third["usage"]
    assert usage["kvstrata"]["rank"] == 1 - x, usage
    assert usage["kvstrata"]["cached_tokens_l3"] >= CHUNK * 3, usage
