"""Run relpos's attention modules, layers and models on a sequence sharded over ranks.

:func:`context_parallel` routes the self-attention of every
:class:`~relpos.modules.RelativeMultiheadAttention` inside a model through
:func:`~relpos.distributed.context_parallel_attention`. Everything else in a transformer acts
on each token alone (embeddings, projections, norms, feed-forward, the output head), so the
model then takes this rank's shard of the ids (or of ``(B, n, E)`` inputs), of the key mask
and of the labels, cut by :func:`~relpos.distributed.shard_sequence`, and returns this rank's
rows of what it returns on the whole sequence, forward and backward.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor, nn

from relpos.distributed._checks import MODES, _check_layout, _initialized_group
from relpos.distributed.context_parallel import context_parallel_attention
from relpos.modules.attention import RelativeMultiheadAttention

__all__ = ["context_parallel", "is_context_parallel"]

_MARK = "_relpos_context_parallel"


def is_context_parallel(model: nn.Module) -> bool:
    """Whether :func:`context_parallel` routed this module (or any inside it)."""
    return any(getattr(m, _MARK, None) is not None for m in model.modules())


def _attend(self: RelativeMultiheadAttention, q: Tensor, k: Tensor, v: Tensor, *,
            attn_mask: Tensor | None = None, key_mask: Tensor | None = None,
            is_causal: bool = False, need_weights: bool = False,
            query_start: int | None = None) -> tuple[Tensor, Tensor | None]:
    """``RelativeMultiheadAttention.attend`` on this rank's shard (see :func:`context_parallel`)."""
    group, layout, mode, head_group = getattr(self, _MARK)
    if attn_mask is not None:  # a float key padding mask (torch.nn canonicalizes to float)
        key_mask, attn_mask = _as_key_mask(attn_mask, key_mask, q)
    refused = [name for name, given in (("attn_mask", attn_mask is not None),
                                        ("need_weights=True", need_weights),
                                        ("query_start", query_start is not None)) if given]
    if refused:
        raise ValueError(
            f"under context parallelism self-attention takes key_padding_mask/key_mask and "
            f"is_causal only, got {', '.join(refused)} (the scores of a sharded sequence are "
            f"never whole on one rank: pass need_weights=False, use is_causal for a causal mask)"
        )
    out = context_parallel_attention(
        q, k, v, group=group, max_distance=self.max_distance, rel_keys=self.rel_keys,
        rel_values=self.rel_values, is_causal=is_causal, key_mask=key_mask,
        dropout_p=self.dropout if self.training else 0.0, layout=layout, mode=mode,
        head_group=head_group,
    )
    return out, None


def _as_key_mask(attn_mask: Tensor, key_mask: Tensor | None, q: Tensor) -> tuple[
    Tensor | None, Tensor | None
]:
    """A mask that hides whole keys, ``(B, 1, 1, S)`` bool or of 0 / -inf floats, as a key
    mask (what ``torch.nn.TransformerEncoder`` makes of ``src_key_padding_mask``); any other
    mask comes back as it was (and is refused)."""
    B, S = q.shape[0], q.shape[2]
    if attn_mask.dim() != 4 or attn_mask.shape[1:3] != (1, 1) or attn_mask.shape[3] != S \
            or attn_mask.shape[0] not in (1, B):
        return key_mask, attn_mask
    if attn_mask.dtype == torch.bool:
        visible = attn_mask[:, 0, 0]
    elif bool(((attn_mask == 0) | (attn_mask == -torch.inf)).all()):
        visible = attn_mask[:, 0, 0] == 0
    else:
        return key_mask, attn_mask
    visible = visible.expand(B, S)
    return (visible if key_mask is None else key_mask & visible), None


def _forward(self: RelativeMultiheadAttention, query: Tensor, key: Tensor | None = None,
             value: Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
    """``RelativeMultiheadAttention.forward``, refusing what a sharded sequence cannot do."""
    self_attention = (key is None or key is query) and (value is None or value is query)
    if not self_attention:
        raise ValueError(
            "context parallelism serves self-attention only (query, key and value the same "
            "sharded sequence); this module was called with another key/value (cross-"
            "attention): leave it out of context_parallel(...)"
        )
    for name in ("cache", "cu_seqlens", "cu_seqlens_k"):
        if kwargs.get(name) is not None:
            raise ValueError(f"context parallelism does not take {name}= (a sharded sequence "
                             f"is one padded batch): remove it or undo context_parallel")
    return type(self).forward(self, query, key, value, *args, **kwargs)


def context_parallel(model: nn.Module, group: Any = None, *, layout: str = "contiguous",
                     mode: str = "ring", modules: list[nn.Module] | None = None,
                     head_group: int | None = None) -> int:
    """Route the self-attention of ``model``'s relpos attention modules over ``group``.

    Every :class:`~relpos.modules.RelativeMultiheadAttention` in ``model`` (or only those in
    ``modules``: leave out cross-attention) then runs
    :func:`~relpos.distributed.context_parallel_attention` with its own tables, window and
    dropout: each rank passes its shard of the sequence (``layout`` as in
    :func:`~relpos.distributed.shard_sequence`) and gets its rows of the whole model's
    output. Parameters, state dict and ``torch.nn`` arguments are unchanged; masks are the
    key padding mask (``key_padding_mask`` or ``key_mask``, sharded like the input) and
    ``is_causal``; weights, ``attn_mask``, caches and packed batches are refused with a clear
    error. ``group`` may be a process group or a 1-D ``DeviceMesh`` (e.g. ``mesh["cp"]``).
    Table gradients are each rank's partial sums: DDP or FSDP over a mesh that includes the
    context-parallel ranks reduce them with the other weights. Returns how many modules it
    routed; calling it again re-routes them (to another group, layout or mode).
    ``head_group``: all-gather mode only, gather that many heads at a time (see
    :func:`~relpos.distributed.context_parallel_attention`).

    Raises:
        ValueError: an unknown layout or mode, no relpos attention module, a model with
            absolute positions (``positions="learned"``/``"sinusoidal"``: each rank would
            number its shard from 0).
        RuntimeError: torch.distributed not initialized.
    """
    layout = _check_layout(layout)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if head_group is not None and mode != "all_gather":
        raise ValueError(f"head_group bounds what mode='all_gather' gathers, got mode={mode!r}")
    if hasattr(group, "get_group") and hasattr(group, "ndim"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"context_parallel takes a 1-D device mesh (e.g. mesh['cp']), got "
                             f"one of {group.ndim} dims {group.mesh_dim_names}")
        group = group.get_group()
    _initialized_group(group)
    config = getattr(model, "config", None)
    positions = getattr(config, "positions", "relative")
    if positions not in ("relative", "none"):
        raise ValueError(
            f"context parallelism needs a model without absolute positions, got "
            f"positions={positions!r}: each rank would number its shard from 0"
        )
    chosen = [m for m in (model.modules() if modules is None else modules)
              if isinstance(m, RelativeMultiheadAttention)]
    if not chosen:
        raise ValueError(f"{type(model).__name__} holds no relpos RelativeMultiheadAttention "
                         f"module: nothing to run under context parallelism")
    for m in chosen:
        setattr(m, _MARK, (group, layout, mode, head_group))
        m.attend = types.MethodType(_attend, m)  # type: ignore[method-assign]
        m.forward = types.MethodType(_forward, m)  # type: ignore[method-assign]
    return len(chosen)
