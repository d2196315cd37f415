"""The package's structure, drawn from its own folders and imports: no cycles, nothing imports
upward (docs/architecture.md draws it).

A module's layer is its folder under ``src/relpos``: the top-level modules, ``ops/`` and
``modules/`` are the core (what ``import relpos`` gives users); ``models/``, ``training/``,
``export/`` and ``integrations/`` the lab; then the benchmark harness and the command line. A
module imports from its own layer and the layers below. Inside the core, the backends
(``ops/``) sit under the API: they import only each other and the core's base, the top-level
modules that import no folder at all (positions, versioning, ``_io``, ...); ``varlen/``, the
packed API, sits beside ``functional.py``. The top-level ``relpos`` package is a lazy facade
for users: nothing inside the package imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: Layers, lowest first, and the folders of ``src/relpos`` in each ("" = the top-level modules).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("", "ops", "modules", "varlen", "cache")),
    ("lab", ("models", "training", "export", "integrations", "distributed")),
    ("bench", ("bench",)),
    ("cli", ("cli",)),
)
CORE = "core"


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


def _folder(name: str) -> str:
    """The folder of ``src/relpos`` that holds module ``name`` ("" for a top-level module)."""
    if name == "relpos.__main__":  # ``python -m relpos``: the command line
        return "cli"
    parts = name.split(".")
    if len(parts) == 1 or (len(parts) == 2 and MODULES[name].name != "__init__.py"):
        return ""
    return parts[1]


def _layer(name: str) -> int:
    folder = _folder(name)
    for rank, (_, folders) in enumerate(LAYERS):
        if folder in folders:
            return rank
    raise AssertionError(
        f"src/relpos/{folder}/ ({name}) is in no layer of tests/test_architecture.py: place it"
    )


def _base() -> set[str]:
    """The core's base: top-level modules whose relpos imports, followed through, never reach
    a folder."""
    top = {n for n in MODULES if n.count(".") == 1 and _folder(n) == ""}
    base = set(top)
    changed = True
    while changed:
        changed = False
        for name in sorted(base):
            if any(dep != "relpos" and dep not in base for dep in GRAPH[name]):
                base.discard(name)
                changed = True
    return base


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


def test_the_backends_import_only_each_other_and_the_base() -> None:
    base = _base()
    assert {"relpos.positions", "relpos._io"} <= base, f"the base is only {sorted(base)}"
    bad = [
        f"{name} imports {dep} (allowed outside ops/: {sorted(base)})"
        for name, deps in GRAPH.items() if _folder(name) == "ops"
        for dep in deps if _folder(dep) != "ops" and dep not in base
    ]
    assert not bad, "\n".join(sorted(bad))


def test_the_folders_are_known() -> None:
    folders = {p.name for p in (SRC / "relpos").iterdir()
               if p.is_dir() and (p / "__init__.py").is_file()}
    placed = {f for _, fs in LAYERS for f in fs if f}
    assert folders == placed, f"folders {sorted(folders ^ placed)} are not placed in LAYERS"


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
    outside = [m for m in loaded if m != "relpos" and LAYERS[_layer(m)][0] != CORE]
    assert not outside, f"using the core loaded {outside}"
    bare = subprocess.run(
        [sys.executable, "-c", "import sys, relpos; print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True).stdout.strip()
    assert bare == "False", "import relpos alone imports torch"
