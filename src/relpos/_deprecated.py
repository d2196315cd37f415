"""Names that moved: a module ``__getattr__`` (PEP 562) that still serves them, with a
:class:`DeprecationWarning` naming the new place. The new place is imported only when an old
name is used, so a shim costs nothing at import time (no torch)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["module_getattr", "moved"]

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
