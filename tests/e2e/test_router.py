"""`kvstrata router` in front of two real unified ranks (no prefill ranks: requests go to
them without a prefill URL): every endpoint forwarded like the rank answers it, streaming
passed through, round robin, API keys, a client leaving mid-stream aborting on the rank,
and a killed rank taken out of rotation and back in once it is restarted."""

from __future__ import annotations

import json
import signal
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import (
    SERVER_FLAGS,
    ServerProcess,
    _free_port,
    assert_idle,
    spawn,
    sse_events,
    wait_until_idle,
)

RANK_KEY = "rank-key"
CLIENT_KEY = "client-key"
STARTUP_TIMEOUT_S = 180.0
RANK_AUTH = {"authorization": f"Bearer {RANK_KEY}"}
GREEDY = {"temperature": 0, "max_tokens": 6}


def wait_healthy(*servers: ServerProcess, statuses: tuple[int, ...] = (200,)) -> None:
    """Wait until GET /health answers one of `statuses` on every server."""
    deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
    for server in servers:
        while True:
            assert server.proc.poll() is None, f"exited:\n{server.log()}"
            assert time.monotonic() < deadline_s, f"not healthy in time:\n{server.log()}"
            try:
                if httpx.get(server.base_url + "/health", timeout=5).status_code in statuses:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)


def spawn_rank(model: Path, log_dir: Path, index: int, port: int) -> ServerProcess:
    return spawn(log_dir / f"rank{index}-{port}.log", port, "serve", "--model", str(model),
                 "--rank", str(index), "--api-key", RANK_KEY, *SERVER_FLAGS)  # fmt: skip


def start_router(
    log_dir: Path, ranks: list[ServerProcess], *flags: str, healthy: bool = True
) -> ServerProcess:
    port = _free_port()
    router = spawn(log_dir / f"router-{port}.log", port, "router",
                   "--decode", *(r.base_url for r in ranks), "--log-level", "warning",
                   "--load-poll-interval-s", "0.2", *flags)  # fmt: skip
    wait_healthy(router, statuses=(200,) if healthy else (503,))
    return router


def wait_for(http: httpx.Client, path: str, condition: Any, timeout_s: float = 60.0) -> Any:
    """GET `path` until `condition(json)` holds (bounded) and return that json."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        body = http.get(path).json()
        if condition(body):
            return body
        assert time.monotonic() < deadline_s, f"{path} never satisfied the condition: {body}"
        time.sleep(0.05)


def num_aborted(rank: httpx.Client) -> float:
    lines = rank.get("/metrics").text.splitlines()
    prefix = 'kvstrata_requests_total{finish_reason="abort"} '
    return next((float(line[len(prefix) :]) for line in lines if line.startswith(prefix)), 0.0)


@pytest.fixture(scope="module")
def ranks(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    log_dir = tmp_path_factory.mktemp("router-ranks")
    started = [spawn_rank(tiny_llama, log_dir, i, _free_port()) for i in range(2)]
    try:
        wait_healthy(*started)
        yield started
    finally:
        for rank in started:  # the kill test replaces its rank in this list
            rank.stop()


@pytest.fixture(scope="module")
def router(
    ranks: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    # Round robin, named: the default (auto) would route these caching ranks cache-aware.
    proc = start_router(tmp_path_factory.mktemp("router"), ranks, "--rank-api-key", RANK_KEY,
                        "--load-balance-method", "round_robin")  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture()
def via_router(router: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.base_url, timeout=120) as client:
        yield client


@pytest.fixture()
def direct(ranks: list[ServerProcess]) -> Iterator[list[httpx.Client]]:
    clients = [httpx.Client(base_url=r.base_url, timeout=120, headers=RANK_AUTH) for r in ranks]
    yield clients
    for client in clients:
        client.close()


def without_ids(body: dict[str, Any]) -> dict[str, Any]:
    """A response minus what differs between two calls (ids, timestamps, cache hits)."""
    body = {k: v for k, v in body.items() if k not in ("id", "created")}
    if body.get("usage"):
        body["usage"] = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    return body


def stream_contents(events: list[str]) -> dict[str, Any]:
    """What a stream's `data:` payloads say, whatever the number of events: per choice its
    text, token ids, roles and finish reasons in order; the usage chunks; and the set of
    every other field's values (object, model, ...). A /generate event is its own choice."""
    text: dict[int, str] = defaultdict(str)
    output_ids: dict[int, list[int]] = defaultdict(list)
    roles: dict[int, list[str]] = defaultdict(list)
    finish_reasons: dict[int, list[str]] = defaultdict(list)
    usages, others = [], set()
    for body in (without_ids(json.loads(e)) for e in events if e != "[DONE]"):
        for choice in body.get("choices", [body]):
            index, delta = choice.get("index", 0), choice.get("delta") or {}
            text[index] += choice.get("text") or delta.get("content") or ""
            output_ids[index] += choice.get("output_ids") or []
            if delta.get("role"):
                roles[index].append(delta["role"])
            if choice.get("finish_reason"):
                finish_reasons[index].append(choice["finish_reason"])
        if body.get("usage"):
            usages.append(body["usage"])
        rest = {k: v for k, v in body.items() if k not in _PER_EVENT_FIELDS}
        others.add(json.dumps(rest, sort_keys=True))
    return {
        "text": dict(text), "output_ids": dict(output_ids), "roles": dict(roles),
        "finish_reasons": dict(finish_reasons), "usages": usages, "others": others,
    }  # fmt: skip


