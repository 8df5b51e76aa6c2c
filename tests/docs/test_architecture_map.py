"""docs/architecture.md names every module of the package: in a row of its own
(`kvstrata/pkg/mod.py`) or in its folder's row (`kvstrata/pkg/` ... `mod.py`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\|\s*`(?P<path>kvstrata/[^`]*)`\s*\|(?P<rest>.*)$")


def unlisted_modules(doc: str, root: Path) -> list[str]:
    rows: dict[str, str] = {}
    for line in doc.splitlines():
        row = ROW.match(line)
        if row is not None:
            rows[row["path"]] = rows.get(row["path"], "") + row["rest"]
    missing = []
    for path in sorted((root / "kvstrata").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if path.name == "__init__.py" and path.stat().st_size < 200:
            continue  # a package marker, named with its folder
        folder = relative.rsplit("/", 1)[0] + "/"
        if relative in rows or f"`{path.name}`" in rows.get(folder, ""):
            continue
        if re.search(rf"\b{re.escape(path.name)}\b", rows.get(folder, "")):
            continue
        missing.append(relative)
    return missing


def test_every_module_is_on_the_map() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert unlisted_modules(doc, ROOT) == []


def test_the_check_sees_a_missing_module(tmp_path: Path) -> None:
    (tmp_path / "kvstrata" / "pkg").mkdir(parents=True)
    for name in ("a.py", "b.py", "c.py"):
        (tmp_path / "kvstrata" / "pkg" / name).write_text('"""x"""\n')
    doc = "| `kvstrata/pkg/a.py` | one |\n| `kvstrata/pkg/` | `b.py` (two) |\n"
    assert unlisted_modules(doc, tmp_path) == ["kvstrata/pkg/c.py"]
