"""The package-level import graph of kvstrata has no cycle: every import of every module
counts (inside functions too), except those under `if TYPE_CHECKING:`, which never run."""

from __future__ import annotations

import ast
from pathlib import Path

import kvstrata

ROOT = Path(kvstrata.__file__).parent
# Edges known to close a cycle, each with who removes it. None is left; nothing may be
# added here without a note saying who removes it.
KNOWN_EDGES: set[tuple[str, str]] = set()


def layer_of(module: str) -> str:
    """`kvstrata.engine.engine` -> `kvstrata.engine`; a top-level module is its own layer
    (`kvstrata.core`), the package's __init__ is `kvstrata`."""
    return ".".join(module.split(".")[:2])


def module_name(path: Path, root: Path) -> str:
    """The dotted name of `path` in the package at `root` (named by root's folder)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(tree: ast.AST, package: str) -> set[str]:
    """The kvstrata modules `tree` imports at run time. `package` resolves relative imports."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from kvstrata import core` imports the module kvstrata.core
            found.update(f"{base}.{alias.name}" for alias in node.names)
            found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name == "kvstrata" or name.startswith("kvstrata.")}


def layer_graph(root: Path) -> dict[str, set[str]]:
    """Layer -> the other layers its modules import."""
    known = {module_name(path, root) for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        targets = {m for m in imported_modules(tree, package) if m in known}
        source = layer_of(name)
        edges = graph.setdefault(source, set())
        edges.update(layer_of(m) for m in targets if layer_of(m) != source)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_finder_sees_a_cycle_and_skips_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "kvstrata"
    for sub in ("a", "b"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from kvstrata.b.y import f\n")
    (pkg / "b" / "y.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvstrata.a.x import g\n"
    )
    assert find_cycle(layer_graph(pkg)) is None
    (pkg / "b" / "y.py").write_text("def f():\n    from kvstrata.a import x\n")
    assert find_cycle(layer_graph(pkg)) == ["kvstrata.a", "kvstrata.b", "kvstrata.a"]


def test_packages_import_each_other_without_a_cycle() -> None:
    graph = layer_graph(ROOT)
    assert "kvstrata.engine" in graph and "kvstrata.disagg" in graph
    for source, target in KNOWN_EDGES:
        graph[source].discard(target)
    assert find_cycle(graph) is None, f"import cycle between packages: {find_cycle(graph)}"