_PER_EVENT_FIELDS = ("choices", "text", "output_ids", "finish_reason", "usage")


REQUESTS = [
    ("/generate", {"input_ids": [5, 6, 7, 8],
                   "sampling_params": {"max_new_tokens": 6, "temperature": 0}}),
    ("/v1/completions", {"model": "tiny", "prompt": "The lighthouse", **GREEDY}),
    ("/v1/chat/completions", {"model": "tiny", **GREEDY,
                              "messages": [{"role": "user", "content": "Hi"}]}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body"), REQUESTS, ids=[p for p, _ in REQUESTS])
def test_forwards_like_the_rank_answers(
    via_router: httpx.Client, direct: list[httpx.Client], path: str, body: dict[str, Any]
) -> None:
    routed = via_router.post(path, json=body)
    assert routed.status_code == 200, routed.text
    rank = routed.json()["usage"]["kvstrata"]["rank"]
    expected = direct[rank].post(path, json=body).json()
    assert without_ids(routed.json()) == without_ids(expected)
    bad = body | {"max_tokens": -1, "sampling_params": {"max_new_tokens": -1}}
    refused = via_router.post(path, json=bad)
    assert refused.status_code == 400  # the rank's own answer, passed through
    assert refused.json() == direct[0].post(path, json=bad).json()


def test_streams_pass_through_unchanged(
    via_router: httpx.Client, direct: list[httpx.Client]
) -> None:
    for path, body in REQUESTS:
        stream_body = body | {"stream": True}
        if path != "/generate":  # /generate's last event always carries the usage
            stream_body["stream_options"] = {"include_usage": True}
        with via_router.stream("POST", path, json=stream_body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            routed = list(sse_events(response))
        last = json.loads(routed[-2])
        with direct[last["usage"]["kvstrata"]["rank"]].stream(
            "POST", path, json=stream_body
        ) as resp:
            expected = list(sse_events(resp))
        assert routed[-1] == expected[-1] == "[DONE]"
        # How many events a stream has depends on timing (a rank that streams while the
        # engine runs ahead merges several tokens into one delta), so compare what the
        # events say, not where they were cut.
        assert stream_contents(routed) == stream_contents(expected)


def test_router_endpoints(via_router: httpx.Client, direct: list[httpx.Client]) -> None:
    assert via_router.get("/v1/models").json() == direct[0].get("/v1/models").json()
    health = via_router.get("/health").json()
    assert health == {"status": "ok", "num_healthy_prefill": 0, "num_prefill": 0,
                      "num_healthy_decode": 2, "num_decode": 2}  # fmt: skip
    loads = via_router.get("/get_load").json()
    assert [(r["role"], r["index"], r["healthy"]) for r in loads] == [
        ("decode", 0, True), ("decode", 1, True)
    ]  # fmt: skip
    assert loads[1]["load"]["num_total_pages"] == 512
    info = via_router.get("/server_info").json()
    assert info["role"] == "router" and info["load_balance_method"] == "round_robin"
    assert info["decode_server_info"]["served_model_name"] == "tiny"
    assert "rank_api_key" not in info["router_config"]
    flushed = via_router.post("/flush_cache")
    assert flushed.status_code == 200
    assert [r["status_code"] for r in flushed.json()["ranks"]] == [200, 200]
    assert "kvstrata_router_rank_healthy" in via_router.get("/metrics").text


def test_router_forwards_tokenize_and_model_retrieval(
    via_router: httpx.Client, direct: list[httpx.Client]
) -> None:
    for path, body in (("/tokenize", {"prompt": "The lighthouse"}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/detokenize", {"tokens": [5, 6, 7]}),
                       ("/detokenize", {"tokens": "x"})):  # fmt: skip
        routed = via_router.post(path, json=body)
        expected = direct[0].post(path, json=body)
        assert (routed.status_code, routed.json()) == (expected.status_code, expected.json())
    for model in ("tiny", "other"):
        routed = via_router.get(f"/v1/models/{model}")
        expected = direct[0].get(f"/v1/models/{model}")
        assert (routed.status_code, routed.json()) == (expected.status_code, expected.json())
    assert via_router.get("/v1/models/other").status_code == 404
    assert via_router.get("/version").json() == direct[0].get("/version").json()


def test_round_robin_spreads_requests(via_router: httpx.Client) -> None:
    served = []
    for _ in range(4):
        response = via_router.post(
            "/generate", json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}}
        )
        served.append(response.json()["usage"]["kvstrata"]["rank"])
    assert sorted(served) == [0, 0, 1, 1] and served[0] != served[1]


def test_client_leaving_mid_stream_aborts_on_the_rank(
    via_router: httpx.Client, direct: list[httpx.Client]
) -> None:
    aborted_before = sum(num_aborted(rank) for rank in direct)
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 1000, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    with via_router.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response)  # kept: dropping the iterator would close the stream
        first = json.loads(next(events))
        assert first["choices"][0]["finish_reason"] is None  # still generating
        # Another request finding a busy rank: /flush_cache is refused, naming it.
        assert via_router.post("/flush_cache").status_code == 409
    for rank in direct:  # leaving the with-block closed the connection
        wait_until_idle(rank)
        assert_idle(rank)
    assert sum(num_aborted(rank) for rank in direct) == aborted_before + 1
    wait_for(via_router, "/get_load", lambda ranks: all(r["num_inflight"] == 0 for r in ranks))


def test_api_keys(ranks: list[ServerProcess], tmp_path: Path) -> None:
    guarded = start_router(tmp_path, ranks, "--api-key", CLIENT_KEY, "--rank-api-key", RANK_KEY)
    keyless = start_router(tmp_path, ranks, healthy=False)  # the ranks refuse its polls
    try:
        with httpx.Client(base_url=guarded.base_url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            for headers in ({}, {"authorization": "Bearer wrong"}):
                for method, path in [
                    ("POST", "/generate"),
                    ("GET", "/get_load"),
                    ("GET", "/metrics"),
                ]:
                    resp = http.request(method, path, headers=headers, json={"text": "x"})
                    assert resp.status_code == 401
                    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        client = openai.OpenAI(base_url=guarded.base_url + "/v1", api_key=CLIENT_KEY, max_retries=0)
        completion = client.completions.create(
            model="tiny", prompt="Hello", max_tokens=3, temperature=0
        )
        assert completion.usage.completion_tokens == 3
        wrong = openai.OpenAI(base_url=guarded.base_url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        health = httpx.get(keyless.base_url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["num_healthy_decode"] == 0
        loads = httpx.get(keyless.base_url + "/get_load", timeout=10).json()
        assert all("401" in r["last_error"] for r in loads)
    finally:
        assert guarded.stop() == 0, guarded.log()
        assert keyless.stop() == 0, keyless.log()


def test_a_killed_rank_is_taken_out_and_back_in(
    tiny_llama: Path, ranks: list[ServerProcess], router: ServerProcess,
    via_router: httpx.Client, tmp_path: Path,
) -> None:  # fmt: skip
    # A router that will not poll again: it can only learn of the death by forwarding.
    # Round robin, so that one of its three requests is sent to the dead rank whatever
    # the ranks cached in earlier tests (the default policy follows the cache: order-
    # dependent, and it failed when every request went to rank 0).
    blind = start_router(tmp_path, ranks, "--rank-api-key", RANK_KEY,
                         "--load-poll-interval-s", "3600",
                         "--load-balance-method", "round_robin")  # fmt: skip
    killed = ranks[1]
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait()
    body = {"input_ids": [9, 10, 11], "sampling_params": {"max_new_tokens": 2}}
    try:
        with httpx.Client(base_url=blind.base_url, timeout=60) as http:
            for _ in range(3):  # the dead rank refuses the connection: retried on rank 0
                response = http.post("/generate", json=body)
                assert response.status_code == 200
                assert response.json()["usage"]["kvstrata"]["rank"] == 0
            assert [r["healthy"] for r in http.get("/get_load").json()] == [True, False]
    finally:
        assert blind.stop() == 0, blind.log()

    loads = wait_for(via_router, "/get_load", lambda ranks: not ranks[1]["healthy"])
    assert loads[1]["num_consecutive_failures"] >= 2
    assert via_router.get("/health").json()["num_healthy_decode"] == 1
    for _ in range(3):
        response = via_router.post("/generate", json=body)
        assert response.json()["usage"]["kvstrata"]["rank"] == 0

    port = int(killed.base_url.rsplit(":", 1)[1])
    ranks[1] = spawn_rank(tiny_llama, tmp_path, 1, port)  # same URL: the router knows it
    wait_healthy(ranks[1])
    wait_for(via_router, "/get_load", lambda ranks: ranks[1]["healthy"])
    assert via_router.get("/health").json()["num_healthy_decode"] == 2
    served = {via_router.post("/generate", json=body).json()["usage"]["kvstrata"]["rank"]
              for _ in range(2)}  # fmt: skip
    assert served == {0, 1}
