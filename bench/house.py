"""The shape of the tree, as issue 28 counts it: files and lines of `server/`, the flags
and help lines of `kvstrata serve --help`, mypy errors, `# fmt: skip` lines, modules over
350 lines, the longest import circle, and the router's imports and idle RSS.

    .venv/bin/python bench/house.py [--tree DIR] [--python PY] [--no-mypy] [--out FILE]

`--tree` measures another checkout (e.g. a `git worktree` of an older commit) with this
script; `--python` is the interpreter that imports it (default: this one)."""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGE = "kvstrata"


def py_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def lines_of(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def server_size(tree: Path) -> dict[str, int]:
    files = py_files(tree / PACKAGE / "server")
    return {"server_files": len(files), "server_lines": sum(map(lines_of, files))}


def fmt_skips(tree: Path) -> int:
    return sum(
        line.count("fmt: skip")
        for path in py_files(tree / PACKAGE)
        for line in path.read_text(encoding="utf-8").splitlines()
    )


def big_modules(tree: Path, over: int = 350) -> dict[str, int]:
    sizes = {str(p.relative_to(tree)): lines_of(p) for p in py_files(tree / PACKAGE)}
    return {name: n for name, n in sorted(sizes.items()) if n > over}


def serve_help(tree: Path, python: str) -> dict[str, int]:
    out = subprocess.run(
        [python, "-m", PACKAGE, "serve", "--help"], cwd=tree, capture_output=True, text=True,
        env=_env(tree), check=True,
    ).stdout  # fmt: skip
    flags = set(re.findall(r"^  (--[a-z0-9][a-z0-9-]*)", out, flags=re.M))
    return {"serve_help_flags": len(flags - {"--help"}), "serve_help_lines": len(out.splitlines())}


def mypy_errors(tree: Path, python: str) -> int | None:
    done = subprocess.run(
        [python, "-m", "mypy", PACKAGE], cwd=tree, capture_output=True, text=True, env=_env(tree)
    )
    found = re.search(r"Found (\d+) errors?", done.stdout)
    if found:
        return int(found.group(1))
    return 0 if "Success" in done.stdout else None


def module_of(tree: Path, path: Path) -> str:
    parts = list(path.relative_to(tree).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(tree: Path) -> dict[str, set[str]]:
    """Module -> the kvstrata modules it imports, type-only imports included."""
    modules = {module_of(tree, p): p for p in py_files(tree / PACKAGE)}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def longest_circle(graph: dict[str, set[str]]) -> list[str]:
    """The largest strongly connected component (Tarjan): a circle of that many modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    best: list[str] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter, best
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > len(best):
                best = sorted(component)

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return best


def router_imports(tree: Path, python: str) -> dict[str, object]:
    code = (
        "import sys, kvstrata.router.app; "
        "print(len([m for m in sys.modules if m.split('.')[0] == 'kvstrata']), "
        "'torch' in sys.modules)"
    )
    out = subprocess.run(
        [python, "-c", code], cwd=tree, capture_output=True, text=True, env=_env(tree), check=True
    ).stdout.split()
    return {"router_kvstrata_modules": int(out[0]), "router_imports_torch": out[1] == "True"}


def router_idle_rss_mib(tree: Path, python: str) -> float:
    """RSS of a `kvstrata router` (one decode rank named, none listening) once it answers
    /health, after 3 s at idle."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [python, "-m", PACKAGE, "router", "--decode", "http://127.0.0.1:9", "--port", str(port),
         "--no-wait-for-registrations"],
        cwd=tree, env=_env(tree), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        time.sleep(3)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        rss_kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
        return round(rss_kib / 1024, 1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--no-mypy", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    tree = args.tree.resolve()
    circle = longest_circle(import_graph(tree))
    report: dict[str, object] = {
        **server_size(tree),
        **serve_help(tree, args.python),
        "fmt_skips": fmt_skips(tree),
        "modules_over_350": big_modules(tree),
        "longest_import_circle": len(circle),
        "longest_import_circle_modules": circle,
        **router_imports(tree, args.python),
        "router_idle_rss_mib": router_idle_rss_mib(tree, args.python),
    }
    if not args.no_mypy:
        report["mypy_errors"] = mypy_errors(tree, args.python)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
