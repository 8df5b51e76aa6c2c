"""Sessions at the router (issue 34) on a real router in front of two real unified CPU
ranks (`launch_cluster`, policy `ttft`): under balanced load each session's turns stay on
one rank and a sub-agent's first turn joins its parent's; a session whose rank is frozen
(SIGSTOP) holding more of its turns than --dp-routing-max-extra-reqs moves to the other
rank, counted in /metrics as overloaded; a bad session header is a 400 naming it."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from pd_harness import PAGE, generate

from kvstrata.cluster.launch import Cluster, launch_cluster
from kvstrata.cluster.launch_config import LaunchConfig

MAX_EXTRA_REQS = 2
RANK_FLAGS = (
    "--page-size",
    str(PAGE),
    "--max-model-len",
    "512",
    "--num-kv-pages",
    "256",
    "--log-level",
    "warning",
)
# No event streams and a long poll timeout: a frozen rank stays healthy in the router's
# view (its polls just wait), so only its load can move a session off it.
ROUTER_OPTIONS = {
    "load_balance_method": "ttft",
    "dp_routing_digest_chunk_size": 2 * PAGE,
    "dp_routing_max_extra_reqs": MAX_EXTRA_REQS,
    "kv_events": False,
    "load_poll_interval_s": 0.1,
    "load_poll_timeout_s": 600.0,
    "log_level": "warning",
}


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = LaunchConfig(
        model=str(tiny_llama),
        num_prefill=0,
        num_decode=2,
        port=0,
        log_dir=str(tmp_path_factory.mktemp("router-sessions-logs")),
    )
    with launch_cluster(config, RANK_FLAGS, ROUTER_OPTIONS) as launched:
        yield launched


@pytest.fixture()
def http(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.router_url, timeout=120) as client:
        yield client


class Session:
    """One agent session: each turn's prompt is the conversation so far plus new tokens."""

    def __init__(self, name: str, rng: random.Random, parent: Session | None = None) -> None:
        self.name, self.rng, self.parent = name, rng, parent
        self.history = list(parent.history) if parent else [rng.randrange(500) for _ in range(96)]

    def prompt(self) -> list[int]:
        return self.history + [self.rng.randrange(500) for _ in range(3)]

    def turn(self, http: httpx.Client, prompt: list[int] | None = None) -> int:
        """Send a turn (default: a new one); the rank that answered it."""
        prompt = self.prompt() if prompt is None else prompt
        headers = {"X-Session-ID": self.name}
        if self.parent is not None:
            headers["X-Parent-Session-ID"] = self.parent.name
        response = generate(http, prompt, **headers)
        assert response.status_code == 200, response.text
        body = response.json()
        self.history = prompt + body["output_ids"]
        return int(body["usage"]["kvstrata"]["rank"])


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    """The router's sample `name` whose labels include `labels` (0 if none)."""
    for line in http.get("/metrics").text.splitlines():
        found = re.fullmatch(r"(\w+)\{(.*)\} (\S+)", line)
        if found is None or found[1] != name:
            continue
        if labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', found[2])).items():
            return float(found[3])
    return 0.0


def counts(http: httpx.Client) -> dict[str, float]:
    """The session routes by outcome and the moves by reason, so far."""
    routes = {
        o: metric(http, "kvstrata_router_session_routes_total", outcome=o)
        for o in ("new", "kept", "parent", "moved")
    }
    moves = {
        r: metric(http, "kvstrata_router_session_moves_total", reason=r)
        for r in ("gone", "unhealthy", "overloaded", "cheaper", "response")
    }
    return routes | moves


