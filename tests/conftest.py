"""Shared fixtures: tiny random models written once per test session, and a real
`mooncake_master` per test (tests/mooncake_fixtures.py). Every process a test starts
inherits the cluster key of tests/cluster_key.py (`kvstrata launch` hands its children a
generated key of its own instead), dies with pytest, and counts toward the session's
memory bound (tests/suite_guards.py: the peak is printed as SUITE_PEAK_TREE_RSS_GIB)."""

from __future__ import annotations

from pathlib import Path

import cluster_key  # noqa: F401 - sets the cluster key every child process inherits
import pytest
from mooncake_fixtures import mooncake_master  # noqa: F401 - the real-master fixture
from suite_guards import ChildGuard, RssGuard

from kvstrata.model.tiny import make_tiny_model


def pytest_configure(config: pytest.Config) -> None:
    children = ChildGuard()
    children.install()
    memory = RssGuard()
    memory.start()
    config.pluginmanager.register(children, "kvstrata-child-guard")
    config.pluginmanager.register(memory, "kvstrata-rss-guard")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3", seed=1)
