"""Router retries and circuit breakers with real processes. Two unified ranks: one killed
(refusing connections) costs no request; a rank's 400 is the answer, not retried; a rank
SIGKILLed before it answered a JSON request is retried on the other; a rank SIGKILLed
mid-stream is not retried (the client sees the error event). One prefill and two
decode ranks, one of which fails every room (its transfer timeout too short to wait for
any prefill) while it answers its polls: its 503s are retried on the other, its breaker
opens, it gets no requests while open, and a probe closes it once the rank is fixed."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fault_cluster import FaultCluster, Proc, wait_for
from fault_load import PAGE_SIZE, Outcome, Reference, generate, judge

COMMON = ("--page-size", str(PAGE_SIZE), "--max-model-len", "512", "--log-level", "warning")
# Only forwards take a rank out (polls bring it back), so that a dead rank is met by a
# request before the router can know; retries wait little.
ROUTER = ("--load-balance-method", "round_robin", "--unhealthy-after-failures", "1000",
          "--retry-backoff-base-s", "0.01")  # fmt: skip
BROKEN_ROOMS = ("--pd-transfer-timeout-s", "1e-6", "--disaggregation-kv-failure-policy", "fail")
COOLDOWN_S = 2.0


@pytest.fixture(scope="module")
def unified(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    with FaultCluster(
        tiny_llama, tmp_path_factory.mktemp("retry-unified"),
        decode_flags=(*COMMON, "--num-kv-pages", "256"), router_flags=ROUTER,
        num_prefill=0, num_decode=2,
    ) as started:  # fmt: skip
        yield started
        assert not started.tracebacks(), started.tracebacks()


def router_sample(cluster: FaultCluster, name: str, **labels: str) -> float:
    """The sum of the router's samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(cluster.url + "/metrics", timeout=30).text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def retries(cluster: FaultCluster, cause: str | None = None) -> float:
    causes = {} if cause is None else {"cause": cause}
    return router_sample(cluster, "kvstrata_router_retries_total", **causes)


def requests_to(cluster: FaultCluster, url: str) -> float:
    return router_sample(cluster, "kvstrata_router_requests_total", url=url)


def prompts(first: int, count: int) -> list[list[int]]:
    """`count` prompts of 20 token ids (in the tiny model's vocabulary), each its own."""
    return [[(first + 7 * i + j) % 500 for j in range(20)] for i in range(count)]


def test_a_rank_refusing_connections_costs_no_request(
    unified: FaultCluster, reference: Reference
) -> None:
    victim = unified.decode[1]
    before = retries(unified, "connect")
    victim.kill()
    try:
        with httpx.Client(base_url=unified.url, timeout=120) as client:
            outcomes = [generate(client, p, stream=i % 2 == 1)
                        for i, p in enumerate(prompts(0, 4))]  # fmt: skip
        assert judge(outcomes, reference)["completed"] == 4
        assert {o.rank for o in outcomes} == {0}
        # Round robin sent one of them to the dead rank first; it is out after that.
        assert retries(unified, "connect") == before + 1
    finally:
        victim.restart()
    unified.wait_router_sees(victim, healthy=True)
    unified.settle()


