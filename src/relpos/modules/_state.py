"""Loading a saved :class:`~relpos.modules.attention.RelativeMultiheadAttention` state: the
projections of relpos <= 0.1 renamed to ``nn.MultiheadAttention``'s, and the saved window,
convention and table rows checked before any tensor is copied."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from relpos.versioning import RelativeStateError, check_state, describe_window, make_state

__all__ = ["check_saved_state", "convert_old_projections"]

_OLD_PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # relpos <= 0.1 names, converted on load


def check_saved_state(module: Any, state_dict: dict[str, Any], prefix: str) -> None:
    """Check the window and the convention of the state saved under ``prefix`` against the
    module ``module``, naming the module; a state without tables (``nn.MultiheadAttention``'s)
    gets this module's meaning.

    Raises:
        RelativeStateError: on another window or convention, or tables of another size.
    """
    where = prefix[:-1] or type(module).__name__
    state_key = prefix + "_extra_state"
    tables = [n for n in ("rel_keys", "rel_values") if prefix + n in state_dict]
    if state_key in state_dict:
        check_state(state_dict[state_key], max_distance=module.max_distance, where=where)
    elif not tables and prefix + "out_proj.weight" in state_dict:
        # A state without tables (nn.MultiheadAttention's): no relative meaning to check.
        state_dict[state_key] = make_state(module.max_distance)
    rows = sum(module.window) + 1
    for name in tables:
        saved = state_dict[prefix + name]
        if (
            getattr(module, name) is not None and isinstance(saved, Tensor)
            and saved.dim() in (2, 3) and saved.shape[-2] != rows
        ):
            raise RelativeStateError(
                f"{prefix + name}: the saved table has {saved.shape[-2]} rows (shape "
                f"{tuple(saved.shape)}) but this module has "
                f"{describe_window(module.max_distance)}; to load it anyway use "
                f"relpos.load_state_dict_resized(module, state_dict)"
            )


def convert_old_projections(module: Any, state_dict: dict[str, Any], prefix: str) -> None:
    """relpos <= 0.1 saved ``q_proj``/``k_proj``/``v_proj`` linears: rename them to
    nn.MultiheadAttention's ``in_proj_weight``/``in_proj_bias`` (or the separate
    ``*_proj_weight`` when kdim/vdim differ) in ``state_dict``, in place."""
    weights = [state_dict.get(f"{prefix}{p}.weight") for p in _OLD_PROJECTIONS]
    if not all(isinstance(w, Tensor) for w in weights):
        return
    for p in _OLD_PROJECTIONS:
        del state_dict[f"{prefix}{p}.weight"]
    if module._qkv_same_embed_dim and all(
        w.shape == (module.embed_dim, module.embed_dim) for w in weights  # type: ignore[union-attr]
    ):
        state_dict.setdefault(prefix + "in_proj_weight", torch.cat(weights))  # type: ignore[arg-type]
    else:
        for p, w in zip(_OLD_PROJECTIONS, weights, strict=True):
            state_dict.setdefault(f"{prefix}{p}_weight", w)
    biases = [state_dict.pop(f"{prefix}{p}.bias", None) for p in _OLD_PROJECTIONS]
    if all(isinstance(b, Tensor) for b in biases):
        state_dict.setdefault(prefix + "in_proj_bias", torch.cat(biases))
