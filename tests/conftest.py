"""Shared fixtures: tiny random models written once per test session, and a real
`mooncake_master` per test (tests/mooncake_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mooncake_fixtures import mooncake_master  # noqa: F401 - the real-master fixture

from kvstrata.model.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3", seed=1)
