"""One request can only fail itself, at the router (issue 27), with a real router process in
front of scripted stand-in ranks (tests/scripted_rank.py): an attempt that ends in a rank's
engine failure is not retried, and says so; a body whose ranks die holding it reaches two
ranks at most, then identical bodies are refused before any rank sees them; an 85 MB JSON
answer passes through without the router holding it; a client past
--max-inflight-per-client gets 429 while another client is served; a 503 names its ranks."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from cluster_key import ROUTER_KEY, TEST_CLUSTER_KEY
from scripted_rank import USAGE, Answer, Drop, Large, ScriptedRank, error
from server_harness import ServerProcess, _free_port, spawn

OK = Answer(200, {"text": "ok", "usage": USAGE})
FAST = ("--retry-backoff-base-s", "0.01", "--load-balance-method", "round_robin")
ERROR_FIELDS = {"message", "type", "param", "code"}


def start_router(log_dir: Path, urls: list[str], *flags: str) -> ServerProcess:
    """`kvstrata router` over `urls`, once it answers /health (any status)."""
    port = _free_port()
    decode = ("--decode", *urls) if urls else ()
    router = spawn(log_dir / f"router-{port}.log", port, "router", *decode,
                   "--log-level", "warning", "--load-poll-interval-s", "0.1", *flags)  # fmt: skip
    wait(lambda: _answers(router), "the router answers", router)
    return router


def _answers(router: ServerProcess) -> bool:
    try:
        return httpx.get(router.base_url + "/health", timeout=5).status_code in (200, 503)
    except httpx.TransportError:
        return False


def wait(condition: object, what: str, router: ServerProcess, timeout_s: float = 60.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert router.proc.poll() is None, router.log()
        assert time.monotonic() < deadline_s, f"never happened: {what}\n{router.log()}"
        time.sleep(0.02)


@contextmanager
def cluster(tmp_path: Path, ranks: list[ScriptedRank], *flags: str) -> Iterator[ServerProcess]:
    """The ranks up, then a router over them once it sees every one healthy."""
    with ExitStack() as stack:
        for rank in ranks:
            stack.enter_context(rank)
        router = start_router(tmp_path, [r.url for r in ranks], *flags)
        stack.callback(router.stop)
        wait(lambda: all(r["healthy"] for r in load(router)), "every rank healthy", router)
        yield router
        assert "Traceback" not in router.log(), router.log()


def load(router: ServerProcess) -> list[dict[str, object]]:
    return httpx.get(router.base_url + "/get_load", timeout=10).json()


def sample(router: ServerProcess, name: str, **labels: str) -> float:
    """The sum of the router's samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(router.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def posts(ranks: list[ScriptedRank], marker: bytes) -> int:
    return sum(marker in body for rank in ranks for body in rank.posts())


def test_an_engine_failure_is_tried_once_and_says_it_was_not_retried(tmp_path: Path) -> None:
    def script(path: str, body: bytes) -> Answer:
        return error(500, "engine step failed: boom", "engine_failed") if b"poison" in body else OK

    ranks = [ScriptedRank(script), ScriptedRank(script)]
    with cluster(tmp_path, ranks, *FAST, "--breaker-failure-threshold", "1") as router:
        body = {"text": "poison", "sampling_params": {"max_new_tokens": 2}}
        response = httpx.post(router.base_url + "/generate", json=body, timeout=60)
        assert response.status_code == 500, response.text
        failed = response.json()["error"]
        assert set(failed) == ERROR_FIELDS and failed["code"] == "engine_failed"
        assert ranks[0].url in failed["message"] and "boom" in failed["message"]
        assert "not retried" in failed["message"] and "engine failure" in failed["message"]
        assert posts(ranks, b"poison") == 1  # the other rank never saw it
        # The rank's breaker counted it (one failure opens it here).
        assert sample(router, "kvstrata_router_rank_breaker_state", url=ranks[0].url,
                      state="open") == 1  # fmt: skip
        # Sent again by its client, it takes a second rank down, and then no third.
        again = httpx.post(router.base_url + "/generate", json=body, timeout=60)
        assert again.status_code == 500 and ranks[1].url in again.json()["error"]["message"]
        assert "refused" in again.json()["error"]["message"]
        third = httpx.post(router.base_url + "/generate", json=body, timeout=60)
        assert third.status_code == 422 and third.json()["error"]["code"] == "poison_request"
        assert ranks[0].url in third.json()["error"]["message"]
        assert posts(ranks, b"poison") == 2
        assert sample(router, "kvstrata_router_poison_events_total", event="engine_failed") == 2
        assert sample(router, "kvstrata_router_poison_events_total", event="refused") == 1
        assert sample(router, "kvstrata_router_retries_total") == 0


