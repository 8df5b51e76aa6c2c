"""Radix nodes are the cache's own: no kvstrata module outside kvstrata/kvcache/ reads one.
A cache handle (`core.CacheHandle`) goes back to the cache's contract, which answers for
its nodes (`PrefixCache.path_page_ids`, `check_locks`, `num_lock_pins`). Read from the
source (ast), so a function that is never run is seen too. The cache's own tests may look
inside; the rule is the package's.

The rule, outside kvstrata/kvcache/:
  1. the node class (`_Node`) is never named, and no private name is imported from kvcache;
  2. a handle is opaque: no attribute is read off where requests, matches and admissions
     keep one (`req.cache_handle.parent`, `match.handle.page_ids`, `cache_handle.key`);
  3. the node fields no other kvstrata type has are read nowhere (`lock_count`, ...);
     the ones other types share (`parent`: Path, `children`: clusters, `key`, `page_ids`:
     requests) are left to rules 1, 2 and 4 and to the typed handle;
  4. a RadixCache's private members (its methods and what it keeps on `self`, as radix.py
     defines them) are read on no object but `self` (`cache._root`, `l1._nodes()`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvstrata
from kvstrata.kvcache.radix_node import _Node

ROOT = Path(kvstrata.__file__).parent
CACHE_PACKAGE = "kvcache"
# Node fields that other kvstrata types have too (rule 3 would name them falsely).
SHARED_FIELDS = {"parent", "children", "key", "page_ids"}


def node_only_fields() -> set[str]:
    slots = set(_Node.__slots__)
    assert slots >= SHARED_FIELDS, "a shared field left the node: update SHARED_FIELDS"
    return slots - SHARED_FIELDS


def radix_private_members(radix_source: str) -> set[str]:
    """Private (single-underscore) methods of RadixCache and attributes it sets on self."""
    tree = ast.parse(radix_source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RadixCache"]
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _names_a_handle(node: ast.expr) -> bool:
    """`X.handle`, `X.cache_handle` or `cache_handle`: where PrefixMatch, Request and the
    simulator's Admission keep a cache handle (a bare `handle` is also asyncio's)."""
    if isinstance(node, ast.Attribute):
        return node.attr in ("handle", "cache_handle")
    return isinstance(node, ast.Name) and node.id == "cache_handle"


def node_reads(source: str, path: str, node_fields: set[str], privates: set[str]) -> list[str]:
    """Where `source` breaks the rule, as 'path:line: what'."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, path)):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            f"kvstrata.{CACHE_PACKAGE}"
        ):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{where}: imports {alias.name} from {node.module}")
        elif isinstance(node, ast.Name) and node.id == "_Node":
            found.append(f"{where}: names the radix node class")
        elif isinstance(node, ast.Attribute):
            if node.attr == "_Node":
                found.append(f"{where}: names the radix node class")
            elif _names_a_handle(node.value):
                found.append(f"{where}: reads .{node.attr} of a cache handle")
            elif node.attr in node_fields:
                found.append(f"{where}: reads the radix node field .{node.attr}")
            elif node.attr in privates and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                found.append(f"{where}: reads RadixCache's private .{node.attr}")
    return found


def package_node_reads(root: Path) -> list[str]:
    privates = radix_private_members((root / CACHE_PACKAGE / "radix.py").read_text())
    fields = node_only_fields()
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == CACHE_PACKAGE:
            continue
        found += node_reads(path.read_text(), str(path.relative_to(root)), fields, privates)
    return found


def test_the_rule_names_each_way_of_reading_a_node() -> None:
    privates = radix_private_members((ROOT / CACHE_PACKAGE / "radix.py").read_text())
    assert {"_root", "_nodes", "_path_to_root", "_walk"} <= privates
    fields = node_only_fields()
    assert "lock_count" in fields and "parent" not in fields
    source = (
        "from kvstrata.kvcache.radix import RadixCache, _Node\n"
        "def walk(req, cache, node, path):\n"
        "    a = req.cache_handle.parent\n"
        "    b = match.handle.page_ids\n"
        "    c = node.lock_count\n"
        "    d = cache._root\n"
        "    e = self._root, path.parent, req.page_ids, req.cache_handle is None\n"
        "    f = timer_handle.cancel(), handle.cancel()\n"
    )
    found = node_reads(source, "x.py", fields, privates)
    assert found == [
        "x.py:1: imports _Node from kvstrata.kvcache.radix",
        "x.py:3: reads .parent of a cache handle",
        "x.py:4: reads .page_ids of a cache handle",
        "x.py:5: reads the radix node field .lock_count",
        "x.py:6: reads RadixCache's private ._root",
    ]


def test_no_module_outside_kvcache_reads_a_radix_node() -> None:
    found = package_node_reads(ROOT)
    assert not found, "\n".join(found)
