"""Retries and circuit breakers of the router: the breaker state machine on an injected
clock, the backoff schedule, and the router app in process in front of scripted ranks
(an httpx MockTransport): what is retried (refused, reset before the answer, 502/503)
and what is not (4xx, 500, a stream broken after its first bytes), the rank a retry
avoids, breakers steering traffic away, and in-flight counts back at zero."""

from __future__ import annotations

import json
import random
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from test_router_proxy import DECODE, PREFILL, SSE_BODY, FakeRanks, with_router

from kvstrata.config import ConfigError, RouterConfig
from kvstrata.router.breaker import BreakerState, CircuitBreakers, Transition
from kvstrata.router.proxy import PREFILL_URL_HEADER
from kvstrata.router.retry import RetryPolicy

FAST_RETRY = {"retry_backoff_base_s": 0.001, "retry_backoff_max_s": 0.001}
URL = "http://rank-a"


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


Made = tuple[CircuitBreakers, Clock, list[Transition]]


def breakers(threshold: int = 3, cooldown_s: float = 10.0) -> Made:
    """Breakers on a clock of their own, and the transitions they reported."""
    clock = Clock()
    made = CircuitBreakers(threshold, cooldown_s, clock)
    seen: list[Transition] = []
    made.on_transition = seen.append
    return made, clock, seen


def fail(b: CircuitBreakers, url: str = URL) -> None:
    b.on_failure(b.on_sent(url))


def test_breaker_opens_after_consecutive_failures_only() -> None:
    b, _, seen = breakers(threshold=3)
    fail(b)
    fail(b)
    b.on_success(b.on_sent(URL))  # a success in between starts the count again
    fail(b)
    fail(b)
    assert b.state(URL) is BreakerState.CLOSED and b.num_consecutive_failures(URL) == 2
    fail(b)
    assert b.state(URL) is BreakerState.OPEN and not b.allows(URL)
    assert seen == [Transition(URL, BreakerState.CLOSED, BreakerState.OPEN)]
    assert b.allows("http://rank-b")  # breakers are per rank


def test_breaker_half_open_lets_one_probe_through_and_it_decides() -> None:
    b, clock, seen = breakers(threshold=1, cooldown_s=10.0)
    fail(b)
    clock.now_s += 9.99
    assert not b.allows(URL)  # still cooling down
    clock.now_s += 0.01
    assert b.allows(URL)
    probe = b.on_sent(URL)
    assert probe.probe and b.state(URL) is BreakerState.HALF_OPEN
    assert not b.allows(URL)  # one probe at a time
    b.on_failure(probe)  # the probe failed: open again, a new cool-down from now
    assert b.state(URL) is BreakerState.OPEN and not b.allows(URL)
    clock.now_s += 10.0
    probe = b.on_sent(URL)
    b.on_abandoned(probe)  # the client left: no verdict, the next request probes
    assert b.state(URL) is BreakerState.HALF_OPEN and b.allows(URL)
    probe = b.on_sent(URL)
    b.on_success(probe)
    assert b.state(URL) is BreakerState.CLOSED and b.allows(URL)
    assert [(t.old.value, t.new.value) for t in seen] == [
        ("closed", "open"), ("open", "half_open"), ("half_open", "open"),
        ("open", "half_open"), ("half_open", "closed"),
    ]  # fmt: skip


def test_outcomes_of_requests_sent_before_the_breaker_opened_move_nothing() -> None:
    b, clock, _ = breakers(threshold=1, cooldown_s=5.0)
    early = b.on_sent(URL)  # in flight while the breaker opens
    fail(b)
    b.on_success(early)
    assert b.state(URL) is BreakerState.OPEN
    clock.now_s += 5.0
    probe = b.on_sent(URL)
    b.on_failure(early)  # not the probe: half-open waits for the probe's verdict
    assert b.state(URL) is BreakerState.HALF_OPEN
    b.on_success(probe)
    assert b.state(URL) is BreakerState.CLOSED


def test_threshold_zero_never_opens() -> None:
    b, _, seen = breakers(threshold=0)
    for _ in range(50):
        fail(b)
    assert b.state(URL) is BreakerState.CLOSED and seen == []


