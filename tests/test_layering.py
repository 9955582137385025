"""The package's import graph: no cycles, the passes are functions of the IR, and the load path
stays off the compile side.

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


def _crossings(importers: tuple[str, ...], imported: tuple[str, ...]) -> list[tuple[str, str]]:
    graph = _imports()
    return sorted(
        (m, t)
        for m, targets in graph.items()
        if _within(m, importers)
        for t in targets
        if _within(t, imported)
    )


def test_passes_import_nothing_from_exec():
    assert not _crossings(("fxrt.passes",), ("fxrt.exec",))


def test_exec_reads_facts_not_passes():
    """The planner and the executors read the IR's facts (fxrt.analysis), never a pass; the facts
    import neither side."""
    assert not _crossings(("fxrt.exec",), ("fxrt.passes", "fxrt.pipeline"))
    assert not _crossings(("fxrt.analysis",), ("fxrt.passes", "fxrt.exec", "fxrt.pipeline"))


def test_the_cache_is_one_package():
    """Keys, store and the lookup around a compile live in fxrt.cache; the store (what
    ``python -m fxrt cache list`` reads) imports nothing else of fxrt, and the cache does not
    import the compiler (it is handed the constructor)."""
    modules = _modules()
    assert "fxrt.cachestore" not in modules
    assert {"fxrt.cache.keys", "fxrt.cache.store", "fxrt.cache.lookup"} <= set(modules)
    assert not _imports()["fxrt.cache.store"]
    assert not _crossings(("fxrt.cache",), ("fxrt.compiler", "fxrt.backend"))
    assert not [
        m
        for m in modules
        if m.startswith("fxrt.")
        and "cache" not in m
        and "def cached_compile" in modules[m].read_text()
    ]


def _imported_on_import(path: Path) -> set[str]:
    """The modules a file imports while it is itself imported: not in functions, nor under
    ``if TYPE_CHECKING``."""
    found: set[str] = set()
    todo: list[ast.AST] = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
        todo.extend(ast.iter_child_nodes(node))
    return found


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in packages)


def test_load_path_stays_off_the_compile_side():
    """Whatever ``fxrt.load`` may import (function-local imports included) reaches neither the
    torch.compile entry, Inductor's glue nor the export side, and none of it imports sympy,
    Dynamo, Inductor, torch.export or torch._decomp on import: a static package loads without
    them (sympy comes in, from inside a function, for symbolic sizes only). tests/test_deploy.py
    checks what a load actually imports."""
    graph, modules = _imports(), _modules()
    closure, todo = set(), ["fxrt.deploy.loaded"]
    while todo:
        m = todo.pop()
        if m not in closure:
            closure.add(m)
            todo.extend(graph[m])
    compile_side = ("fxrt.backend", "fxrt.inductor", "fxrt.deploy.build")
    reached = sorted(m for m in closure if _within(m, compile_side))
    assert not reached, f"the load path reaches {reached}"
    heavy = ("sympy", "torch._dynamo", "torch._inductor", "torch.export", "torch._decomp")
    bad = sorted(
        (m, name)
        for m in closure
        for name in _imported_on_import(modules[m])
        if _within(name, heavy)
    )
    assert not bad, f"imported on import by modules of the load path: {bad}"


def test_every_source_file_is_at_most_500_lines():
    """One idea per file: a file past 500 lines is split where its ideas part (Cython's
    generated ``_loop.cpp`` and ``_runtime.cpp`` aside)."""
    sources = [ROOT, ROOT.parent / "csrc"]
    long = {
        str(path.relative_to(ROOT.parent)): n
        for top in sources
        for path in top.rglob("*")
        if path.suffix in {".py", ".pyx", ".h", ".cpp"}
        and path.name not in {"_loop.cpp", "_runtime.cpp"}
        and (n := len(path.read_text().splitlines())) > 500
    }
    assert not long, long


def test_one_runtime_behind_both_faces():
    """The C++ runtime fxrt.load runs is the C++ API's library, not a copy: the extension's
    ``fxrt._speedups._runtime`` compiles exactly the sources ``csrc/CMakeLists.txt`` builds
    ``fxrt::runtime`` from (setup.py takes every ``csrc/src/*.cpp``)."""
    import re

    repo = ROOT.parent
    listed = re.search(
        r"add_library\(fxrt_runtime STATIC(.*?)\)", (repo / "csrc/CMakeLists.txt").read_text(), re.S
    )
    assert listed, "csrc/CMakeLists.txt: no fxrt_runtime library"
    cmake = sorted(listed[1].split())
    assert cmake == sorted(
        str(p.relative_to(repo / "csrc")) for p in (repo / "csrc/src").glob("*.cpp")
    )
    assert 'glob("csrc/src/*.cpp")' in (repo / "setup.py").read_text()


def test_the_runtime_face_checks_no_input_itself():
    """One input-check implementation: the runtime's face uses the binder only for the call's
    structure (flatten) and the constants the export specialized on; every value the program
    receives is checked by the runtime (csrc/src/inputs.cpp)."""
    tree = ast.parse((ROOT / "deploy" / "runtime_model.py").read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "_binder"
    }
    assert used == {"flatten", "check_constants", "n_args"}, used


def test_one_loader():
    """``fxrt.load`` reads packages only through the C++ runtime: the modules of its path
    (the face, its host loop, ``load`` itself) import no package or weights-header reader of
    Python's (``fxrt.deploy.package`` lends them only its error), the binder checks no values
    (``csrc/src/inputs.cpp`` does), and no second loader or per-call check table of the
    compiled loop's comes back."""
    modules = _modules()
    for mod in ("loaded", "runtime_model", "host_loop", "binder"):
        tree = ast.parse(modules[f"fxrt.deploy.{mod}"].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("package", "deploy.package"):
                assert [a.name for a in node.names] == ["PackageError"], (mod, node.names)
            if isinstance(node, ast.ImportFrom) and node.module == "tensorfile":
                assert [a.name for a in node.names] == ["loads_json"], (mod, node.names)
    binder = {
        n.name
        for n in ast.walk(ast.parse((ROOT / "deploy" / "binder.py").read_text()))
        if isinstance(n, ast.FunctionDef)
    }
    assert not binder & {"check", "quick", "tables"}, binder
    for gone in ("deploy/python_loader.py", "deploy/weights.py", "deploy/size_expr.py"):
        assert not (ROOT / gone).exists(), gone
    assert not (ROOT / "_speedups" / "package_checks.h").exists()
    assert "PackageEntry" not in (ROOT / "_speedups" / "_loop.pyx").read_text()
