"""The suite's own layout: pytest imports test modules by basename (the test folders are
not packages), so two test files with one name make collection fail for the whole run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_names_are_unique() -> None:
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert not [name for name, count in names.items() if count > 1]
