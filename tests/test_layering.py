"""The package's import graph: no cycles, and the passes are functions of the IR.

Every ``import`` statement of every fxrt module counts, function-local ones included: an import
moved into a function hides a cycle from Python's import machinery, not from the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fxrt

ROOT = Path(fxrt.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ("fxrt", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports() -> dict[str, set[str]]:
    """Module -> the fxrt modules it imports (the package ``fxrt`` itself left out)."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name if name and name != "fxrt" else None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                prefix = (
                    (f"{base}.{node.module}" if node.module else base)
                    if node.level
                    else node.module
                )
                names = [f"{prefix}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = owner(name)
                if target is not None and target != mod:
                    graph[mod].add(target)
    return graph


def test_no_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = path[path.index(t) :] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_passes_import_nothing_from_exec():
    graph = _imports()
    bad = {
        (m, t)
        for m, targets in graph.items()
        if m.startswith("fxrt.passes")
        for t in targets
        if t.startswith("fxrt.exec")
    }
    assert not bad, sorted(bad)
