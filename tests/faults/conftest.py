"""Fixtures of the fault tests: the unified reference (the correctness oracle), a small
tmpfs for storage faults where this host lets us mount one, and the `slow` marker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_cluster import Mount
from fault_load import PAGE_SIZE, Reference


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: a fault scenario taking tens of seconds (deselect: -m 'not slow')"
    )


@pytest.fixture(scope="session")
def reference(tiny_llama: Path) -> Reference:
    return Reference(str(tiny_llama), PAGE_SIZE)


@pytest.fixture(scope="module")
def l3_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    mount = Mount(tmp_path_factory.mktemp("l3") / "pages", "32m")
    yield mount
    mount.unmount()
