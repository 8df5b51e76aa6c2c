"""API hardening in process: the new-connection rate limit on the router and on a rank
(token buckets, 429 with the OpenAI error shape), the router's body size limit, no stack
trace in an error body when an internal error is forced, the default bind address, and a
fuzz-found fix (the router's /flush_cache passing a rank's 400 on)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstrata.__main__ import build_parser
from kvstrata.cluster.launch_config import LaunchConfig
from kvstrata.config import (
    ConfigError,
    EngineConfig,
    RouterConfig,
    ServerConfig,
    config_from_args,
)
from kvstrata.engine.engine import Engine
from kvstrata.http.rate_limit import TokenBuckets
from kvstrata.router.app import build_router_app
from kvstrata.router.state import RouterState
from kvstrata.server.api import build_app
from kvstrata.server.state import ServerState

DECODE = ("http://127.0.0.1:2101",)
IDLE_LOAD = {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_queued_tokens": 0,
             "num_free_pages": 8, "num_cached_pages": 0, "num_used_pages": 0,
             "num_total_pages": 8}  # fmt: skip
ERROR_FIELDS = {"message", "type", "param", "code"}


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_token_buckets_refill_per_second_up_to_the_burst() -> None:
    clock = FakeClock()
    buckets = TokenBuckets(rate_per_s=2.0, burst=3, clock=clock, max_clients=2)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # empty: one token comes in 0.5 s
    assert buckets.take("b") == 0.0  # another client has its own bucket
    clock.now_s += 0.5
    assert buckets.take("a") == 0.0
    clock.now_s += 60.0  # refills, but never beyond the burst
    assert [buckets.take("a") for _ in range(4)][-1] > 0
    buckets.take("c")  # a third client: the least recently used one ("b") is forgotten
    assert "b" not in buckets._buckets and len(buckets._buckets) == 2


def router_app(handler: Any, **options: Any) -> tuple[RouterState, Any]:
    config = RouterConfig(**{"decode": DECODE} | options)
    state = RouterState.build(config, transport=httpx.MockTransport(handler))
    return state, build_router_app(state)


def idle_rank(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/get_load":
        return httpx.Response(200, json=IDLE_LOAD)
    return httpx.Response(200, json={"ok": True})


async def call(app: Any, method: str, path: str, port: int = 1, **kwargs: Any) -> httpx.Response:
    """One request from client port `port` (a distinct port is a distinct connection)."""
    transport = httpx.ASGITransport(app=app, client=("10.0.0.7", port))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        return await client.request(method, path, **kwargs)


def test_router_limits_new_connections_per_client_with_429() -> None:
    state, app = router_app(idle_rank, new_connections_per_s=0.001, new_connections_burst=2)

    async def main() -> None:
        await state.inquirer.poll_once()
        body = {"input_ids": [1, 2]}
        assert (await call(app, "POST", "/generate", port=1, json=body)).status_code == 200
        # A kept-alive connection (same address and port) takes no new token.
        for _ in range(3):
            assert (await call(app, "POST", "/generate", port=1, json=body)).status_code == 200
        assert (await call(app, "POST", "/generate", port=2, json=body)).status_code == 200
        refused = await call(app, "POST", "/generate", port=3, json=body)
        assert refused.status_code == 429
        assert set(refused.json()["error"]) == ERROR_FIELDS
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 1
        assert (await call(app, "GET", "/health", port=4)).status_code == 200  # never limited
        await state.client.aclose()

    asyncio.run(main())


def test_router_refuses_bodies_over_the_limit_declared_or_streamed() -> None:
    state, app = router_app(idle_rank, max_body_bytes=64)

    async def chunks() -> Any:
        for _ in range(10):
            yield b"x" * 16

    async def main() -> None:
        await state.inquirer.poll_once()
        declared = await call(app, "POST", "/generate", content=b"{" + b" " * 100 + b"}")
        streamed = await call(app, "POST", "/v1/completions", content=chunks())
        for response in (declared, streamed):
            assert response.status_code == 413
            assert set(response.json()["error"]) == ERROR_FIELDS
        fits = await call(app, "POST", "/generate", json={"input_ids": [1]})
        assert fits.status_code == 200
        await state.client.aclose()

    asyncio.run(main())


def test_no_stack_trace_in_the_routers_internal_error() -> None:
    def broken_rank(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_load":
            return httpx.Response(200, json=IDLE_LOAD)
        raise RuntimeError("Traceback (most recent call last): a bug in the transport")

    state, app = router_app(broken_rank)

    async def main() -> None:
        await state.inquirer.poll_once()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            response = await client.post("/generate", json={"input_ids": [1, 2]})
        assert response.status_code == 500
        assert response.json()["error"]["code"] == "internal_error"
        assert "Traceback" not in response.text and "bug" not in response.text
        await state.client.aclose()

    asyncio.run(main())


def test_a_rank_has_the_same_gates_and_no_stack_trace_in_its_internal_error(
    tiny_llama: Path,
) -> None:
    engine = Engine(EngineConfig.from_flags(model=str(tiny_llama), page_size=4, num_kv_pages=32))
    config = ServerConfig(new_connections_per_s=0.001, new_connections_burst=2)
    state = ServerState.build(engine, config)
    app = build_app(state)

    def broken_metrics() -> dict[str, float]:
        raise RuntimeError("Traceback (most recent call last): a bug in a cache tier")

    engine.tiers.metrics = broken_metrics  # /metrics asks the tiers on the engine thread

    async def main() -> None:
        state.engine_loop.start()
        try:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://rank") as client:
                response = await client.get("/metrics")
                assert response.status_code == 500
                assert set(response.json()["error"]) == ERROR_FIELDS
                assert "Traceback" not in response.text and "bug" not in response.text
                # The engine survived: the error was the caller's, not the engine's.
                assert (await client.get("/debug/invariants")).json()["ok"] is True
            # Another client address: two new connections fit its burst, a third does not.
            for port in (2, 3):
                assert (await call(app, "GET", "/get_load", port=port)).status_code == 200
            refused = await call(app, "GET", "/get_load", port=4)
            assert refused.status_code == 429
            assert set(refused.json()["error"]) == ERROR_FIELDS
        finally:
            await state.engine_loop.stop()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("fields", "flag"),
    [({"new_connections_per_s": -1.0}, "--new-connections-per-s"),
     ({"new_connections_burst": 0}, "--new-connections-burst")],
)  # fmt: skip
def test_connection_limit_flags_are_checked(fields: dict[str, Any], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        ServerConfig(**fields)
    with pytest.raises(ConfigError, match=flag):
        RouterConfig(decode=DECODE, **fields)


def test_everything_binds_to_loopback_by_default(tmp_path: Path) -> None:
    parser = build_parser()
    serve = parser.parse_args(["serve", "--model", str(tmp_path)])
    router = parser.parse_args(["router", "--decode", "http://127.0.0.1:1"])
    assert config_from_args(ServerConfig, serve).host == "127.0.0.1"
    assert config_from_args(RouterConfig, router).host == "127.0.0.1"
    assert LaunchConfig(model=str(tmp_path)).host == "127.0.0.1"


def test_router_flush_passes_a_bad_request_on_as_400() -> None:
    """Found by fuzzing: a rank's 400 for a malformed ?wait= came back as the router's 502."""

    def picky_rank(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/flush_cache" and request.url.params.get("wait") != "true":
            return httpx.Response(400, json={"error": {"message": "bad wait", "type": "x",
                                                       "param": "wait", "code": None}})  # fmt: skip
        return idle_rank(request)

    state, app = router_app(picky_rank)

    async def main() -> None:
        await state.inquirer.poll_once()
        assert (await call(app, "POST", "/flush_cache?wait=maybe")).status_code == 400
        assert (await call(app, "POST", "/flush_cache?wait=true", port=2)).status_code == 200
        await state.client.aclose()

    asyncio.run(main())
