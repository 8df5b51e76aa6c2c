"""The package-level import graph of kvstrata: no cycle, and each package imports only those
before it in LAYERS (every import of every module counts, inside functions too, except
those under `if TYPE_CHECKING:`, which never run); the pairs in NEVER are not joined even
by a type-only import; and no circle of more than 3 modules exists, type-only imports
included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvstrata

ROOT = Path(kvstrata.__file__).parent
# Edges known to close a cycle, each with who removes it. None is left; nothing may be
# added here without a note saying who removes it.
KNOWN_EDGES: set[tuple[str, str]] = set()
# The packages in the order they may import each other: each only those before it.
LAYERS = (
    "session_ref", "grammar_spec", "core", "errors_text", "version", "pdl", "model", "config",
    "kvcache", "http", "attention", "engine", "disagg", "runtime", "pd", "cluster", "server",
    "router", "sim", "llm", "", "bench", "demo", "__main__",
)  # fmt: skip
# Never joined, type-only imports included: the router runs no model (no torch), the
# shared front door knows no engine, and config is resolved before any model is read.
NEVER = {
    ("router", "engine"), ("router", "disagg"), ("router", "server"), ("router", "runtime"),
    ("router", "pd"), ("router", "attention"), ("http", "engine"), ("http", "disagg"),
    ("http", "runtime"), ("http", "server"), ("config", "model"),
}  # fmt: skip
# Never-pairs still joined, each with who removes it (none is left: a GGUF --model is laid
# out by engine/parts.py at start-up, outside the config).
KNOWN_NEVER: set[tuple[str, str]] = set()
MAX_CIRCLE_MODULES = 3


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


def imported_modules(tree: ast.AST, package: str, type_only: bool = False) -> set[str]:
    """The kvstrata modules `tree` imports at run time (`type_only`: those under
    TYPE_CHECKING too). `package` resolves relative imports."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in (*node.body, *node.orelse) if type_only else node.orelse:
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


def module_graph(root: Path, type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the other kvstrata modules it imports."""
    known = {module_name(path, root) for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        imported = imported_modules(tree, package, type_only)
        graph[name] = {m for m in imported if m in known and m not in (name, package)}
    return graph


def layer_graph(root: Path, type_only: bool = False) -> dict[str, set[str]]:
    """Layer -> the other layers its modules import."""
    graph: dict[str, set[str]] = {}
    for name, targets in module_graph(root, type_only).items():
        source = layer_of(name)
        edges = graph.setdefault(source, set())
        edges.update(layer_of(m) for m in targets if layer_of(m) != source)
    return graph


def short(layer: str) -> str:
    """`kvstrata.engine` -> `engine`; the package itself -> ``."""
    return layer.removeprefix("kvstrata").removeprefix(".")


def largest_circle(graph: dict[str, set[str]]) -> list[str]:
    """The largest strongly connected set of modules (a circle of imports), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    largest: list[str] = []

    def connect(node: str) -> None:
        nonlocal largest
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > len(largest):
                largest = sorted(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return largest


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


def test_each_package_imports_only_those_before_it() -> None:
    graph = layer_graph(ROOT)
    assert {short(layer) for layer in graph} <= set(LAYERS), "a package missing from LAYERS"
    late = [
        f"{short(source)} -> {short(target)}"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if LAYERS.index(short(target)) > LAYERS.index(short(source))
    ]
    assert not late, f"imports of a later package: {late}"


def test_the_never_pairs_are_not_joined_even_by_type_only_imports() -> None:
    graph = layer_graph(ROOT, type_only=True)
    joined = [
        f"{source} -> {target}"
        for source, target in sorted(NEVER - KNOWN_NEVER)
        if f"kvstrata.{target}" in graph.get(f"kvstrata.{source}", set())
    ]
    assert not joined, joined


def test_no_import_circle_of_more_than_three_modules() -> None:
    circle = largest_circle(module_graph(ROOT, type_only=True))
    assert len(circle) <= MAX_CIRCLE_MODULES, circle


def test_the_router_imports_no_torch() -> None:
    code = "import sys, kvstrata.router.app; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_kvstrata_router_on_the_command_line_imports_no_torch() -> None:
    """What `kvstrata router` loads before it serves: the CLI's parser (every sub-command's
    flags) and the router's entry point; a torch loaded there cost every router ~140 MiB."""
    code = (
        "import sys, kvstrata.__main__ as cli, kvstrata.router.serve; cli.build_parser(); "
        "assert 'torch' not in sys.modules, 'torch'"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
