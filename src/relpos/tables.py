"""Resizing relative position tables when the clip window changes.

A table of a window ``(left, right)`` has ``left + right + 1`` rows indexed by
``clip(j - i, -left, right) + left`` (a clip distance ``K`` is the window ``(K, K)``, ``2K + 1``
rows). Every offset at or beyond ``-left`` reads the first row and every offset at or beyond
``+right`` the last, so growing a side by repeating its edge row gives a table that computes
exactly the same attention at every length: ``clip(r, -left', right')`` lands on a copy of the
row ``clip(r, -left, right)`` lands on. Shrinking a side drops rows from that end (the new edge
row is the old row at the new bound), which changes the model for offsets beyond it. Each side
is resized on its own: ``(64, 8) -> (32, 16)`` shrinks the left side and grows the right.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from relpos.positions import check_window
from relpos.versioning import check_state, describe_window, make_state

__all__ = ["load_state_dict_resized", "resize_relative_table", "table_max_distance",
           "table_window"]

_EXTRA_STATE = "_extra_state"


def _check_table(table: object, name: str) -> Tensor:
    if not isinstance(table, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(table).__name__}")
    if table.dim() not in (2, 3):
        raise ValueError(
            f"{name} must have shape (2K+1, D) or (H, 2K+1, D) (left + right + 1 rows for a "
            f"window), got shape {tuple(table.shape)}"
        )
    return table


def table_max_distance(table: Tensor, name: str = "table") -> int:
    """K of a table of shape ``(2K+1, D)`` or ``(H, 2K+1, D)``.

    Raises:
        TypeError: if ``table`` is not a tensor.
        ValueError: if it is not 2-D/3-D or has an even number of rows (a window's table
            says nothing about how its rows split into sides: see :func:`table_window`).
    """
    rows = _check_table(table, name).shape[-2]
    if rows % 2 != 1:
        raise ValueError(
            f"{name} has {rows} rows (shape {tuple(table.shape)}); a relative table has an odd "
            f"number 2K+1 of rows, or is a window's: pass the window it was trained with, "
            f"old_max_distance=(left, right) with left + right + 1 = {rows}"
        )
    return (rows - 1) // 2


def table_window(
    table: Tensor, max_distance: int | tuple[int, int] | None = None, name: str = "table"
) -> tuple[int, int]:
    """``(left, right)`` of a table: ``max_distance`` checked against the row count, or, when
    None, the symmetric ``(K, K)`` of an odd row count ``2K + 1``.

    Raises:
        TypeError: if ``table`` is not a tensor or ``max_distance`` not a K or a pair.
        ValueError: if the rows disagree with ``max_distance``, or are even without it.
    """
    if max_distance is None:
        k = table_max_distance(table, name)
        return k, k
    left, right = check_window(max_distance, "old_max_distance")
    rows = _check_table(table, name).shape[-2]
    if rows != left + right + 1:
        raise ValueError(
            f"{name} has {rows} rows (shape {tuple(table.shape)}) but old_max_distance="
            f"{max_distance!r} means {left + right + 1} rows (left + right + 1)"
        )
    return left, right


def resize_relative_table(
    table: Tensor,
    new_max_distance: int | tuple[int, int],
    *,
    old_max_distance: int | tuple[int, int] | None = None,
) -> Tensor:
    """Resize a relative position table to the clip distance or window ``new_max_distance``.

    Each side is resized on its own. Growing a side (``left' > left``, or ``right' > right``)
    repeats that side's edge row (the first row for the left side, the last for the right):
    exact, the resized table gives the same attention outputs at every length. Shrinking a side
    drops rows from that end: offsets beyond the new bound then read the row at the bound,
    which changes the model.

    Args:
        table: ``(R, D)`` (shared by all heads) or ``(H, R, D)`` (per head), ``R = 2K + 1`` or
            ``left + right + 1``.
        new_max_distance: ``K' >= 0``, or a window ``(left', right')``.
        old_max_distance: the table's own ``K`` or window; default the symmetric ``K`` of
            its (odd) row count. Required for a window's table with an even row count, and for
            any table of an asymmetric window (an odd row count would be read as ``(K, K)``).

    Returns:
        A new tensor ``(R', D)`` or ``(H, R', D)`` (``R' = left' + right' + 1``) on the same
        device, with the same dtype (differentiable with respect to ``table``).

    Raises:
        TypeError, ValueError: if ``table`` is not such a tensor, a window is not an int
            ``>= 0`` or a pair of them, or the rows disagree with ``old_max_distance``.

    Example:
        >>> t = torch.arange(3.0).view(3, 1)  # K = 1: rows -1, 0, +1
        >>> resize_relative_table(t, 2).flatten().tolist()
        [0.0, 0.0, 1.0, 2.0, 2.0]
        >>> resize_relative_table(t, 0).flatten().tolist()
        [1.0]
        >>> resize_relative_table(t, (3, 0)).flatten().tolist()  # grow left, shrink right
        [0.0, 0.0, 0.0, 1.0]
        >>> resize_relative_table(torch.arange(4.0).view(4, 1), 1,  # rows -2, -1, 0, +1
        ...                       old_max_distance=(2, 1)).flatten().tolist()
        [1.0, 2.0, 3.0]
    """
    old_left, old_right = table_window(table, old_max_distance)
    new_left, new_right = check_window(new_max_distance, "new_max_distance")
    if (new_left, new_right) == (old_left, old_right):
        return table.clone()
    # Keep the rows of offsets -min(left, left') .. +min(right, right'), then repeat the edges.
    start = old_left - min(old_left, new_left)
    kept = table.narrow(-2, start, min(old_left, new_left) + min(old_right, new_right) + 1)
    pad_left, pad_right = max(new_left - old_left, 0), max(new_right - old_right, 0)
    if not (pad_left or pad_right):
        return kept.clone()
    reps = (1,) * (table.dim() - 2)
    first = kept.narrow(-2, 0, 1).repeat(*reps, pad_left, 1)  # (..., pad_left, D)
    last = kept.narrow(-2, kept.shape[-2] - 1, 1).repeat(*reps, pad_right, 1)
    return torch.cat([first, kept, last], dim=-2)


def load_state_dict_resized(
    module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> Any:
    """``module.load_state_dict(state_dict)`` that resizes relative tables saved with another
    clip distance or window.

    For every :class:`relpos.RelativeMultiheadAttention` inside ``module`` whose saved tables
    have a different window than the module (read from the saved ``_extra_state``, or, without
    one, the symmetric ``K`` of the row count), each side of the tables is resized with
    :func:`resize_relative_table` (exact when growing, see there) before loading. A different
    relative-position convention still raises.

    Args:
        module: the module to load into (its windows are the targets).
        state_dict: a state saved from a module with the same structure, any windows.
        strict: as in ``nn.Module.load_state_dict``.

    Returns:
        What ``module.load_state_dict`` returns (missing and unexpected keys).

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``, ``state_dict`` not a mapping or
            ``strict`` not a bool.
        relpos.versioning.RelativeStateError: if a saved convention differs.
        ValueError: if a saved table's number of rows disagrees with its saved window.

    Example:
        >>> small = relpos.RelativeMultiheadAttention(16, 2, max_distance=2)
        >>> big = relpos.RelativeMultiheadAttention(16, 2, max_distance=(5, 3))
        >>> relpos.load_state_dict_resized(big, small.state_dict())
        <All keys matched successfully>
    """
    from relpos.modules.attention import RelativeMultiheadAttention

    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of names to tensors (as module.state_dict() "
            f"returns), got {type(state_dict).__name__}"
        )
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool (True or False), got {strict!r}")
    resized = dict(state_dict)
    for name, sub in module.named_modules():
        if not isinstance(sub, RelativeMultiheadAttention):
            continue
        prefix = f"{name}." if name else ""
        where = name or type(module).__name__
        tables = {
            key: resized[prefix + key]
            for key in ("rel_keys", "rel_values")
            if isinstance(resized.get(prefix + key), Tensor)
        }
        state_key = prefix + _EXTRA_STATE
        saved: int | tuple[int, int]
        if state_key in resized:
            saved = check_state(
                resized[state_key], max_distance=sub.max_distance, where=where, allow_resize=True
            )["max_distance"]
        elif tables:
            saved = table_max_distance(next(iter(tables.values())), prefix + "rel_keys")
        else:
            continue
        saved_window, target = check_window(saved), sub.window
        for key, table in tables.items():
            rows = table.shape[-2] if table.dim() in (2, 3) else None
            if rows != sum(saved_window) + 1:
                raise ValueError(
                    f"{prefix + key} has shape {tuple(table.shape)} but its module state says "
                    f"{describe_window(saved)}"
                )
            if saved_window != target:
                with torch.no_grad():
                    resized[prefix + key] = resize_relative_table(
                        table, target, old_max_distance=saved_window
                    )
        if state_key in resized:
            resized[state_key] = make_state(sub.max_distance)
    return module.load_state_dict(resized, strict=strict)