def test_turns_stay_on_their_rank_and_a_sub_agent_joins_its_parent(http: httpx.Client) -> None:
    rng = random.Random(34)
    sessions = [Session(f"agent-{i}", rng) for i in range(2)]
    before = counts(http)
    ranks: dict[str, list[int]] = {s.name: [] for s in sessions}
    for _ in range(4):  # one turn of each in turn: the load stays balanced
        for session in sessions:
            ranks[session.name].append(session.turn(http))
    assert all(len(set(r)) == 1 for r in ranks.values()), ranks
    sub_agent = Session("agent-0/sub-0", rng, parent=sessions[0])
    assert sub_agent.turn(http) == ranks["agent-0"][0]
    after = counts(http)
    assert {k: after[k] - before[k] for k in after} == {k: 0 for k in after} | {
        "new": 2,
        "kept": 6,
        "parent": 1,
    }


def test_a_session_leaves_its_overloaded_rank(cluster: Cluster, http: httpx.Client) -> None:
    session = Session("busy", random.Random(35))
    home = session.turn(http)
    other = 1 - home
    frozen = cluster.decode[home].proc
    assert frozen is not None
    before = counts(http)
    held_prompts = [session.prompt() for _ in range(MAX_EXTRA_REQS + 1)]
    os.kill(frozen.pid, signal.SIGSTOP)  # it answers nothing, its turns stay in flight
    try:
        with ThreadPoolExecutor(len(held_prompts)) as pool:
            held = [
                pool.submit(generate, http, p, **{"X-Session-ID": "busy"}) for p in held_prompts
            ]
            wait_inflight(http, cluster.decode[home].url, len(held_prompts))
            # One more than the bound beyond the idle rank: this turn moves.
            assert session.turn(http) == other
            after = counts(http)
            os.kill(frozen.pid, signal.SIGCONT)
            answers = [future.result() for future in held]
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    assert [a.json()["usage"]["kvstrata"]["rank"] for a in answers] == [home] * len(answers)
    assert {k: after[k] - before[k] for k in after} == {k: 0 for k in after} | {
        "kept": MAX_EXTRA_REQS + 1,
        "moved": 1,
        "overloaded": 1,
    }
    # Once the router has polled both ranks since (the frozen rank held every poll up), the
    # session's next turn finds its new home idle and holding its whole conversation.
    wait_load(http, lambda r: r["num_routed_since_poll"] == 0, "polled since")
    assert session.turn(http) == other


def wait_inflight(http: httpx.Client, url: str, num_inflight: int) -> None:
    """Until the router counts `num_inflight` requests in flight at the rank at `url`."""
    wait_load(http, lambda r: r["url"] != url or r["num_inflight"] == num_inflight, "in flight")


def wait_load(http: httpx.Client, condition: Callable[[dict[str, Any]], bool], what: str) -> None:
    """Until `condition` holds for every rank of the router's /get_load (bounded)."""
    deadline_s = time.monotonic() + 60.0
    while True:
        ranks = http.get("/get_load").json()
        if all(condition(rank) for rank in ranks):
            return
        assert time.monotonic() < deadline_s, f"never {what}: {ranks}"
        time.sleep(0.02)


def test_a_bad_session_header_is_a_400_naming_it(http: httpx.Client) -> None:
    response = generate(http, [1, 2, 3], **{"X-Session-ID": "two words"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "x-session-id" in error["message"] and error["code"] == "invalid_session"


def test_session_endpoints_reach_the_home_rank(http: httpx.Client) -> None:
    """GET, prefetch and DELETE of /sessions/{id} at the router reach the rank that served
    the session (which answers as in tests/e2e/test_sessions.py); unknown ones are 404s."""
    session = Session("endpoints-1", random.Random(36))
    rank = session.turn(http)
    info = http.get("/sessions/endpoints-1").json()
    assert info["state"] == "paused" and info["num_turns"] == 1, info
    started = http.post("/sessions/endpoints-1/prefetch").json()
    assert started["num_context_tokens"] == info["num_cached_tokens"], started
    assert http.delete("/sessions/endpoints-1").json()["closed"] is True
    assert http.get("/sessions/endpoints-1").json()["state"] == "closed"
    assert session.turn(http) == rank  # forgotten by the router; the prefix still routes
    assert http.get("/sessions/nobody").status_code == 404
