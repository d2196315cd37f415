"""What a saved relative-attention state means: format version, clip window and convention.

Every :class:`relpos.RelativeMultiheadAttention` stores, next to its tables, a small int64
tensor under ``<prefix>._extra_state``. Two formats exist; a module writes the oldest one that
can say its window, so a module with a clip distance ``K`` saves exactly what earlier relpos
releases saved (and they can read it back)::

    version 1 (a clip distance K, left == right):  [1, K, offset_sign, alignment]
    version 2 (a window (left, right)):            [2, left, right, offset_sign, alignment]

- ``format_version``: 1 or 2, as above (:data:`FORMAT_VERSION` is the newest this relpos
  reads);
- ``K`` / ``left, right``: the clip window the tables were trained with: offsets clipped to
  ``[-K, K]`` (``2K + 1`` rows) or ``[-left, +right]`` (``left + right + 1`` rows, row
  ``r + left`` holding offset ``r``); version 1 ``[1, K, ...]`` means the window ``(K, K)``;
- ``offset_sign``: ``+1`` for offsets ``j - i`` (key minus query, relpos's convention; row 0
  of a table is "far backward"), ``-1`` for ``i - j`` (the table read upside down);
- ``alignment``: ``1`` for bottom-right (with L queries over S keys, query ``i`` sits at
  position ``i + S - L``, relpos's convention), ``0`` for top-left (query ``i`` at ``i``).

It is a tensor (not a dict) so that state dicts stay plain ``name -> tensor`` maps that
``torch.save`` with ``weights_only=True`` and ``safetensors`` both accept. Loading a state whose
window or convention differs from the module's raises :class:`RelativeStateError` (``K`` and
``(K, K)`` are the same window); a different window can be loaded on purpose with
:func:`relpos.load_state_dict_resized`, which resizes each side of the tables.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from relpos.positions import check_window

__all__ = [
    "ALIGNMENT_BOTTOM_RIGHT",
    "FORMAT_VERSION",
    "OFFSET_KEY_MINUS_QUERY",
    "RelativeStateError",
    "check_state",
    "describe_state",
    "describe_window",
    "make_state",
    "parse_state",
]

FORMAT_VERSION = 2
"""Newest saved-state format this relpos reads (it writes 1 for a clip distance ``K`` and 2
for a window ``(left, right)`` with ``left != right``)."""

OFFSET_KEY_MINUS_QUERY = 1
"""``offset_sign`` of relpos's convention: the offset of key ``j`` seen from query ``i`` is
``j - i``."""

ALIGNMENT_BOTTOM_RIGHT = 1
"""``alignment`` of relpos's convention: queries aligned to the end of the keys."""

# Number of values of each format version.
_STATE_LEN = {1: 4, 2: 5}
_LAYOUT = {
    1: "[1, max_distance, offset_sign, alignment]",
    2: "[2, left, right, offset_sign, alignment]",
}


class RelativeStateError(ValueError):
    """A saved state does not mean what the module it is loaded into computes."""


def describe_window(max_distance: object) -> str:
    """``max_distance=K (2K+1 rows)`` or ``max_distance=(left, right) (left+right+1 rows)``:
    a clip distance or window as messages name it."""
    left, right = check_window(max_distance)
    shown = str(left) if left == right and not isinstance(max_distance, (tuple, list)) else (
        f"({left}, {right})")
    rows = left + right + 1
    return f"max_distance={shown} ({rows} row{'' if rows == 1 else 's'})"


def make_state(max_distance: int | tuple[int, int]) -> Tensor:
    """The ``_extra_state`` tensor of a module with clip distance ``K`` or window
    ``(left, right)``: format version 1 when ``left == right``, 2 otherwise."""
    left, right = check_window(max_distance)
    window = [left] if left == right else [left, right]
    return torch.tensor(
        [1 if left == right else 2, *window, OFFSET_KEY_MINUS_QUERY, ALIGNMENT_BOTTOM_RIGHT],
        dtype=torch.int64,
    )


def _unrecognized(where: str, shown: object, why: str = "") -> RelativeStateError:
    return RelativeStateError(
        f"{where}: unrecognized relpos module state {shown}{why}; expected an int64 tensor "
        f"{_LAYOUT[1]} or {_LAYOUT[2]} as written by RelativeMultiheadAttention.state_dict()"
    )


