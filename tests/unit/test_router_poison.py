"""The router's containment pieces on CPU, exact: the poison ledger (strikes, quarantine,
time to live, LRU bound), the usage read from a JSON answer split anywhere, the router in
process in front of scripted ranks (a stream opening with an engine failure is not
retried; a mid-stream engine failure counts against the rank), short prompts matched by
the first chunk's routed pages, and the per-client bound keyed by API key."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send
from test_router_breaker import ScriptedRanks, metric_lines
from test_router_proxy import DECODE, IDLE_LOAD, with_router

from kvstrata.kvcache.digest_wire import DigestDelta, DigestReplica
from kvstrata.kvcache.hashing import page_hashes
from kvstrata.router.poison import DIED_HOLDING_IT, ENGINE_FAILURE, PoisonLedger, Strike
from kvstrata.router.policy import RankLoad, RankView, RoutingRequest
from kvstrata.router.prefix import RoutedPages, estimate_prefix
from kvstrata.router.usage import JsonUsage


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_body_is_quarantined_at_its_second_strike_until_the_memory_ends() -> None:
    clock = Clock()
    ledger = PoisonLedger(memory_s=100.0, max_bodies=8, clock=clock)
    assert ledger.strike(b"a", "http://r1", DIED_HOLDING_IT) == (
        Strike("http://r1", DIED_HOLDING_IT),
    )
    assert ledger.quarantine(b"a") is None  # one strike: it may be sent once more
    clock.now_s = 50.0
    ledger.strike(b"a", "http://r2", ENGINE_FAILURE)
    quarantine = ledger.quarantine(b"a")
    assert quarantine is not None and quarantine.num_seconds_left == 100.0
    assert "a connection reset on http://r1 and an engine failure on http://r2" in (
        quarantine.message
    )
    assert ledger.quarantine(b"b") is None  # other bodies are not touched
    clock.now_s = 149.9
    assert ledger.quarantine(b"a") is not None
    clock.now_s = 150.0  # 100 s after the last strike: forgotten
    assert ledger.quarantine(b"a") is None and ledger.strikes(b"a") == () and len(ledger) == 0


def test_the_ledger_forgets_the_least_recently_struck_body_first() -> None:
    clock = Clock()
    ledger = PoisonLedger(memory_s=100.0, max_bodies=2, clock=clock)
    for body in (b"a", b"b"):
        ledger.strike(body, "http://r1", DIED_HOLDING_IT)
    ledger.strike(b"a", "http://r2", DIED_HOLDING_IT)  # a is now the most recent
    ledger.strike(b"c", "http://r1", DIED_HOLDING_IT)
    assert len(ledger) == 2 and ledger.strikes(b"b") == ()
    assert ledger.quarantine(b"a") is not None and len(ledger.strikes(b"c")) == 1


@pytest.mark.parametrize("slice_bytes", [1, 2, 7, 8, 9, 100, 1 << 20])
def test_json_usage_is_read_however_the_answer_is_split(slice_bytes: int) -> None:
    usage = {"prompt_tokens": 9, "kvstrata": {"cached_tokens_l1": 4, "cached_tokens_l2": 3}}
    # Text that spells the key inside a string is escaped, so it cannot be taken for it.
    body = json.dumps({"text": '"usage": {"prompt_tokens": 1}' * 50, "usage": usage,
                       "output_token_logprobs": [[-0.5, 3]] * 2000}).encode()  # fmt: skip
    reader = JsonUsage()
    for start in range(0, len(body), slice_bytes):
        reader.feed(body[start : start + slice_bytes])
    assert reader.usage is not None
    assert (reader.usage.prompt_tokens, reader.usage.l1_tokens, reader.usage.l2_tokens) == (9, 4, 3)


def _engine_failed_event(base: str) -> bytes:
    error = {"message": f"{base}: step failed", "type": "server_error", "param": None,
             "code": "engine_failed"}  # fmt: skip
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


class EngineFailingRanks(ScriptedRanks):
    """DECODE[0]'s streams fail: at once (`at_once`) or after their first token."""

    def __init__(self, at_once: bool) -> None:
        super().__init__()
        self.at_once = at_once

    def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"http://{request.url.host}:{request.url.port}"
        if request.url.path != "/generate" or base != DECODE[0]:
            return super().handle(request)
        self.seen.append(request)
        body = _engine_failed_event(base)
        if not self.at_once:
            body = b'data: {"text": "a"}\n\n' + body
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, stream=httpx.ByteStream(body), headers=headers)


