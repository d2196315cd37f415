"""The package's structure, drawn from its own imports: no cycles, nothing imports upward.

Layers, lowest first; a module may import from its own layer and the layers below it. The
top-level ``relpos`` package is a lazy facade for users: nothing inside the package imports it.
"""

from __future__ import annotations

import ast
import fnmatch
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("relpos._version", "relpos._io", "relpos._sysinfo", "relpos._deprecated",
              "relpos.positions", "relpos.versioning")),
    ("backends", ("relpos.ops", "relpos.ops.*")),
    ("functional", ("relpos.functional",)),
    ("cache", ("relpos.cache",)),
    ("modules", ("relpos.modules", "relpos.modules.*")),
    ("tables", ("relpos.tables",)),
    ("lab", ("relpos.models", "relpos.models.*", "relpos.tasks", "relpos.plotting",
             "relpos.training", "relpos.training.*", "relpos.export", "relpos.integrations",
             "relpos.integrations.*")),
    ("bench", ("relpos.bench", "relpos.bench.*", "relpos.bench_decode")),
    ("cli", ("relpos.cli", "relpos.cli.*", "relpos.__main__")),
)
CORE = ("base", "backends", "functional", "cache", "modules", "tables")


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "relpos").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()
assert len(MODULES) > 20, f"found only {sorted(MODULES)} under {SRC}"


def _owner(name: str) -> str:
    """The module of ``name`` (a module, or a name defined in a module)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(path: Path) -> set[str]:
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "relpos":
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in MODULES else _owner(node.module))
        elif isinstance(node, ast.Import):
            deps |= {_owner(a.name) for a in node.names if a.name.split(".")[0] == "relpos"}
    return deps


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _layer(name: str) -> int:
    for rank, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return rank
    raise AssertionError(f"{name} is in no layer of tests/test_architecture.py: place it")


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        if name != "relpos":
            _layer(name)


def test_nothing_imports_upward_or_the_facade() -> None:
    bad = []
    for name, deps in GRAPH.items():
        if name == "relpos":
            continue
        for dep in deps:
            if dep == "relpos":
                bad.append(f"{name} imports the top-level facade (import the defining module)")
            elif _layer(dep) > _layer(name):
                bad.append(f"{name} ({LAYERS[_layer(name)][0]}) imports {dep} "
                           f"({LAYERS[_layer(dep)][0]})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1 = on the path, 2 = done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep):], dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


def test_import_relpos_loads_only_the_core() -> None:
    code = ("import sys, relpos; relpos.relative_attention; relpos.RelativeMultiheadAttention; "
            "relpos.KVCache; relpos.resize_relative_table; relpos.RelativeStateError; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('relpos'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    outside = [m for m in loaded if m != "relpos" and LAYERS[_layer(m)][0] not in CORE]
    assert not outside, f"using the core loaded {outside}"
    bare = subprocess.run(
        [sys.executable, "-c", "import sys, relpos; print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True).stdout.strip()
    assert bare == "False", "import relpos alone imports torch"
