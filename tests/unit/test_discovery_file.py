"""`--discovery file` and the discovery flags: the rank file's parsing (JSON, YAML, each
malformed shape refused with its reason), the file followed in-process (joins and leaves
by diff, only ranks whose /health answers join, a malformed file keeps the last good set,
a rank on the command line is never removed), and the flag combinations refused."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstrata.config import ConfigError, RouterConfig
from kvstrata.config.server import CLUSTER_KEY_ENV
from kvstrata.router.discovery_file import RankFileError, read_rank_file
from kvstrata.router.discovery_source import DiscoveredRank
from kvstrata.router.state import RouterState
from kvstrata.router.workers import Role

LIVE = {"http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"}


def write(path: Path, ranks: object) -> None:
    path.write_text(ranks if isinstance(ranks, str) else json.dumps(ranks))
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000))  # a change even if fast


def test_read_rank_file_json_and_yaml(tmp_path: Path) -> None:
    path = tmp_path / "ranks.json"
    write(
        path,
        [
            {"url": "http://10.0.0.1:30000/", "role": "prefill"},
            {"url": "http://10.0.0.2:30000", "role": "decode", "rank": 3},
        ],
    )
    assert read_rank_file(path) == {
        DiscoveredRank("http://10.0.0.1:30000", Role.PREFILL, 0),
        DiscoveredRank("http://10.0.0.2:30000", Role.DECODE, 3),
    }
    pytest.importorskip("yaml")
    yaml_path = tmp_path / "ranks.yaml"
    yaml_path.write_text("- url: http://10.0.0.1:30000\n  role: decode\n")
    assert read_rank_file(yaml_path) == {DiscoveredRank("http://10.0.0.1:30000", Role.DECODE)}


def test_without_the_cluster_key_a_found_prefill_rank_is_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As --prefill at start-up: a router without the cluster key cannot hand decode ranks
    a prefill URL, so a discovered prefill rank stays out, said once; decode ranks join."""
    monkeypatch.delenv(CLUSTER_KEY_ENV, raising=False)
    ranks = [
        {"url": "http://10.0.0.1:30000", "role": "decode"},
        {"url": "http://10.0.0.2:30000", "role": "prefill"},
    ]

    async def check(path: Path, urls: Callable[[], list[str]]) -> None:
        await until(lambda: urls() == ["http://10.0.0.1:30000"])
        await asyncio.sleep(0.1)  # several reconciles: still out, and said only once
        assert urls() == ["http://10.0.0.1:30000"]

    errors = follow_file(tmp_path, ranks, check, caplog)
    assert len(errors) == 1 and "http://10.0.0.2:30000" in errors[0], errors
    assert "needs the cluster key" in errors[0]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[{", "not valid JSON"),
        ('{"url": "http://a:1", "role": "decode"}', "not a list"),
        ('[{"url": "http://a:1", "role": "router"}]', "item 0.role"),
        ('[{"url": "http://a:1/v1", "role": "decode"}]', "item 0.url"),
        ('[{"url": "http://a:1", "role": "decode", "port": 1}]', "item 0.port"),
        (
            '[{"url": "http://a:1", "role": "decode"}, {"url": "http://a:1", "role": "prefill"}]',
            "http://a:1 is listed twice",
        ),
    ],
)
def test_malformed_rank_files_are_refused(tmp_path: Path, text: str, reason: str) -> None:
    path = tmp_path / "ranks.json"
    path.write_text(text)
    with pytest.raises(RankFileError, match=reason):
        read_rank_file(path)
    with pytest.raises(RankFileError, match="cannot be read"):
        read_rank_file(tmp_path / "missing.json")


def fake_ranks(request: httpx.Request) -> httpx.Response:
    """Ranks of LIVE answer /health (and /get_load, unhealthy is fine here); others not."""
    if f"{request.url.scheme}://{request.url.netloc.decode()}" not in LIVE:
        raise httpx.ConnectError("refused", request=request)
    return httpx.Response(200, json={"status": "ok"})


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the condition never held")


FileCheck = Callable[[Path, Callable[[], list[str]]], Awaitable[None]]


def follow_file(
    tmp_path: Path,
    ranks: list[dict[str, str]],
    check: FileCheck,
    caplog: pytest.LogCaptureFixture,
    **fields: Any,
) -> list[str]:
    """Run `check(path, urls)` on a router following a rank file that starts as `ranks`;
    returns the router's error log lines."""
    path = tmp_path / "ranks.json"
    write(path, ranks)
    config = RouterConfig(
        discovery="file",
        discovery_file=str(path),
        discovery_poll_interval_s=0.02,
        kv_events=False,
        **fields,
    )
    state = RouterState.build(config, transport=httpx.MockTransport(fake_ranks))

    async def run() -> None:
        state.membership.start()
        try:
            await check(path, lambda: [rank.url for rank in state.workers.ranks])
        finally:
            await state.membership.stop()
            await state.client.aclose()

    with caplog.at_level(logging.INFO, logger="kvstrata.router"):
        asyncio.run(run())
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


def test_the_file_is_followed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ranks = [
        {"url": "http://10.0.0.1:30000", "role": "decode"},
        {"url": "http://10.0.0.9:30000", "role": "decode"},
    ]

    async def check(path: Path, urls: Callable[[], list[str]]) -> None:
        # 10.0.0.9 does not answer /health: it does not join. The CLI rank stays first.
        await until(lambda: urls() == ["http://10.0.0.3:30000", "http://10.0.0.1:30000"])
        write(
            path,
            [
                {"url": "http://10.0.0.2:30000", "role": "prefill"},
                {"url": "http://10.0.0.3:30000", "role": "decode"},
            ],
        )
        await until(lambda: urls() == ["http://10.0.0.2:30000", "http://10.0.0.3:30000"])
        write(path, "[not json")
        await until(lambda: "not valid JSON" in caplog.text)
        await asyncio.sleep(0.1)
        assert urls() == ["http://10.0.0.2:30000", "http://10.0.0.3:30000"]
        write(path, [])  # the CLI rank is not discovery's to remove
        await until(lambda: urls() == ["http://10.0.0.3:30000"])

    errors = follow_file(
        tmp_path,
        ranks,
        check,
        caplog,
        decode=("http://10.0.0.3:30000",),
        cluster_key="a-cluster-key",
    )
    assert len(errors) == 1 and str(tmp_path / "ranks.json") in errors[0], errors
    assert "keeping the last good set (2 ranks)" in errors[0]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({}, "--decode"),
        ({"discovery": "kubernetes"}, "--discovery-label-selector"),
        ({"discovery": "file"}, "--discovery-file"),
        (
            {"discovery": "static", "discovery_file": "x.json", "decode": ("http://a:1",)},
            "--discovery-file",
        ),
        (
            {
                "discovery": "kubernetes",
                "discovery_label_selector": "a=b",
                "wait_for_registrations": True,
            },
            "--wait-for-registrations",
        ),
        (
            {"discovery": "file", "discovery_file": "x", "discovery_poll_interval_s": 0},
            "--discovery-poll-interval-s",
        ),
        ({"discovery": "mdns"}, "--discovery"),
    ],
)
def test_bad_discovery_flags_are_refused(flags: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        RouterConfig(**flags)  # type: ignore[arg-type]


def test_wait_for_registrations_is_discovery_register() -> None:
    config = RouterConfig(wait_for_registrations=True, cluster_key="k")
    assert config.discovery == "register"
    assert RouterConfig(discovery="register", cluster_key="k").wait_for_registrations
