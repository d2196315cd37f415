"""The fused backend as the custom op ``relpos::fused_attention``, with its autograd formula.

The op has a fake implementation (for ``torch.compile`` and ``torch.export``) and a backward
through the op ``relpos::fused_attention_backward``; both are checked with
``torch.library.opcheck``. The op reads its inputs in any layout (it makes them contiguous).

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from relpos.ops.call import accumulation_dtype, empty_gradients
from relpos.ops.fused.decomposition import fused_backward, fused_forward

__all__ = ["fused_attention"]


@torch.library.custom_op("relpos::fused_attention", mutates_args=())
def fused_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    key_mask: Tensor | None,
    *,
    left: int,
    right: int,
    is_causal: bool,
    scale: float,
    query_start: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``out (B, H, L, Dv)``, logsumexp ``(B, H, L)``, the far-left output and the
    far masses ``(B, H, L, 2)`` (the last three for the backward)."""
    B, H, L, _ = query.shape
    S, Dv = key.shape[2], value.shape[-1]
    acc = accumulation_dtype(query.dtype)
    if L == 0 or S == 0 or B * H == 0:
        out = query.new_zeros(B, H, L, Dv)
        lse = torch.full((B, H, L), math.inf, dtype=acc, device=query.device)
        masses = torch.zeros(B, H, L, 2, dtype=acc, device=query.device)
        return out, lse, query.new_zeros(B, H, L, Dv), masses
    return fused_forward(
        query.contiguous(), key.contiguous(), value.contiguous(), rel_keys, rel_values, key_mask,
        left=left, right=right, is_causal=is_causal, scale=scale, query_start=query_start,
    )


@fused_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, *_tables: object, **_options: object) -> tuple[
    Tensor, Tensor, Tensor, Tensor
]:
    B, H, L, _ = query.shape
    Dv = value.shape[-1]
    acc = accumulation_dtype(query.dtype)
    out = query.new_empty(B, H, L, Dv)
    lse = query.new_empty(B, H, L, dtype=acc)
    return out, lse, query.new_empty(B, H, L, Dv), query.new_empty(B, H, L, 2, dtype=acc)


@torch.library.custom_op("relpos::fused_attention_backward", mutates_args=())
def fused_attention_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    key_mask: Tensor | None,
    out: Tensor,
    lse: Tensor,
    o_left: Tensor,
    masses: Tensor,
    *,
    left: int,
    right: int,
    is_causal: bool,
    scale: float,
    query_start: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients for query, key, value, rel_keys, rel_values (empty tensors for absent
    tables)."""
    B, H, L, _ = query.shape
    S = key.shape[2]
    if L == 0 or S == 0 or B * H == 0:
        dq, dk, dv = (x.new_zeros(x.shape) for x in (query, key, value))
        drk = None if rel_keys is None else rel_keys.new_zeros(rel_keys.shape)
        drv = None if rel_values is None else rel_values.new_zeros(rel_values.shape)
    else:
        dq, dk, dv, drk, drv = fused_backward(
            grad_out, query.contiguous(), key.contiguous(), value.contiguous(), rel_keys,
            rel_values, key_mask, out, lse, o_left, masses, left=left, right=right,
            is_causal=is_causal, scale=scale, query_start=query_start,
        )
    return (
        dq, dk, dv,
        query.new_empty(0) if drk is None else drk,
        query.new_empty(0) if drv is None else drv,
    )


@fused_attention_backward.register_fake
def _(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, *_saved: object, **_options: object,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return empty_gradients(query, key, value, rel_keys, rel_values)


def _setup_context(
    ctx: object, inputs: tuple[object, ...], keyword_only_inputs: dict[str, object],
    output: tuple[Tensor, ...],
) -> None:
    out, lse, o_left, masses = output
    ctx.save_for_backward(*inputs, out, lse, o_left, masses)  # type: ignore[attr-defined]
    ctx.set_materialize_grads(False)  # type: ignore[attr-defined]  # only ``out`` is public
    ctx.options = dict(keyword_only_inputs)  # type: ignore[attr-defined]


def _backward(ctx: object, grad_out: Tensor | None, *_unused: object) -> tuple[object, ...]:
    q, k, v, rk, rv, km, out, lse, o_left, masses = ctx.saved_tensors  # type: ignore[attr-defined]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, drk, drv = fused_attention_backward(
        grad_out, q, k, v, rk, rv, km, out, lse, o_left, masses,
        **ctx.options,  # type: ignore[attr-defined]
    )
    return dq, dk, dv, None if rk is None else drk, None if rv is None else drv, None


torch.library.register_autograd(
    "relpos::fused_attention", _backward, setup_context=_setup_context
)
