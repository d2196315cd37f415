"""Names and modules that moved, still served with a :class:`DeprecationWarning` naming the
new place.

- A moved *name* inside a module that stays: a module ``__getattr__`` (PEP 562,
  :func:`module_getattr`); the new place is imported only when the old name is used.
- A moved *module*: :data:`MOVED_MODULES`, served by a finder on ``sys.meta_path`` that
  ``import relpos`` installs (:func:`install_moved_modules`). Importing an old path warns once
  and gives a stand-in module whose attributes are the new module's; no file stays behind at
  the old place, so the tree shows only where code lives now. The finder is consulted only
  after the regular ones have found nothing, and imports nothing itself (no torch).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["MOVED_MODULES", "install_moved_modules", "module_getattr", "moved", "warn"]

#: Modules that moved in 0.1 (old path -> new path, or the new paths of a module that was split,
#: searched in order); the old paths go in 0.2.
MOVED_MODULES: dict[str, str | tuple[str, ...]] = {
    "relpos.bench_decode": "relpos.bench.decode",
    "relpos.integrations.ctranslate2": "relpos.export.ctranslate2",
    "relpos.ops.fused.kernels": "relpos.ops._flash",
    "relpos.ops.fused.merge": ("relpos.ops._lse", "relpos.ops.flash_regions.far_terms"),
    "relpos.plotting": "relpos.training.plotting",
    "relpos.tasks": "relpos.training.tasks",
    "relpos.training.experiment.signal": "relpos.training.experiment.row_signal",
    # renamed so that no two modules share a name for different ideas
    "relpos.training.distributed": "relpos.training.data_parallel",
    "relpos.training.parallel": "relpos.training.mesh_parallel",
    "relpos.training.experiment.resume": "relpos.training.experiment.reuse",
    "relpos.training.experiment.evaluate": "relpos.training.experiment.code_metrics",
    "relpos.modules.transformer": "relpos.modules.transformer_layers",
    # the flash_regions backend (implementation="fused" before): a decomposition over torch's
    # flash kernels, not a fused kernel (those are the native and triton backends)
    "relpos.ops.fused": "relpos.ops.flash_regions",
    **{f"relpos.ops.fused.{name}": f"relpos.ops.flash_regions.{name}"
       for name in ("band", "decomposition", "far", "far_terms", "op")},
}

#: What :func:`module_getattr` serves for one old name: (the name to use instead, a loader).
Alias = tuple[str, Callable[[], Any]]


def moved(target: str) -> Alias:
    """The alias of a name now at ``target`` (``"package.module.name"``)."""
    module, _, name = target.rpartition(".")
    return target, lambda: getattr(importlib.import_module(module), name)


def module_getattr(module: str, aliases: Mapping[str, Alias]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``module`` that serves ``aliases`` (old name -> alias).

    Returns:
        The function to assign to the module's ``__getattr__``: for an old name it warns
        (:class:`DeprecationWarning`, naming the replacement) and returns the object; for any
        other name it raises :class:`AttributeError`.
    """

    def __getattr__(name: str) -> Any:
        if name not in aliases:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        instead, load = aliases[name]
        warnings.warn(
            f"{module}.{name} is deprecated; use {instead}", DeprecationWarning, stacklevel=2
        )
        return load()

    return __getattr__


_HERE = os.path.normcase(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(_HERE) + os.sep


def _stacklevel(inside: Callable[[str], bool]) -> int:
    """The ``stacklevel`` with which the caller's ``warnings.warn`` points at the first frame
    whose file is not ``inside``: past the caller and every frame ``inside`` (``warnings``
    itself does not count importlib's)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<frozen importlib"):
            if not inside(os.path.normcase(os.path.abspath(name))):
                break
            level += 1
        frame = frame.f_back  # type: ignore[assignment]
    return level


def warn(message: str) -> None:
    """A :class:`DeprecationWarning` that points at the first line outside relpos: the user's
    line that used the old name, however deep in relpos the name was read."""
    warnings.warn(message, DeprecationWarning,
                  stacklevel=_stacklevel(lambda name: name.startswith(_PACKAGE)))


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, targets: str | tuple[str, ...]) -> None:
        self.targets = (targets,) if isinstance(targets, str) else targets

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        where = ", ".join(f":mod:`{t}`" for t in self.targets)
        return types.ModuleType(spec.name, f"Deprecated: moved to {where}.")

    def exec_module(self, module: types.ModuleType) -> None:
        warnings.warn(
            f"{module.__name__} is deprecated; use {' or '.join(self.targets)}",
            DeprecationWarning, stacklevel=_stacklevel(lambda name: name == _HERE),
        )
        targets = [importlib.import_module(t) for t in self.targets]

        def __getattr__(name: str) -> Any:
            for target in targets:
                if hasattr(target, name):
                    return getattr(target, name)
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

        def __dir__() -> list[str]:
            return sorted({n for target in targets for n in dir(target)})

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        module.__dir__ = __dir__  # type: ignore[method-assign]
        module.__dict__["__all__"] = [
            n for target in targets for n in getattr(target, "__all__", ())]


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED_MODULES` (after every regular finder)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        # A moved package (an old path with old submodules below it) gets a __path__, so that
        # its old submodules are looked up, and found here.
        package = any(old.startswith(f"{fullname}.") for old in MOVED_MODULES)
        return importlib.machinery.ModuleSpec(
            fullname, _MovedModuleLoader(MOVED_MODULES[fullname]), is_package=package
        )


def install_moved_modules() -> None:
    """Serve the old paths of :data:`MOVED_MODULES` (idempotent; ``import relpos`` calls it)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
