"""Argument checks shared by the modules: constructor arguments and torch.nn-meaning masks.

Every error names the argument, what was received and what is allowed (PyTorch's own
messages for these cases name its internals instead: ``Trying to create tensor with negative
dimension``, ``mat1 and mat2 must have the same dtype``).

Shape legend: B batch, H heads, L queries, S keys.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor

from relpos.ops import check_implementation
from relpos.positions import check_int, check_window

__all__ = [
    "MAX_TABLE_ELEMENTS",
    "REQUIRED",
    "check_bool",
    "check_dropout",
    "check_implementation",
    "check_input_tensor",
    "check_module_max_distance",
    "check_optional_dim",
    "check_positive_float",
    "check_positive_int",
    "nn_masks_to_relpos",
]

MAX_TABLE_ELEMENTS = 1 << 28
"""Largest relative table a module allocates (elements; 1 GiB in float32). A clip distance
beyond the longest sequence clips nothing, so a larger table never helps."""


class _Required:
    """Default of a required keyword argument that also has a clear error when missing."""

    def __repr__(self) -> str:
        return "<required>"


REQUIRED: Any = _Required()


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def _positive_int(name: str, value: object, allowed: str) -> int:
    number = check_int(value, name, allowed)
    if number <= 0:
        raise ValueError(f"{name} must be {allowed}, got {number}")
    return number


def check_positive_int(name: str, value: object) -> int:
    return _positive_int(name, value, "a positive int")


def check_optional_dim(name: str, value: object, default: int) -> int:
    """``kdim``/``vdim``: a positive int, or None for ``default`` (``embed_dim``)."""
    if value is None:
        return default
    return _positive_int(name, value, "a positive int or None (= embed_dim)")


def check_positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive float, got {value!r}")
    if not (math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"{name} must be a positive finite float, got {value}")
    return float(value)


def check_dropout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"dropout must be a float in [0, 1), got {value!r}")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {value}")
    return float(value)


def check_module_max_distance(
    owner: str, max_distance: object, *, dropout: object, table_columns: int | None
) -> int | tuple[int, int]:
    """The module's clip distance ``K`` or window ``(left, right)``: required, keyword-only,
    and small enough to allocate its tables of ``left + right + 1`` rows.

    Args:
        owner: the class name, for messages.
        max_distance: the argument (``REQUIRED`` when missing).
        dropout: the third positional argument, to recognize an old positional K.
        table_columns: elements per table row (``D`` or ``H * D``), None = no tables.

    Returns:
        ``K`` as an int for an int, ``(left, right)`` as a tuple for a pair (a list becomes a
        tuple), so that ``get_config()`` gives back what was passed.
    """
    if max_distance is REQUIRED:
        if isinstance(dropout, numbers.Integral) and not isinstance(dropout, bool):
            raise TypeError(
                f"{owner} got {dropout!r} as its third positional argument, which is dropout "
                f"(as in torch.nn), and no max_distance; max_distance is keyword-only: pass "
                f"max_distance={dropout}"
            )
        raise TypeError(
            f"{owner} needs max_distance=K (the clip distance, an int >= 0, keyword-only; "
            f"there is no default) or a window max_distance=(left, right)"
        )
    pair = isinstance(max_distance, (tuple, list))
    left, right = check_window(max_distance)
    rows = left + right + 1
    if table_columns is not None and rows * table_columns > MAX_TABLE_ELEMENTS:
        max_rows = MAX_TABLE_ELEMENTS // table_columns
        if not pair:
            raise ValueError(
                f"max_distance={left} needs relative tables of 2K+1 = {rows} rows x "
                f"{table_columns} ({rows * table_columns} elements each); allowed: at most "
                f"{MAX_TABLE_ELEMENTS} elements, max_distance <= {(max_rows - 1) // 2} for "
                f"this module (a K beyond the longest sequence clips nothing, so use that "
                f"length)"
            )
        raise ValueError(
            f"max_distance=({left}, {right}) needs relative tables of left + right + 1 = "
            f"{rows} rows x {table_columns} ({rows * table_columns} elements each); allowed: "
            f"at most {MAX_TABLE_ELEMENTS} elements, left + right <= {max_rows - 1} for this "
            f"module (a side beyond the longest sequence clips nothing, so cap each side at that "
            f"length)"
        )
    return (left, right) if pair else left


def check_input_tensor(name: str, x: object, *, like: Tensor, ndims: tuple[int, ...],
                       layout: str) -> Tensor:
    """A floating-point input with the dtype and device of the module's parameters ``like``
    (any floating dtype under autocast), with one of ``ndims`` dimensions."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in ndims:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(
            f"{name} has dtype {x.dtype}; allowed: floating point, the module's dtype "
            f"{like.dtype} (token ids go through an nn.Embedding first)"
        )
    if x.device != like.device:
        raise ValueError(
            f"{name} is on {x.device} but the module's parameters are on {like.device}; "
            f"allowed: inputs on the parameters' device (meta inputs need a module on meta: "
            f"module.to(device) or input.to(device))"
        )
    autocast = x.device.type in ("cpu", "cuda", "xpu", "mps") and torch.is_autocast_enabled(
        x.device.type
    )
    if x.dtype != like.dtype and not autocast:
        raise TypeError(
            f"{name} has dtype {x.dtype} but the module's parameters are {like.dtype}; "
            f"allowed: {like.dtype} (convert with input.to({like.dtype}) or module.to("
            f"{x.dtype}), or run under torch.autocast)"
        )
    return x


