"""What every bridge does the same way: route a framework's attention modules through relpos,
all of them or none.

:func:`route` checks every module first (a refusal patches nothing), then replaces each one's
``forward`` with relpos's and marks it; :func:`is_patched` finds the mark.

The new ``forward`` is ``functools.partial(forward, module)`` of a module-level function, not a
bound method: pickle stores a partial by the function's importable name (a bound method would
be stored as ``getattr(module, "_relpos_forward")``, a name the module does not have), so
``torch.save`` / ``torch.load`` of a patched model gives a patched model (relpos must be
installed where it is loaded; pickle imports it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

__all__ = ["PATCHED", "is_patched", "route"]

#: The attribute that marks a module (or a function) relpos has patched.
PATCHED = "_relpos_patched"


def route(
    model: nn.Module, modules: Sequence[nn.Module], refusal: Callable[[Any], str | None],
    forward: Callable[..., Any],
) -> int:
    """Bind ``forward`` (a module-level function taking the module first) as the ``forward`` of
    each of ``modules`` (of ``model``), unless ``refusal`` names a reason for any of them: then
    raise ``ValueError`` with the first reason, and patch none. Returns how many modules were
    patched."""
    refusals = [r for r in map(refusal, modules) if r is not None]
    if refusals:
        raise ValueError(f"cannot patch {type(model).__name__}: {refusals[0]}; nothing was patched")
    for module in modules:
        module.forward = functools.partial(forward, module)  # picklable, unlike a bound method
        setattr(module, PATCHED, True)
    return len(modules)


def is_patched(module: nn.Module) -> bool:
    """Whether relpos's ``patch`` routed this attention module (or any inside it)."""
    return any(getattr(m, PATCHED, False) for m in module.modules())
