"""The router's log: its own INFO lines, but not httpx's line per /get_load poll (shown at
--log-level debug only). The router runs as a real process in front of a stand-in rank."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_harness import ServerProcess, _free_port
from stand_in_rank import StandInRank

STARTUP_TIMEOUT_S = 60.0
NUM_POLLS = 3


def run_router_polls(log_path: Path, rank: StandInRank, log_level: str) -> str:
    """Start a router on `rank`, wait until it is healthy and has polled NUM_POLLS more
    times, stop it, and return its log."""
    port = _free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstrata", "router", "--decode", rank.url,
             "--port", str(port), "--log-level", log_level, "--load-poll-interval-s", "0.05"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    router = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(router):
            assert proc.poll() is None and time.monotonic() < deadline_s, router.log()
            time.sleep(0.05)
        polls_seen = rank.count("/get_load")
        while rank.count("/get_load") < polls_seen + NUM_POLLS:
            assert time.monotonic() < deadline_s, router.log()
            time.sleep(0.05)
    finally:
        assert router.stop() == 0, router.log()
    return router.log()


def _healthy(router: ServerProcess) -> bool:
    try:
        return httpx.get(router.base_url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("log_level", ["info", "warning"])
def test_polls_are_not_logged_at_info(tmp_path: Path, log_level: str) -> None:
    with StandInRank() as rank:
        log = run_router_polls(tmp_path / "router.log", rank, log_level)
    assert "/get_load" not in log
    assert "HTTP Request" not in log
    if log_level == "info":  # kvstrata's own INFO lines stay
        assert "INFO kvstrata.router: routing on" in log
        assert "is healthy" in log


def test_polls_are_logged_at_debug(tmp_path: Path) -> None:
    with StandInRank() as rank:
        log = run_router_polls(tmp_path / "router.log", rank, "debug")
    assert f"HTTP Request: GET {rank.url}/get_load?" in log