def _check_mask_tensor(name: str, m: object) -> Tensor:
    if not isinstance(m, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(m).__name__}")
    if m.dtype != torch.bool and not m.is_floating_point():
        raise TypeError(
            f"{name} must be bool (True = NOT allowed, as in torch.nn) or floating point "
            f"(added to the scores), got dtype {m.dtype}"
        )
    return m


def nn_masks_to_relpos(
    attn_mask: object,
    key_padding_mask: object,
    key_mask: object,
    *,
    batch: int,
    heads: int,
    query_len: int,
    key_len: int,
    batched: bool,
    pad_len: int | None = None,
    cached: bool = False,
    names: tuple[str, str] = ("attn_mask", "key_padding_mask"),
) -> tuple[Tensor | None, Tensor | None]:
    """torch.nn's mask meanings -> the functional API's (``attn_mask`` True = may attend,
    ``key_mask`` True = real token).

    Args:
        attn_mask: bool (True = NOT allowed) or float (added): ``(L, S)``, ``(B * H, L, S)``
            (``(H, L, S)`` unbatched) or broadcastable to ``(B, H, L, S)``.
        key_padding_mask: ``(B, S)`` (``(S,)`` unbatched): bool True = padding, or float
            (added to the scores).
        key_mask: relpos's ``(B, S)`` bool, True = real token, passed through (not with
            ``key_padding_mask``).
        batch, heads, query_len, key_len: B, H, L, S of the call.
        batched: the input had a batch dimension.
        pad_len: the length of ``key_padding_mask``/``key_mask`` (default S; the ``t`` new
            tokens of a cached step).
        cached: a KV-cache step: the padding mask must be bool (it is stored with the cache).
        names: the caller's names of ``attn_mask`` and ``key_padding_mask``, for messages.

    Returns:
        ``(attn_mask, key_mask)`` as :func:`relpos.relative_attention` reads them.
    """
    mask_name, pad_name = names
    B, H, L, S = batch, heads, query_len, key_len
    P = S if pad_len is None else pad_len
    if key_mask is not None and not isinstance(key_mask, Tensor):
        raise TypeError(f"key_mask must be a torch.Tensor or None, got {type(key_mask).__name__}")
    if key_padding_mask is not None:
        pad = _check_mask_tensor(pad_name, key_padding_mask)
        if key_mask is not None:
            raise ValueError(
                f"got both {pad_name} (torch.nn's meaning, True = padding) and key_mask "
                f"(relpos's, True = real token); allowed: one of them"
            )
        want = (B, P) if batched else (P,)
        if tuple(pad.shape) != want:
            what = "t" if cached else "S"
            raise ValueError(
                f"{pad_name} must have shape {f'(B, {what})' if batched else f'({what},)'} = "
                f"{want}, got {tuple(pad.shape)}"
            )
        if cached and pad.dtype != torch.bool:
            raise TypeError(
                f"{pad_name} of a cached step must be bool (True = padding; it is stored "
                f"with the cache), got dtype {pad.dtype}"
            )
        if not batched:
            pad = pad.unsqueeze(0)
    else:
        pad = None
    if isinstance(key_mask, Tensor) and not batched and key_mask.dim() == 1:
        key_mask = key_mask.unsqueeze(0)
    out: Tensor | None = None
    if attn_mask is not None:
        mask = _check_mask_tensor(mask_name, attn_mask)
        if mask.dim() == 2:
            if tuple(mask.shape) != (L, S):
                raise ValueError(
                    f"a 2-D {mask_name} must have shape (L, S) = {(L, S)}, got "
                    f"{tuple(mask.shape)}"
                )
        elif mask.dim() == 3:  # (B * H, L, S), as nn.MultiheadAttention takes it
            if tuple(mask.shape) != (B * H, L, S):
                lead = f"(B * H, L, S) with B * H = {B} * {H} = {B * H}" if batched else (
                    f"(H, L, S) with H = {H}")
                raise ValueError(
                    f"a 3-D {mask_name} must have shape {lead}, got {tuple(mask.shape)}"
                )
            mask = mask.view(B, H, L, S)
        elif mask.dim() == 4:
            try:
                ok = torch.broadcast_shapes(tuple(mask.shape), (B, H, L, S)) == (B, H, L, S)
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(
                    f"a 4-D {mask_name} must broadcast to (B, H, L, S) = {(B, H, L, S)}, got "
                    f"{tuple(mask.shape)}"
                )
        else:
            raise ValueError(
                f"{mask_name} must be 2-D (L, S) or 3-D (B * H, L, S) as in torch.nn (or 4-D "
                f"broadcastable to (B, H, L, S)), got shape {tuple(mask.shape)}"
            )
        out = ~mask if mask.dtype == torch.bool else mask
    if pad is not None:
        if pad.dtype == torch.bool:
            key_mask = ~pad
        else:  # a float padding mask is added to the scores
            add = pad[:, None, None, :]  # (B, 1, 1, S)
            if out is None:
                out = add
            elif out.dtype == torch.bool:
                out = add.masked_fill(~out, float("-inf"))
            else:
                out = out + add
    return out, key_mask