@pytest.mark.parametrize("at_once", [True, False])
def test_a_stream_ending_in_an_engine_failure_is_not_retried(at_once: bool) -> None:
    fake = EngineFailingRanks(at_once)

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/generate", json={"text": "x", "stream": True})
        assert response.status_code == 200
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and error["code"] == "engine_failed"
        if at_once:
            assert DECODE[0] in error["message"] and "not retried" in error["message"]
        assert fake.bases() == [DECODE[0]]
        metrics = (await client.get("/metrics")).text
        assert metric_lines(metrics, "kvstrata_router_retries_total") == []
        assert 'kvstrata_router_poison_events_total{event="engine_failed"} 1.0' in metrics
        ranks = (await client.get("/get_load")).json()
        assert [r["healthy"] for r in ranks] == [False, True]  # it is going down
        assert [r["num_inflight"] for r in ranks] == [0, 0]

    with_router(fake, test, retry_backoff_base_s=0.0)


def _rank_with_digest(index: int, routed_pages: RoutedPages) -> RankView:
    digest = DigestReplica()
    delta = DigestDelta("e", 1, None, True, chunk_size=16, page_size=4, added_l1=(),
                        added_l2=(), removed=(), namespace=bytes(32))  # fmt: skip
    assert digest.apply(delta)
    load = RankLoad.from_json(IDLE_LOAD)
    return RankView(index, f"http://r{index}", True, load, digest=digest,
                    routed_pages=routed_pages.pages)  # fmt: skip


def test_a_prompt_shorter_than_a_chunk_matches_the_pages_routed_there() -> None:
    earlier = list(range(1, 11))  # 10 tokens: 2 full pages of 4, no 16-token chunk
    pages = RoutedPages(max_pages=3)
    pages.add(page_hashes(earlier, 4, bytes(32)))
    rank = _rank_with_digest(0, pages)
    later = RoutingRequest([*earlier, 7, 7, 7])  # the next turn: 3 full pages
    estimate = estimate_prefix(later, rank)
    assert (estimate.matched_tokens, estimate.l1_tokens) == (8, 8)
    assert estimate_prefix(RoutingRequest([9, 9, 9, 9, 9]), rank).matched_tokens == 0
    pages.add(page_hashes([5, 5, 5, 5, 6, 6, 6, 6], 4, bytes(32)))  # 2 more: 1 forgotten
    assert len(pages.pages) == 3
    assert estimate_prefix(later, rank).matched_tokens == 8  # its deepest page is kept


def test_the_per_client_bound_counts_an_api_key_holder_as_one_client() -> None:
    from kvstrata.router.client_limit import ClientInflightLimit

    release = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    async def call(limit: ClientInflightLimit, host: str, key: bytes) -> tuple[int, bytes]:
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        scope = {"type": "http", "path": "/generate", "client": (host, 1234),
                 "headers": [(b"authorization", b"Bearer " + key)]}  # fmt: skip
        await limit(scope, receive_nothing, send)
        return sent[0]["status"], sent[1]["body"]

    async def receive_nothing() -> Message:
        return {"type": "http.request", "body": b""}

    async def main() -> None:
        refused: list[int] = []
        by_key = ClientInflightLimit(app, 1, by_api_key=True, on_refused=lambda: refused.append(1))
        first = asyncio.create_task(call(by_key, "10.0.0.1", b"k"))
        await asyncio.sleep(0)
        status, body = await call(by_key, "10.0.0.2", b"k")  # another address, same key
        assert status == 429 and json.loads(body)["error"]["code"] == "too_many_requests_in_flight"
        assert "API key" in json.loads(body)["error"]["message"] and refused == [1]
        by_address = ClientInflightLimit(app, 1, by_api_key=False)
        second = asyncio.create_task(call(by_address, "10.0.0.1", b"k"))
        await asyncio.sleep(0)
        status, body = await call(by_address, "10.0.0.1", b"k")
        assert status == 429 and "10.0.0.1" in json.loads(body)["error"]["message"]
        other = asyncio.create_task(call(by_address, "10.0.0.2", b"k"))  # another client
        await asyncio.sleep(0)
        release.set()
        assert [await t for t in (first, second, other)] == [(200, b"done")] * 3
        assert by_key.inflight == by_address.inflight == {}  # no entry once none is in flight

    asyncio.run(main())
