"""Shared fixtures: tiny random models written once per test session, and a real
`mooncake_master` per test (tests/mooncake_fixtures.py). Every process a test starts
inherits the cluster key of tests/cluster_key.py (`kvstrata launch` hands its children a
generated key of its own instead)."""

from __future__ import annotations

from pathlib import Path

import cluster_key  # noqa: F401 - sets the cluster key every child process inherits
import pytest
from mooncake_fixtures import mooncake_master  # noqa: F401 - the real-master fixture

from kvstrata.model.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3", seed=1)