def test_backoff_grows_by_the_multiplier_up_to_the_cap_with_bounded_jitter() -> None:
    exact = RetryPolicy(5, 0.05, 0.1, 1.5, 0.0)
    rng = random.Random(0)
    assert [round(exact.backoff_s(k, rng), 6) for k in (1, 2, 3, 4)] == [0.05, 0.075, 0.1, 0.1]
    jittered = RetryPolicy(5, 1.0, 30.0, 2.0, 0.2)
    waits = [jittered.backoff_s(3, rng) for _ in range(200)]
    assert all(3.2 <= w <= 4.8 for w in waits) and len(set(waits)) > 100


@pytest.mark.parametrize(
    "options",
    [{"retry_max_attempts": 0}, {"breaker_failure_threshold": -1}, {"retry_jitter": 1.0},
     {"retry_backoff_multiplier": 0.5}, {"breaker_cooldown_s": -1.0}],
)  # fmt: skip
def test_bad_retry_options_are_refused_naming_the_flag(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="--" + next(iter(options)).replace("_", "-")):
        RouterConfig(decode=DECODE, **options)


class ScriptedRanks(FakeRanks):
    """FakeRanks whose generation answers can be scripted per rank: a status (with an
    OpenAI error body), a connection reset before the answer, or an SSE stream that
    breaks after its first event."""

    def __init__(self) -> None:
        super().__init__()
        self.status: dict[str, int] = {}
        self.reset: set[str] = set()
        self.break_stream: set[str] = set()
        self.unavailable_stream: set[str] = set()

    def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"http://{request.url.host}:{request.url.port}"
        if request.url.path in ("/get_load", "/flush_cache") or base in self.down:
            return super().handle(request)
        self.seen.append(request)
        if base in self.reset:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        if base in self.status:
            code = self.status[base]
            error = {"message": f"{base} says {code}", "type": "x", "param": None, "code": None}
            return httpx.Response(code, json={"error": error})
        if base in self.unavailable_stream:  # a stream that fails before its first token
            event = {"error": {"message": f"{base} failed", "type": "service_unavailable_error",
                               "param": None, "code": None}}  # fmt: skip
            body = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
            headers = {"content-type": "text/event-stream"}
            return httpx.Response(200, stream=httpx.ByteStream(body), headers=headers)
        if base in self.break_stream:
            headers = {"content-type": "text/event-stream"}
            return httpx.Response(200, stream=_BrokenStream(), headers=headers)
        self.seen.pop()
        return super().handle(request)

    def bases(self) -> list[str]:
        return [f"http://{r.url.host}:{r.url.port}" for r in self.generation_requests()]


class _BrokenStream(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"text": "a"}\n\n'
        raise httpx.ReadError("connection reset by peer")


def metric_lines(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name)]


async def inflight(client: httpx.AsyncClient) -> list[int]:
    return [r["num_inflight"] for r in (await client.get("/get_load")).json()]


def test_a_503_is_retried_on_the_other_rank_with_the_same_body() -> None:
    fake = ScriptedRanks()
    fake.status[DECODE[0]] = 503

    async def test(client: httpx.AsyncClient) -> None:
        body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}'
        response = await client.post("/generate", content=body)
        assert response.status_code == 200 and response.json() == {"served_by": DECODE[1]}
        first, second = fake.generation_requests()
        assert [str(first.url), str(second.url)] == [f"{u}/generate" for u in DECODE]
        assert first.content == second.content == body
        metrics = (await client.get("/metrics")).text
        assert metric_lines(metrics, "kvstrata_router_retries_total") == [
            'kvstrata_router_retries_total{cause="status_503"} 1.0'
        ]
        assert await inflight(client) == [0, 0]
        # A 503 means the rank is up but cannot serve: the breaker counts it, health not.
        assert [r["healthy"] for r in (await client.get("/get_load")).json()] == [True, True]

    with_router(fake, test, **FAST_RETRY)


