"""Resizing relative position tables when the clip distance K changes.

A table has ``2K + 1`` rows indexed by ``clip(j - i, -K, K) + K``. Every offset at or beyond
``+-K`` reads the edge row, so growing K to ``K' > K`` by repeating the edge rows gives a table
that computes exactly the same attention at every length: ``clip(r, -K', K')`` lands on a copy of
the row ``clip(r, -K, K)`` lands on. Shrinking to ``K' < K`` keeps the rows ``-K'..K'`` (the new
edge rows are the old rows at ``+-K'``), which changes the model for distances beyond ``K'``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from relpos.positions import check_max_distance
from relpos.versioning import check_state, make_state

__all__ = ["load_state_dict_resized", "resize_relative_table", "table_max_distance"]

_EXTRA_STATE = "_extra_state"


def table_max_distance(table: Tensor, name: str = "table") -> int:
    """K of a table of shape ``(2K+1, D)`` or ``(H, 2K+1, D)``.

    Raises:
        TypeError: if ``table`` is not a tensor.
        ValueError: if it is not 2-D/3-D or has an even number of rows.
    """
    if not isinstance(table, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(table).__name__}")
    if table.dim() not in (2, 3):
        raise ValueError(
            f"{name} must have shape (2K+1, D) or (H, 2K+1, D), got shape {tuple(table.shape)}"
        )
    rows = table.shape[-2]
    if rows % 2 != 1:
        raise ValueError(
            f"{name} has {rows} rows (shape {tuple(table.shape)}); a relative table has an odd "
            f"number 2K+1 of rows"
        )
    return (rows - 1) // 2


def resize_relative_table(table: Tensor, new_max_distance: int) -> Tensor:
    """Resize a relative position table from clip distance K to ``new_max_distance`` K'.

    Growing (K' > K) repeats the first and last rows ``K' - K`` times on their side: exact, the
    resized table gives the same attention outputs at every length. Shrinking (K' < K) keeps
    the middle ``2K' + 1`` rows: offsets beyond ``+-K'`` then read the rows at ``+-K'``, which
    changes the model.

    Args:
        table: ``(2K+1, D)`` (shared by all heads) or ``(H, 2K+1, D)`` (per head).
        new_max_distance: K' >= 0.

    Returns:
        A new tensor ``(2K'+1, D)`` or ``(H, 2K'+1, D)`` on the same device, with the same dtype
        (differentiable with respect to ``table``).

    Raises:
        TypeError, ValueError: if ``table`` is not such a tensor or ``new_max_distance`` is not
            an int >= 0.

    Example:
        >>> t = torch.arange(3.0).view(3, 1)  # K = 1: rows -1, 0, +1
        >>> resize_relative_table(t, 2).flatten().tolist()
        [0.0, 0.0, 1.0, 2.0, 2.0]
        >>> resize_relative_table(t, 0).flatten().tolist()
        [1.0]
    """
    k_old = table_max_distance(table)
    k_new = check_max_distance(new_max_distance, "new_max_distance")
    if k_new == k_old:
        return table.clone()
    if k_new < k_old:
        return table.narrow(-2, k_old - k_new, 2 * k_new + 1).clone()
    pad = k_new - k_old
    first = table.narrow(-2, 0, 1)  # (..., 1, D)
    last = table.narrow(-2, 2 * k_old, 1)  # (..., 1, D)
    reps = (pad, 1) if table.dim() == 2 else (1, pad, 1)
    return torch.cat([first.repeat(reps), table, last.repeat(reps)], dim=-2)


def load_state_dict_resized(
    module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> Any:
    """``module.load_state_dict(state_dict)`` that resizes relative tables saved with another K.

    For every :class:`relpos.RelativeMultiheadAttention` inside ``module`` whose saved tables
    have a different clip distance than the module, the tables are resized with
    :func:`resize_relative_table` (exact when growing, see there) before loading. A different
    relative-position convention still raises.

    Args:
        module: the module to load into (its K values are the targets).
        state_dict: a state saved from a module with the same structure, any K.
        strict: as in ``nn.Module.load_state_dict``.

    Returns:
        What ``module.load_state_dict`` returns (missing and unexpected keys).

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``, ``state_dict`` not a mapping or
            ``strict`` not a bool.
        relpos.versioning.RelativeStateError: if a saved convention differs.
        ValueError: if a saved table's number of rows disagrees with its saved K.

    Example:
        >>> small = relpos.RelativeMultiheadAttention(16, 2, max_distance=2)
        >>> big = relpos.RelativeMultiheadAttention(16, 2, max_distance=5)
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
        if state_key in resized:
            saved_k = check_state(
                resized[state_key], max_distance=sub.max_distance, where=where, allow_resize=True
            )["max_distance"]
        elif tables:
            saved_k = table_max_distance(next(iter(tables.values())), prefix + "rel_keys")
        else:
            continue
        for key, table in tables.items():
            rows_k = table_max_distance(table, prefix + key)
            if rows_k != saved_k:
                raise ValueError(
                    f"{prefix + key} has {table.shape[-2]} rows but its module state says "
                    f"max_distance={saved_k} ({2 * saved_k + 1} rows)"
                )
            if saved_k != sub.max_distance:
                with torch.no_grad():
                    resized[prefix + key] = resize_relative_table(table, sub.max_distance)
        if state_key in resized:
            resized[state_key] = make_state(sub.max_distance)
    return module.load_state_dict(resized, strict=strict)