def test_a_rank_4xx_is_the_answer(unified: FaultCluster) -> None:
    before = {rank.url: requests_to(unified, rank.url) for rank in unified.decode}
    before_retries = retries(unified)
    body = {"input_ids": [10**9], "sampling_params": {"max_new_tokens": 2}}
    response = httpx.post(unified.url + "/generate", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    after = {rank.url: requests_to(unified, rank.url) for rank in unified.decode}
    assert sum(after.values()) == sum(before.values()) + 1  # one rank saw it, once
    assert retries(unified) == before_retries
    unified.settle()


def serving(cluster: FaultCluster) -> Proc | None:
    """The decode rank the router has requests in flight on, if there is exactly one."""
    loads = cluster.router_load()
    busy = [r for r in cluster.decode
            if any(load["url"] == r.url and load["num_inflight"] for load in loads)]  # fmt: skip
    return busy[0] if len(busy) == 1 else None


def test_a_rank_killed_before_it_answered_json_is_retried(
    unified: FaultCluster, reference: Reference
) -> None:
    """The rank is frozen first, so that it holds its request unanswered (the kernel
    takes the connection and the body) until it is killed: no timing involved."""
    victim = unified.decode[1]
    before = retries(unified, "reset")
    answers: list[Outcome] = []
    victim.freeze()
    with httpx.Client(base_url=unified.url, timeout=120) as client:

        def ask() -> None:  # round robin: one of the two goes to the frozen rank first
            answers.extend(generate(client, p, stream=False) for p in prompts(500, 2))

        asking = threading.Thread(target=ask)
        asking.start()
        wait_for(lambda: serving(unified) is victim, "a request held by the frozen rank")
        victim.kill()
        asking.join(timeout=120)
    assert judge(answers, reference)["completed"] == 2, [a.detail for a in answers]
    assert {answer.rank for answer in answers} == {0}
    assert retries(unified, "reset") == before + 1
    victim.restart()
    unified.wait_router_sees(victim, healthy=True)
    unified.settle()


def test_a_rank_killed_mid_stream_is_not_retried(unified: FaultCluster) -> None:
    """Last of its module: the killed rank stays dead."""
    before = {rank.url: requests_to(unified, rank.url) for rank in unified.decode}
    before_retries = retries(unified)
    body = {
        "input_ids": list(range(30)),
        "stream": True,
        "sampling_params": {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True},
    }
    with (
        httpx.Client(base_url=unified.url, timeout=120) as client,
        client.stream("POST", "/generate", json=body) as response,
    ):
        events = (line[6:] for line in response.iter_lines() if line.startswith("data: "))
        assert "output_ids" in next(events)  # bytes reached the client
        for rank in unified.decode:  # at once: the stream cannot end before the kill
            rank.freeze()
        victim = serving(unified)
        assert victim is not None
        victim.kill()
        for rank in unified.decode:
            rank.thaw()
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert '"upstream_error"' in rest[-2] and "mid-stream" in rest[-2]
    after = {rank.url: requests_to(unified, rank.url) for rank in unified.decode}
    assert after == {url: n + (url == victim.url) for url, n in before.items()}
    assert retries(unified) == before_retries
    unified.settle()


@pytest.fixture(scope="module")
def pd(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    cluster = FaultCluster(
        tiny_llama, tmp_path_factory.mktemp("retry-pd"),
        prefill_flags=(*COMMON, "--num-kv-pages", "512"),
        decode_flags=(*COMMON, "--num-kv-pages", "256"),
        router_flags=(*ROUTER, "--breaker-failure-threshold", "2",
                      "--breaker-cooldown-s", str(COOLDOWN_S)),
        num_prefill=1, num_decode=2,
    )  # fmt: skip
    cluster.decode[1].child.argv += BROKEN_ROOMS
    with cluster.start():
        yield cluster
        assert not cluster.tracebacks(), cluster.tracebacks()


def breaker(cluster: FaultCluster, url: str, state: str) -> bool:
    name = "kvstrata_router_rank_breaker_state"
    return router_sample(cluster, name, url=url, state=state) == 1.0


def test_503s_are_retried_and_open_the_breaker_until_a_probe_succeeds(
    pd: FaultCluster, reference: Reference
) -> None:
    broken = pd.decode[1]
    with httpx.Client(base_url=pd.url, timeout=120) as client:
        # Round robin: rank 0, then the broken rank first for each request (its retry
        # takes rank 0's turn). It answers 503 (a streamed request: a stream that opens
        # with a 503 event), the retry goes to rank 0; the second 503 opens its breaker.
        outcomes = [generate(client, p, stream=i == 1) for i, p in enumerate(prompts(100, 3))]
        assert judge(outcomes, reference)["completed"] == 3
        assert {o.rank for o in outcomes} == {0}
        assert retries(pd, "status_503") == 2
        assert breaker(pd, broken.url, "open")
        num_sent = requests_to(pd, broken.url)
        # Open: round robin's turns for it go to the other rank, no retry needed. Were
        # the cool-down to pass meanwhile, only a probe (counted) could reach it.
        outcomes = [generate(client, p, stream=False) for p in prompts(200, 2)]
        assert judge(outcomes, reference)["completed"] == 2
        probes = router_sample(pd, "kvstrata_router_breaker_transitions_total",
                               url=broken.url, to_state="half_open")  # fmt: skip
        assert requests_to(pd, broken.url) - num_sent == retries(pd) - 2 == probes
        # Fixed and back: after the cool-down, one probe request closes the breaker.
        broken.kill()
        broken.child.argv = broken.child.argv[: -len(BROKEN_ROOMS)]
        broken.restart()
        sent = iter(prompts(300, 1000))

        def closed() -> bool:
            outcome = generate(client, next(sent), stream=False)
            assert judge([outcome], reference)["completed"] == 1
            return breaker(pd, broken.url, "closed")

        wait_for(closed, "the probe closed the breaker", timeout_s=60)
        closings = router_sample(
            pd,
            "kvstrata_router_breaker_transitions_total",
            url=broken.url,
            from_state="half_open",
            to_state="closed",
        )
        assert closings == 1
        served = {generate(client, p, stream=False).rank for p in prompts(400, 2)}
        assert served == {0, 1}  # back in rotation
    pd.settle()