@pytest.mark.parametrize("status", [400, 404, 413, 500])
def test_a_4xx_or_500_is_the_answer_not_retried(status: int) -> None:
    fake = ScriptedRanks()
    fake.status[DECODE[0]] = status

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == status
        assert DECODE[0] in response.json()["error"]["message"]
        assert fake.bases() == [DECODE[0]]
        metrics = (await client.get("/metrics")).text
        assert metric_lines(metrics, "kvstrata_router_retries_total") == []
        assert await inflight(client) == [0, 0]

    with_router(fake, test, **FAST_RETRY)


def test_when_every_rank_answers_503_the_last_answer_is_relayed() -> None:
    fake = ScriptedRanks()
    fake.status.update({DECODE[0]: 503, DECODE[1]: 502})

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 502
        assert response.json()["error"]["message"] == f"{DECODE[1]} says 502"
        assert fake.bases() == list(DECODE)  # each rank tried once: retries avoid tried ones
        metrics = (await client.get("/metrics")).text
        assert 'kvstrata_router_retries_exhausted_total{cause="status_502"} 1.0' in metrics
        assert await inflight(client) == [0, 0]

    with_router(fake, test, **FAST_RETRY)


def test_attempts_are_bounded_by_retry_max_attempts() -> None:
    fake = ScriptedRanks()
    fake.status[DECODE[0]] = 503

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503 and fake.bases() == [DECODE[0]]

    with_router(fake, test, retry_max_attempts=1, **FAST_RETRY)


@pytest.mark.parametrize("stream", [False, True])
def test_a_reset_before_the_answer_is_retried(stream: bool) -> None:
    fake = ScriptedRanks()
    fake.reset.add(DECODE[0])

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/generate", json={"text": "x", "stream": stream})
        assert response.status_code == 200 and fake.bases() == list(DECODE)
        metrics = (await client.get("/metrics")).text
        assert 'kvstrata_router_retries_total{cause="reset"} 1.0' in metrics
        ranks = (await client.get("/get_load")).json()
        assert [r["healthy"] for r in ranks] == [False, True]  # a broken connection: unhealthy
        assert await inflight(client) == [0, 0]

    with_router(fake, test, **FAST_RETRY)


def test_a_stream_opening_with_a_503_event_is_retried_and_relayed_if_none_is_left() -> None:
    fake = ScriptedRanks()
    fake.unavailable_stream.add(DECODE[0])

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/generate", json={"text": "x", "stream": True})
        assert response.status_code == 200 and response.content == SSE_BODY
        assert fake.bases() == list(DECODE)
        fake.unavailable_stream.add(DECODE[1])
        response = await client.post("/generate", json={"text": "x", "stream": True})
        assert response.headers["content-type"].startswith("text/event-stream")
        assert f"{DECODE[1]} failed" in response.text and response.text.endswith("[DONE]\n\n")
        metrics = (await client.get("/metrics")).text
        assert 'kvstrata_router_retries_total{cause="status_503"} 2.0' in metrics
        assert await inflight(client) == [0, 0]

    with_router(fake, test, **FAST_RETRY)


def test_a_stream_broken_after_its_first_bytes_is_not_retried() -> None:
    fake = ScriptedRanks()
    fake.break_stream.add(DECODE[0])

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/generate", json={"text": "x", "stream": True})
        assert response.status_code == 200
        events = [line[len("data: ") :] for line in response.text.splitlines()
                  if line.startswith("data: ")]  # fmt: skip
        assert events[0] == '{"text": "a"}' and events[-1] == "[DONE]"
        assert json.loads(events[1])["error"]["code"] == "upstream_error"
        assert fake.bases() == [DECODE[0]]
        metrics = (await client.get("/metrics")).text
        assert metric_lines(metrics, "kvstrata_router_retries_total") == []
        assert await inflight(client) == [0, 0]

    with_router(fake, test, **FAST_RETRY)


