"""The version a source tree reports when it runs from PYTHONPATH, without an install (the
GPU box runs it so): pyproject.toml's, not a PackageNotFoundError at start-up."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from kvstrata.version import kvstrata_version


def test_without_distribution_metadata_the_pyproject_version_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    installed = importlib.metadata.version("kvstrata")  # the venv installs this tree
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert kvstrata_version() == installed != "unknown"


def test_the_cli_reports_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvstrata", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"kvstrata {kvstrata_version()}"
