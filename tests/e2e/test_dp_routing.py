"""Cache-aware DP routing on a real 1 prefill + 3 decode cluster (decode radix cache on):
each conversation's turns follow the rank that served its previous turn without the
override firing, round robin over the same ranks hits visibly less, and a killed decode
rank stops getting requests while the others keep answering exactly like unified
greedy generation."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pd_harness import PAGE, generate, unified

from kvstrata.cluster.launch import Cluster, launch_cluster
from kvstrata.cluster.launch_config import LaunchConfig

CHUNK = 2 * PAGE
NUM_CONVERSATIONS = 4  # not a multiple of the 3 ranks: round robin moves each turn
NUM_TURNS = 3
RANK_FLAGS = ("--page-size", str(PAGE), "--max-model-len", "512", "--num-kv-pages", "256",
              "--disaggregation-decode-enable-radix-cache", "--log-level", "warning")  # fmt: skip
ROUTER_OPTIONS = {"load_balance_method": "cache_aware", "dp_routing_digest_chunk_size": CHUNK,
                  "dp_routing_max_extra_reqs": 2, "load_poll_interval_s": 0.1,
                  "log_level": "warning"}  # fmt: skip


@dataclass
class Turn:
    conversation: int
    prompt: list[int]
    output_ids: list[int]
    rank: int
    cached_tokens: int


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = LaunchConfig(model=str(tiny_llama), num_prefill=1, num_decode=3, port=0,
                          log_dir=str(tmp_path_factory.mktemp("dp-routing-logs")))  # fmt: skip
    with launch_cluster(config, RANK_FLAGS, ROUTER_OPTIONS) as launched:
        yield launched


def run_conversations(base_url: str, seed: int, concurrent: bool = True) -> list[Turn]:
    """NUM_CONVERSATIONS chats, turn by turn: each turn of all of them at once (or one
    after the other, in conversation order); a turn's prompt is the conversation so far
    (prompts and answers) plus new tokens."""
    rng = random.Random(seed)
    histories: list[list[int]] = [[] for _ in range(NUM_CONVERSATIONS)]
    turns: list[Turn] = []
    num_threads = NUM_CONVERSATIONS if concurrent else 1
    with (
        httpx.Client(base_url=base_url, timeout=120) as http,
        ThreadPoolExecutor(num_threads) as pool,
    ):
        for _ in range(NUM_TURNS):
            prompts = [h + [rng.randrange(500) for _ in range(rng.randrange(9, 20))]
                       for h in histories]  # fmt: skip
            responses = list(pool.map(lambda p: generate(http, p), prompts))
            for conversation, (prompt, response) in enumerate(zip(prompts, responses)):
                assert response.status_code == 200, response.text
                body = response.json()
                usage = body["usage"]
                turns.append(Turn(conversation, prompt, body["output_ids"],
                                  usage["kvstrata"]["rank"],
                                  usage["prompt_tokens_details"]["cached_tokens"]))  # fmt: skip
                histories[conversation] = prompt + body["output_ids"]
    return turns


def hit_rate(turns: list[Turn]) -> float:
    return sum(t.cached_tokens for t in turns) / sum(len(t.prompt) for t in turns)


def assert_unified_outputs(model: Path, turns: list[Turn]) -> None:
    expected = unified(model, [t.prompt for t in turns])
    assert [t.output_ids for t in turns] == expected


def decisions(router_url: str) -> dict[str, float]:
    """kvstrata_router_decisions_total by branch, for decode ranks."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{router_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvstrata_router_decisions_total{") and 'role="decode"' in line:
            branch = line.split('branch="')[1].split('"')[0]
            counts[branch] = counts.get(branch, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def start_round_robin_router(cluster: Cluster, log_dir: Path) -> tuple[subprocess.Popen, str]:
    """A second router over the same ranks, routing round robin."""
    from kvstrata.cluster.launch import _free_port

    port = _free_port("127.0.0.1")
    log = (log_dir / "round-robin-router.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstrata", "router", "--prefill", *cluster.prefill_urls,
         "--decode", *cluster.decode_urls, "--load-balance-method", "round_robin",
         "--log-level", "warning", "--port", str(port),
         *cluster.router_key_argv],  # the launched cluster's key (a file), not the tests' own
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline_s = time.monotonic() + 120
    while time.monotonic() < deadline_s:
        assert proc.poll() is None, (log_dir / "round-robin-router.log").read_text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the round-robin router did not start")


def test_turns_follow_their_conversation_and_round_robin_hits_less(
    cluster: Cluster, tiny_llama: Path, tmp_path: Path
) -> None:
    aware = run_conversations(cluster.router_url, seed=1)
    by_conversation = {c: [t for t in aware if t.conversation == c]
                       for c in range(NUM_CONVERSATIONS)}  # fmt: skip
    for turns in by_conversation.values():
        assert len({t.rank for t in turns}) == 1, [t.rank for t in turns]  # never moved
        assert all(t.cached_tokens > 0 for t in turns[1:])  # and hit its own history
    branches = decisions(cluster.router_url)
    assert branches.get("override", 0) == 0  # at most 2 requests apart: within the bound
    assert branches["match"] == NUM_CONVERSATIONS * (NUM_TURNS - 1)
    assert_unified_outputs(tiny_llama, aware)

    assert httpx.post(f"{cluster.router_url}/flush_cache", timeout=60).status_code == 200
    proc, url = start_round_robin_router(cluster, tmp_path)
    try:
        # One request at a time, so the order (and the rank of each turn) is fixed: turn t
        # of conversation c is request 4t + c, on rank (4t + c) mod 3, never its last one.
        scattered = run_conversations(url, seed=2, concurrent=False)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert_unified_outputs(tiny_llama, scattered)
    assert [t.rank for t in scattered] == [i % 3 for i in range(len(scattered))]
    assert hit_rate(aware) > 0.4 and hit_rate(scattered) < hit_rate(aware) / 4, (
        hit_rate(scattered), hit_rate(aware),
    )  # fmt: skip


def test_a_killed_decode_rank_gets_no_more_requests(cluster: Cluster, tiny_llama: Path) -> None:
    # Run last in this module: it leaves the cluster with two decode ranks.
    doomed = cluster.decode[2]
    assert doomed.proc is not None
    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait()
    turns = run_conversations(cluster.router_url, seed=3)
    assert {t.rank for t in turns} <= {0, 1}
    assert_unified_outputs(tiny_llama, turns)
    loads = httpx.get(f"{cluster.router_url}/get_load", timeout=10).json()
    assert [r["healthy"] for r in loads if r["role"] == "decode"] == [True, True, False]