def parse_state(state: object, where: str = "state") -> dict[str, Any]:
    """Decode an ``_extra_state`` tensor (format version 1 or 2) into named fields.

    Returns:
        ``format_version``, ``left``, ``right``, ``max_distance`` (``K`` for a version-1 state,
        ``(left, right)`` for a version-2 one), ``offset_sign`` and ``alignment``.

    Raises:
        RelativeStateError: if ``state`` is not such a tensor, or was written by a newer
            format version.
    """
    if (
        not isinstance(state, Tensor) or state.dim() != 1 or state.numel() < _STATE_LEN[1]
        or state.is_complex()
    ):
        shown = tuple(state.shape) if isinstance(state, Tensor) else type(state).__name__
        raise _unrecognized(where, shown)
    raw = state.tolist()
    if not all(isinstance(x, int) or (math.isfinite(x) and x == int(x)) for x in raw):
        raise _unrecognized(
            where, raw, f" (dtype {state.dtype}): its values must be whole finite numbers"
        )
    values = [int(x) for x in raw]
    version = values[0]
    if version < 1 or version > FORMAT_VERSION:
        raise RelativeStateError(
            f"{where}: saved with relpos state format version {version}; this relpos reads "
            f"versions 1..{FORMAT_VERSION} (upgrade relpos to load it)"
        )
    if len(values) < _STATE_LEN[version]:
        raise _unrecognized(
            where, values, f": format version {version} has {_STATE_LEN[version]} values"
        )
    if version == 1:
        _, k, sign, alignment = values[:4]
        left = right = k
        max_distance: int | tuple[int, int] = k
    else:
        _, left, right, sign, alignment = values[:5]
        max_distance = (left, right)
    if left < 0 or right < 0:
        raise _unrecognized(where, values, ": a negative clip distance")
    return {
        "format_version": version,
        "left": left,
        "right": right,
        "max_distance": max_distance,
        "offset_sign": sign,
        "alignment": alignment,
    }


def describe_state(fields: Mapping[str, Any]) -> str:
    """One-line description of a decoded state, e.g. for error messages."""
    sign = {1: "offset j - i", -1: "offset i - j"}.get(
        fields["offset_sign"], f"unknown offset sign {fields['offset_sign']}"
    )
    align = {1: "bottom-right alignment", 0: "top-left alignment"}.get(
        fields["alignment"], f"unknown alignment {fields['alignment']}"
    )
    return f"{describe_window(fields['max_distance'])}, {sign}, {align}"


def check_state(
    state: object,
    *,
    max_distance: int | tuple[int, int],
    where: str = "state",
    allow_resize: bool = False,
) -> dict[str, Any]:
    """Check that a saved ``_extra_state`` matches a module with clip distance ``K`` or window
    ``(left, right)`` ``max_distance`` (``K`` and ``(K, K)`` are the same window).

    Args:
        state: the saved ``_extra_state`` tensor.
        max_distance: the module's ``K`` or ``(left, right)``.
        where: name of the module in messages (its state-dict prefix).
        allow_resize: accept a different window (the caller resizes the tables).

    Returns:
        The decoded fields (see :func:`parse_state`).

    Raises:
        RelativeStateError: on a different convention, or a different window unless
            ``allow_resize``.
    """
    fields = parse_state(state, where)
    ours = {
        "format_version": FORMAT_VERSION,
        "max_distance": max_distance,
        "offset_sign": OFFSET_KEY_MINUS_QUERY,
        "alignment": ALIGNMENT_BOTTOM_RIGHT,
    }
    if (fields["offset_sign"], fields["alignment"]) != (
        OFFSET_KEY_MINUS_QUERY,
        ALIGNMENT_BOTTOM_RIGHT,
    ):
        raise RelativeStateError(
            f"{where}: the saved tables use a different relative-position convention "
            f"({describe_state(fields)}) than this module ({describe_state(ours)}); relpos "
            f"cannot load them as they are"
        )
    if (fields["left"], fields["right"]) != check_window(max_distance) and not allow_resize:
        raise RelativeStateError(
            f"{where}: the saved tables were trained with "
            f"{describe_window(fields['max_distance'])} but this module has "
            f"{describe_window(max_distance)}; to load them anyway use "
            f"relpos.load_state_dict_resized(module, state_dict) (resizes each side: grows by "
            f"repeating that side's edge row, exact; shrinks by clipping, changes the model)"
        )
    return fields
