"""What a saved relative-attention state means: format version, clip distance and convention.

Every :class:`relpos.RelativeMultiheadAttention` stores, next to its tables, a small int64
tensor under ``<prefix>._extra_state``::

    [format_version, max_distance, offset_sign, alignment]

- ``format_version``: :data:`FORMAT_VERSION` of the relpos that saved it;
- ``max_distance``: K, the clip distance the tables of ``2K + 1`` rows were trained with;
- ``offset_sign``: ``+1`` for offsets ``j - i`` (key minus query, relpos's convention; row 0
  of a table is "far backward"), ``-1`` for ``i - j`` (the table read upside down);
- ``alignment``: ``1`` for bottom-right (with L queries over S keys, query ``i`` sits at
  position ``i + S - L``, relpos's convention), ``0`` for top-left (query ``i`` at ``i``).

It is a tensor (not a dict) so that state dicts stay plain ``name -> tensor`` maps that
``torch.save`` with ``weights_only=True`` and ``safetensors`` both accept. Loading a state whose
K or convention differs from the module's raises :class:`RelativeStateError`; a different K can
be loaded on purpose with :func:`relpos.load_state_dict_resized`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = [
    "ALIGNMENT_BOTTOM_RIGHT",
    "FORMAT_VERSION",
    "OFFSET_KEY_MINUS_QUERY",
    "RelativeStateError",
    "check_state",
    "describe_state",
    "make_state",
    "parse_state",
]

FORMAT_VERSION = 1
"""Version of the saved-state format written by this relpos."""

OFFSET_KEY_MINUS_QUERY = 1
"""``offset_sign`` of relpos's convention: the offset of key ``j`` seen from query ``i`` is
``j - i``."""

ALIGNMENT_BOTTOM_RIGHT = 1
"""``alignment`` of relpos's convention: queries aligned to the end of the keys."""

_STATE_LEN = 4


class RelativeStateError(ValueError):
    """A saved state does not mean what the module it is loaded into computes."""


def make_state(max_distance: int) -> Tensor:
    """The ``_extra_state`` tensor of a module with clip distance ``max_distance``."""
    return torch.tensor(
        [FORMAT_VERSION, max_distance, OFFSET_KEY_MINUS_QUERY, ALIGNMENT_BOTTOM_RIGHT],
        dtype=torch.int64,
    )


def parse_state(state: object, where: str = "state") -> dict[str, int]:
    """Decode an ``_extra_state`` tensor into its four named fields.

    Raises:
        RelativeStateError: if ``state`` is not such a tensor, or was written by a newer
            format version.
    """
    if (
        not isinstance(state, Tensor) or state.dim() != 1 or state.numel() < _STATE_LEN
        or state.is_complex()
    ):
        shown = tuple(state.shape) if isinstance(state, Tensor) else type(state).__name__
        raise RelativeStateError(
            f"{where}: unrecognized relpos module state {shown}; expected an int64 tensor "
            f"[format_version, max_distance, offset_sign, alignment] as written by "
            f"RelativeMultiheadAttention.state_dict()"
        )
    raw = state.tolist()
    if not all(isinstance(x, int) or (math.isfinite(x) and x == int(x)) for x in raw):
        raise RelativeStateError(
            f"{where}: unrecognized relpos module state {raw} (dtype {state.dtype}): "
            f"its values must be whole finite numbers; expected an int64 tensor "
            f"[format_version, max_distance, offset_sign, alignment] as written by "
            f"RelativeMultiheadAttention.state_dict()"
        )
    values = [int(x) for x in raw]
    version, max_distance, sign, alignment = values[:_STATE_LEN]
    if version < 1 or version > FORMAT_VERSION:
        raise RelativeStateError(
            f"{where}: saved with relpos state format version {version}; this relpos reads "
            f"versions 1..{FORMAT_VERSION} (upgrade relpos to load it)"
        )
    return {
        "format_version": version,
        "max_distance": max_distance,
        "offset_sign": sign,
        "alignment": alignment,
    }


def describe_state(fields: Mapping[str, int]) -> str:
    """One-line description of a decoded state, e.g. for error messages."""
    sign = {1: "offset j - i", -1: "offset i - j"}.get(
        fields["offset_sign"], f"unknown offset sign {fields['offset_sign']}"
    )
    align = {1: "bottom-right alignment", 0: "top-left alignment"}.get(
        fields["alignment"], f"unknown alignment {fields['alignment']}"
    )
    return f"max_distance={fields['max_distance']}, {sign}, {align}"


def check_state(
    state: object, *, max_distance: int, where: str = "state", allow_resize: bool = False
) -> dict[str, int]:
    """Check that a saved ``_extra_state`` matches a module with clip distance ``max_distance``.

    Args:
        state: the saved ``_extra_state`` tensor.
        max_distance: the module's K.
        where: name of the module in messages (its state-dict prefix).
        allow_resize: accept a different K (the caller resizes the tables).

    Returns:
        The decoded fields (see :func:`parse_state`).

    Raises:
        RelativeStateError: on a different convention, or a different K unless
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
    if fields["max_distance"] != max_distance and not allow_resize:
        raise RelativeStateError(
            f"{where}: the saved tables were trained with max_distance={fields['max_distance']} "
            f"({2 * fields['max_distance'] + 1} rows) but this module has "
            f"max_distance={max_distance} ({2 * max_distance + 1} rows); to load them anyway "
            f"use relpos.load_state_dict_resized(module, state_dict) (grows by repeating the "
            f"edge rows, exact; shrinks by clipping, changes the model)"
        )
    return fields
