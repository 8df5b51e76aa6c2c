"""Fixtures of the end-to-end tests: the shared live server and an HTTP client for it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import SERVER_FLAGS, ServerProcess, start_server


@pytest.fixture(scope="session")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server shared by the e2e tests that leave it idle and healthy."""
    proc = start_server(tiny_llama, tmp_path_factory.mktemp("server-logs"), *SERVER_FLAGS)
    yield proc
    status = proc.stop()
    assert status == 0, proc.log()


@pytest.fixture()
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client