def test_a_body_whose_ranks_die_holding_it_reaches_two_and_is_then_refused(
    tmp_path: Path,
) -> None:
    def script(path: str, body: bytes) -> Answer | Drop:
        return Drop() if b"killer" in body else OK

    ranks = [ScriptedRank(script) for _ in range(3)]
    with cluster(tmp_path, ranks, *FAST) as router:
        body = {"text": "killer", "sampling_params": {"max_new_tokens": 2}}
        response = httpx.post(router.base_url + "/generate", json=body, timeout=60)
        assert response.status_code == 502, response.text
        stopped = response.json()["error"]
        assert set(stopped) == ERROR_FIELDS and stopped["code"] == "poison_request"
        assert posts(ranks, b"killer") == 2  # retried once, then not sent to a third rank
        died = [rank.url for rank in ranks if any(b"killer" in b for b in rank.posts())]
        assert all(url in stopped["message"] for url in died), stopped["message"]
        # Identical bodies are refused for a while without reaching any rank.
        refused = httpx.post(router.base_url + "/generate", json=body, timeout=60)
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["code"] == "poison_request"
        assert all(url in refused.json()["error"]["message"] for url in died)
        assert posts(ranks, b"killer") == 2
        served = httpx.post(router.base_url + "/generate", json={"text": "fine"}, timeout=60)
        assert served.status_code == 200
        assert sample(router, "kvstrata_router_poison_events_total", event="died_holding") == 2
        assert sample(router, "kvstrata_router_poison_events_total", event="quarantined") == 1
        assert sample(router, "kvstrata_router_poison_events_total", event="refused") == 1


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


NUM_LARGE_BYTES = 85 * 1000 * 1000  # the answer: n 128, 1,500 tokens with logprobs


def one_rank_script(path: str, body: bytes) -> Answer | Large:
    """Large answers for bodies naming `large` (cut after 4 MiB for `cut`), answers held
    until released for `hold`, a small one otherwise."""
    if b"large" in body or b"cut" in body:
        return Large(NUM_LARGE_BYTES, cut_after=4 << 20 if b"cut" in body else None)
    return Answer(200, {"text": "held"}, hold=b"hold" in body)


@pytest.fixture(scope="module")
def one_rank(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, ScriptedRank]]:
    rank = ScriptedRank(one_rank_script)
    log_dir = tmp_path_factory.mktemp("one-rank")
    with cluster(log_dir, [rank], "--max-inflight-per-client", "2") as router:
        yield router, rank


