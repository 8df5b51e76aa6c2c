"""The running kvstrata's version: the installed distribution's, or for a source tree run
from PYTHONPATH (no distribution metadata) the version its pyproject.toml declares."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

# `version = "X"` in pyproject.toml's [project] table (tomllib is not in Python 3.10).
_PROJECT_VERSION = re.compile(r'^\[project\][^\[]*?^version\s*=\s*"([^"]+)"', re.M | re.S)


def kvstrata_version() -> str:
    try:
        return importlib.metadata.version("kvstrata")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        try:
            found = _PROJECT_VERSION.search(pyproject.read_text())
        except OSError:
            found = None
        return found.group(1) if found else "unknown"