def test_an_open_breaker_keeps_traffic_away_until_a_probe_succeeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = ScriptedRanks()
    fake.status[DECODE[0]] = 503
    clock = Clock()

    def with_clock(cls: type[CircuitBreakers], config: RouterConfig) -> CircuitBreakers:
        return cls(config.breaker_failure_threshold, config.breaker_cooldown_s, clock)

    monkeypatch.setattr(CircuitBreakers, "of", classmethod(with_clock))

    async def test(client: httpx.AsyncClient) -> None:
        for _ in range(4):  # round robin: every other request tries rank 0 first
            response = await client.post("/v1/completions", json={"prompt": "x"})
            assert response.status_code == 200
        assert fake.bases().count(DECODE[0]) == 2  # the second failure opened it
        metrics = (await client.get("/metrics")).text
        open_line = (f'kvstrata_router_rank_breaker_state{{rank="0",role="decode",'
                     f'state="open",url="{DECODE[0]}"}} 1.0')  # fmt: skip
        assert open_line in metrics
        fake.seen.clear()
        for _ in range(4):  # cooling down: no traffic at all, no retries needed
            assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200
        assert fake.bases() == [DECODE[1]] * 4
        del fake.status[DECODE[0]]  # the rank recovered
        clock.now_s += 60.0
        fake.seen.clear()
        for _ in range(4):
            assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200
        assert fake.bases().count(DECODE[0]) == 2  # probed, closed, back in rotation
        metrics = (await client.get("/metrics")).text
        transitions = metric_lines(metrics, "kvstrata_router_breaker_transitions_total")
        moves = sorted(re.findall(r'from_state="(\w+)".*to_state="(\w+)"', "\n".join(transitions)))
        assert moves == [("closed", "open"), ("half_open", "closed"), ("open", "half_open")]
        assert await inflight(client) == [0, 0]

    with_router(fake, test, load_balance_method="round_robin", breaker_failure_threshold=2,
                **FAST_RETRY)  # fmt: skip


def test_pd_retry_takes_another_decode_and_prefill_rank() -> None:
    fake = ScriptedRanks()
    fake.status[DECODE[0]] = 503
    prefill = (*PREFILL, "http://127.0.0.1:2002")

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/generate", json={"text": "x"})
        assert response.status_code == 200
        first, second = fake.generation_requests()
        assert first.headers[PREFILL_URL_HEADER] != second.headers[PREFILL_URL_HEADER]
        assert await inflight(client) == [0, 0, 0, 0]

    with_router(fake, test, prefill=prefill, **FAST_RETRY)


def test_pd_retry_keeps_the_only_decode_rank_with_another_prefill_rank() -> None:
    prefill = (*PREFILL, "http://127.0.0.1:2002")
    answers = iter([503, None])  # the first room fails (its prefill rank's fault, say)

    class OnceFailing(ScriptedRanks):
        def handle(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/generate":
                code = next(answers, None)
                self.status = {DECODE[0]: code} if code else {}
            return super().handle(request)

    fake = OnceFailing()

    async def test(client: httpx.AsyncClient) -> None:
        assert (await client.post("/generate", json={"text": "x"})).status_code == 200
        first, second = fake.generation_requests()
        assert first.url == second.url == httpx.URL(f"{DECODE[0]}/generate")
        assert {first.headers[PREFILL_URL_HEADER], second.headers[PREFILL_URL_HEADER]} == set(
            prefill
        )

    with_router(fake, test, decode=DECODE[:1], prefill=prefill, **FAST_RETRY)


def test_pd_route_is_never_tried_twice() -> None:
    fake = ScriptedRanks()
    fake.status[DECODE[0]] = 503

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/generate", json={"text": "x"})
        assert response.status_code == 503 and len(fake.generation_requests()) == 1

    with_router(fake, test, decode=DECODE[:1], prefill=PREFILL, **FAST_RETRY)


def test_with_every_breaker_open_a_request_gets_a_503_at_once() -> None:
    fake = ScriptedRanks()
    fake.status.update({DECODE[0]: 503, DECODE[1]: 503})

    async def test(client: httpx.AsyncClient) -> None:
        assert (await client.post("/generate", json={"text": "x"})).status_code == 503
        assert len(fake.generation_requests()) == 2  # each failed once: both open
        response = await client.post("/generate", json={"text": "x"})
        assert response.status_code == 503 and len(fake.generation_requests()) == 2
        error = response.json()["error"]
        assert error["code"] == "no_healthy_rank"
        assert error["message"].count("circuit breaker open") == 2

    with_router(fake, test, breaker_failure_threshold=1, **FAST_RETRY)