def test_a_large_json_answer_passes_through_without_being_held(
    one_rank: tuple[ServerProcess, ScriptedRank],
) -> None:
    router, _ = one_rank
    pid = router.proc.pid
    before, peak_before = rss_bytes(pid), rss_bytes(pid, "VmHWM")
    samples: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            samples.append(rss_bytes(pid))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    num_received, tail = 0, b""
    try:
        with httpx.stream("POST", router.base_url + "/v1/completions",
                          json={"prompt": "large"}, timeout=120) as response:  # fmt: skip
            assert response.status_code == 200
            for chunk in response.iter_raw():
                num_received += len(chunk)
                tail = (tail + chunk)[-4096:]
    finally:
        done.set()
        watcher.join()
    assert num_received == NUM_LARGE_BYTES
    assert tail.endswith(b'"usage": ' + json.dumps(USAGE).encode() + b"}")
    growth = max(max(samples, default=before) - before, rss_bytes(pid, "VmHWM") - peak_before)
    assert growth < NUM_LARGE_BYTES / 8, (growth, before)
    # The usage at the answer's end was read on the way.
    assert sample(router, "kvstrata_router_usage_tokens_total", kind="l1") == 2
    # A rank that fails once bytes went out: the client's answer breaks, it is not cut
    # short into something that reads as whole.
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(router.base_url + "/v1/completions", json={"prompt": "cut"}, timeout=120)
    wait(lambda: all(r["healthy"] for r in load(router)), "a poll took it back", router)
    served = httpx.post(router.base_url + "/v1/completions", json={"prompt": "large"},
                        timeout=120)  # fmt: skip
    assert served.status_code == 200 and len(served.content) == NUM_LARGE_BYTES


def test_a_client_past_its_inflight_bound_gets_429_while_another_is_served(
    one_rank: tuple[ServerProcess, ScriptedRank],
) -> None:
    router, rank = one_rank
    url = router.base_url + "/generate"
    num_seen = len(rank.posts())
    statuses: list[int] = []

    def held() -> None:
        statuses.append(httpx.post(url, json={"text": "hold"}, timeout=120).status_code)

    clients = [threading.Thread(target=held) for _ in range(2)]
    for client in clients:
        client.start()
    try:
        wait(lambda: len(rank.posts()) == num_seen + 2, "both requests reached the rank", router)
        refused = httpx.post(url, json={"text": "one more"}, timeout=60)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert set(refused.json()["error"]) == ERROR_FIELDS
        assert refused.json()["error"]["code"] == "too_many_requests_in_flight"
        assert "127.0.0.1" in refused.json()["error"]["message"]
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        with other:
            served = other.post(url, json={"text": "another client"}, timeout=60)
        assert served.status_code == 200 and served.json() == {"text": "held"}
    finally:
        rank.release_held()
        for client in clients:
            client.join(timeout=60)
    assert statuses == [200, 200]
    assert httpx.post(url, json={"text": "after"}, timeout=60).status_code == 200
    assert sample(router, "kvstrata_router_client_inflight_refusals_total") == 1
    assert len(rank.posts()) == num_seen + 4  # the refused request never reached it
    # The rank is told whom each request counts against (its own bound), with the key.
    named = [headers.get("x-kvstrata-client") for headers in rank.post_headers[num_seen:]]
    assert sorted(named) == ["address:127.0.0.1"] * 3 + ["address:127.0.0.2"]
    assert all(h.get("x-kvstrata-cluster-key") == TEST_CLUSTER_KEY for h in rank.post_headers)


def test_a_503_names_every_rank_and_why(tmp_path: Path) -> None:
    body = {"text": "x"}
    router = start_router(tmp_path, [], "--wait-for-registrations")
    try:
        response = httpx.post(router.base_url + "/generate", json=body, timeout=60)
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "no decode rank is registered"
        dead = [f"http://127.0.0.1:{_free_port()}" for _ in range(2)]  # nothing listens there
        for url in dead:
            joined = httpx.post(router.base_url + "/workers", json={"role": "decode", "url": url},
                                headers=ROUTER_KEY, timeout=60)  # fmt: skip
            assert joined.status_code == 201, joined.text
        wait(lambda: all(r["last_error"] for r in load(router)), "both polled", router)
        response = httpx.post(router.base_url + "/generate", json=body, timeout=60)
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        for url in dead:
            assert re.search(re.escape(url) + r": unhealthy: [^;]*ConnectError", message), message
    finally:
        router.stop()
