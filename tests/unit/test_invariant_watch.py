"""/metrics shows the last invariants report and checks again only once it is
--metrics-invariants-interval-s old (the full check walks every page and lock on the engine
thread); GET /debug/invariants always checks, and refreshes what /metrics shows."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from kvstrata.config import ConfigError, EngineConfig, ServerConfig
from kvstrata.engine.engine import Engine
from kvstrata.server.api import build_app
from kvstrata.server.state import ServerState


def scrape_counts(tiny_llama: Path, interval_s: float, paths: list[str]) -> list[int]:
    """The number of full checks made after each GET of `paths`, in order."""
    engine = Engine(EngineConfig.from_flags(model=str(tiny_llama), page_size=4, num_kv_pages=32))
    state = ServerState.build(engine, ServerConfig(metrics_invariants_interval_s=interval_s))
    app = build_app(state)
    checks = []

    async def main() -> None:
        state.engine_loop.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://rank") as client:
                for path in paths:
                    response = await client.get(path)
                    assert response.status_code == 200
                    if path == "/metrics":
                        assert "kvstrata_invariants_ok 1.0" in response.text
                    else:
                        assert response.json()["ok"] is True
                    checks.append(state.invariants.num_checks)
        finally:
            await state.engine_loop.stop()

    asyncio.run(main())
    return checks


def test_metrics_reuse_a_recent_check_and_debug_always_checks(tiny_llama: Path) -> None:
    paths = ["/metrics", "/metrics", "/debug/invariants", "/metrics", "/debug/invariants"]
    assert scrape_counts(tiny_llama, 3600.0, paths) == [1, 1, 2, 2, 3]


def test_interval_zero_checks_at_every_scrape(tiny_llama: Path) -> None:
    assert scrape_counts(tiny_llama, 0.0, ["/metrics", "/metrics", "/metrics"]) == [1, 2, 3]


@pytest.mark.parametrize("interval_s", [-1.0, float("nan")])
def test_a_bad_interval_names_the_flag(interval_s: float) -> None:
    with pytest.raises(ConfigError, match="--metrics-invariants-interval-s"):
        ServerConfig(metrics_invariants_interval_s=interval_s)
