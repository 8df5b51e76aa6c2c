"""The router app in process, in front of scripted ranks (an httpx MockTransport): which
rank gets each request and with which headers, retry past a rank that refuses connections,
503 when nothing is healthy, SSE relayed byte for byte, /flush_cache fan-out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx

from kvstrata.config import RouterConfig
from kvstrata.router.app import build_router_app
from kvstrata.router.proxy import PREFILL_URL_HEADER
from kvstrata.router.state import RouterState

PREFILL = ("http://127.0.0.1:2001",)
DECODE = ("http://127.0.0.1:2101", "http://127.0.0.1:2102")
SSE_BODY = b'data: {"text": "a"}\n\ndata: {"text": "b"}\n\ndata: [DONE]\n\n'
IDLE_LOAD = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_queued_tokens": 0,
             "num_free_pages": 8, "num_cached_pages": 0, "num_used_pages": 0,
             "num_total_pages": 8}  # fmt: skip


class FakeRanks:
    """Scripted ranks: every request is recorded; `down` hosts refuse connections."""

    def __init__(self) -> None:
        self.seen: list[httpx.Request] = []
        self.down: set[str] = set()
        self.flush_status: dict[str, int] = {}

    def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"http://{request.url.host}:{request.url.port}"
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        self.seen.append(request)
        path = request.url.path
        if path == "/get_load":
            return httpx.Response(200, json=IDLE_LOAD)
        if path == "/flush_cache":
            return httpx.Response(self.flush_status.get(base, 200), json={"flushed": True})
        if json.loads(request.content).get("stream"):
            headers = {"content-type": "text/event-stream"}
            return httpx.Response(200, stream=httpx.ByteStream(SSE_BODY), headers=headers)
        return httpx.Response(200, json={"served_by": base})

    def generation_requests(self) -> list[httpx.Request]:
        return [r for r in self.seen if r.url.path not in ("/get_load", "/flush_cache")]


def with_router(fake: FakeRanks, test: Callable[[httpx.AsyncClient], Any], **options: Any) -> None:
    config = RouterConfig(**{"decode": DECODE, "rank_api_key": "rank-key"} | options)
    state = RouterState.build(config, transport=httpx.MockTransport(fake.handle))
    app = build_router_app(state)

    async def main() -> None:
        await state.inquirer.poll_once()  # what the lifespan does first
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            await test(client)
        await state.client.aclose()

    asyncio.run(main())


def test_pd_request_goes_to_a_decode_rank_with_the_prefill_url() -> None:
    fake = FakeRanks()

    async def test(client: httpx.AsyncClient) -> None:
        body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}'
        response = await client.post("/generate?x=1", content=body,
                                     headers={"content-type": "application/json"})  # fmt: skip
        assert response.status_code == 200
        (sent,) = fake.generation_requests()
        assert response.json() == {"served_by": DECODE[0]}
        assert sent.url == f"{DECODE[0]}/generate?x=1"
        assert sent.headers[PREFILL_URL_HEADER] == PREFILL[0]
        assert sent.headers["authorization"] == "Bearer rank-key"
        assert sent.content == body  # passed through untouched

    with_router(fake, test, prefill=PREFILL)


def test_unified_ranks_get_no_prefill_url_and_alternate() -> None:
    fake = FakeRanks()

    async def test(client: httpx.AsyncClient) -> None:
        for _ in range(4):
            response = await client.post("/v1/completions", json={"prompt": "x"})
            assert response.status_code == 200
        sent = fake.generation_requests()
        assert [f"http://{r.url.host}:{r.url.port}" for r in sent] == [*DECODE, *DECODE]
        assert all(PREFILL_URL_HEADER not in r.headers for r in sent)

    with_router(fake, test)


def test_a_rank_refusing_connections_is_skipped_and_marked_unhealthy() -> None:
    fake = FakeRanks()

    async def test(client: httpx.AsyncClient) -> None:
        fake.down.add(DECODE[0])  # went down after the last poll
        for _ in range(3):
            response = await client.post("/v1/chat/completions", json={"messages": []})
            assert response.json() == {"served_by": DECODE[1]}
        ranks = (await client.get("/get_load")).json()
        assert [r["healthy"] for r in ranks] == [False, True]
        assert ranks[0]["last_error"].startswith("connect:")
        assert [r["num_inflight"] for r in ranks] == [0, 0]
        metrics = (await client.get("/metrics")).text
        assert (f'kvstrata_router_upstream_errors_total{{kind="connect",rank="0",'
                f'role="decode",url="{DECODE[0]}"}} 1.0') in metrics  # fmt: skip
        assert (await client.get("/health")).json()["num_healthy_decode"] == 1

    with_router(fake, test)


def test_no_healthy_rank_is_a_503_with_an_openai_error() -> None:
    fake = FakeRanks()
    fake.down.update(DECODE)

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/generate", json={"text": "x"})
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "no_healthy_rank" and "decode" in error["message"]
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["num_healthy_decode"] == 0

    with_router(fake, test)


def test_without_a_healthy_prefill_rank_the_decode_rank_gets_no_prefill_url() -> None:
    fake = FakeRanks()
    fake.down.add(PREFILL[0])

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/generate", json={"text": "x"})
        assert response.json() == {"served_by": DECODE[0]}  # it prefills the prompt itself
        (sent,) = fake.generation_requests()
        assert PREFILL_URL_HEADER not in sent.headers
        metrics = (await client.get("/metrics")).text
        assert 'branch="no_prefill_rank",policy="local_prefill",role="prefill"} 1.0' in metrics

    with_router(fake, test, prefill=PREFILL)


def test_sse_is_relayed_byte_for_byte() -> None:
    fake = FakeRanks()

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/generate", json={"text": "x", "stream": True})
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.content == SSE_BODY

    with_router(fake, test)


def test_flush_cache_reaches_every_rank_and_409_if_one_refuses() -> None:
    fake = FakeRanks()

    async def test(client: httpx.AsyncClient) -> None:
        response = await client.post("/flush_cache?wait=true")
        assert response.status_code == 200 and response.json()["flushed"] is True
        flushes = [r for r in fake.seen if r.url.path == "/flush_cache"]
        assert sorted(str(r.url) for r in flushes) == sorted(
            f"{url}/flush_cache?wait=true" for url in PREFILL + DECODE
        )
        fake.flush_status[DECODE[1]] = 409
        response = await client.post("/flush_cache")
        assert response.status_code == 409
        assert DECODE[1] in response.json()["error"]["message"]
        assert [r["status_code"] for r in response.json()["ranks"]] == [200, 200, 409]

    with_router(fake, test, prefill=PREFILL)


def test_cache_aware_polls_digests_follows_them_and_reads_usage_back() -> None:
    from kvstrata.kvcache.hashing import page_hashes

    seed, prompt = bytes(32), list(range(1, 17))  # pages of 4, chunks of 8: 2 boundaries
    boundaries = page_hashes(prompt, 4, seed)[1::2]
    polls: list[httpx.QueryParams] = []

    class DigestRanks(FakeRanks):
        def handle(self, request: httpx.Request) -> httpx.Response:
            base = f"http://{request.url.host}:{request.url.port}"
            if request.url.path == "/get_load":
                polls.append(request.url.params)
                since = request.url.params.get("digest_version")
                held = boundaries if base == DECODE[1] and since is None else []
                digest = {
                    "epoch": "e1", "version": 3, "full": since is None,
                    "base_version": None if since is None else int(since),
                    "chunk_size": 8, "page_size": 4, "namespace": seed.hex(),
                    "added": [h.hex() for h in held], "added_l2": [], "removed": [],
                }  # fmt: skip
                return httpx.Response(200, json=IDLE_LOAD | {"digest": digest})
            if request.url.path == "/generate":
                self.seen.append(request)
                usage = {"prompt_tokens": 16, "kvstrata": {"cached_tokens_l1": 12,
                         "cached_tokens_l2": 4, "cached_tokens_l3": 0}}  # fmt: skip
                return httpx.Response(200, json={"served_by": base, "usage": usage})
            return super().handle(request)

    # The default, auto, routes cache-aware once ranks serve digests; without --model it
    # matches requests that carry token ids (no tokenizer needed).
    config = RouterConfig(decode=DECODE, dp_routing_digest_chunk_size=8)
    fake = DigestRanks()
    state = RouterState.build(config, transport=httpx.MockTransport(fake.handle))

    async def main() -> None:
        await state.inquirer.poll_once()
        assert all(p.get("digest_chunk_size") == "8" and "digest_version" not in p for p in polls)
        transport = httpx.ASGITransport(app=build_router_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            response = await client.post("/generate", json={"input_ids": prompt})
            assert response.json()["served_by"] == DECODE[1]  # the rank holding the prefix
            metrics = (await client.get("/metrics")).text
            labels = f'rank="1",role="decode",url="{DECODE[1]}"'
            for kind, value in (("estimated", 16), ("l1", 12), ("l2", 4), ("prompt", 16)):
                line = f'kvstrata_router_usage_tokens_total{{kind="{kind}",{labels}}} {value}.0'
                assert line in metrics
            assert 'branch="match",policy="cache_aware",role="decode"' in metrics
        polls.clear()
        await state.inquirer.poll_once()  # now each poll asks for the changes since v3
        assert all(p.get("digest_epoch") == "e1" and p.get("digest_version") == "3"
                   for p in polls)  # fmt: skip
        assert state.workers.decode[1].digest is not None
        assert set(state.workers.decode[1].digest.entries) == set(boundaries)
        await state.client.aclose()

    asyncio.run(main())
