"""The Triton backend as the custom op ``relpos::triton_attention``, with its autograd formula.

The op has a fake implementation (for ``torch.compile`` and ``torch.export``) and a backward
through the op ``relpos::triton_attention_backward``; both are checked with
``torch.library.opcheck`` under the interpreter. The op reads its inputs in any layout (it
makes them contiguous once). Importing this module does not import Triton: the kernels load
on the first call.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim, R table rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from relpos.ops.call import accumulation_dtype, empty_gradients

__all__ = ["triton_attention"]


@torch.library.custom_op("relpos::triton_attention", mutates_args=())
def triton_attention(
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
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``out (B, H, L, Dv)``, logsumexp ``(B, H, L)`` and the bucket masses
    ``Pb (B, H, L, R)`` (empty without a values table; the last two for the backward)."""
    B, H, L, _ = query.shape
    S, Dv = key.shape[2], value.shape[-1]
    acc = accumulation_dtype(query.dtype)
    if L == 0 or S == 0 or B * H == 0:
        lse = torch.full((B, H, L), math.inf, dtype=acc, device=query.device)
        rows = 0 if rel_values is None else left + right + 1
        pb = query.new_zeros((B, H, L, rows) if rows else (0,), dtype=acc)
        return query.new_zeros(B, H, L, Dv), lse, pb
    from relpos.ops.triton import launch

    return launch.forward(
        query.contiguous(), key.contiguous(), value.contiguous(), rel_keys, rel_values, key_mask,
        left=left, right=right, is_causal=is_causal, scale=scale, query_start=query_start,
    )


@triton_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
      rel_values: Tensor | None, key_mask: Tensor | None, *, left: int, right: int,
      **_options: object) -> tuple[Tensor, Tensor, Tensor]:
    B, H, L, _ = query.shape
    acc = accumulation_dtype(query.dtype)
    pb_shape = (0,) if rel_values is None else (B, H, L, left + right + 1)
    return (query.new_empty(B, H, L, value.shape[-1]), query.new_empty(B, H, L, dtype=acc),
            query.new_empty(pb_shape, dtype=acc))


@torch.library.custom_op("relpos::triton_attention_backward", mutates_args=())
def triton_attention_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    key_mask: Tensor | None,
    out: Tensor,
    lse: Tensor,
    pb: Tensor,
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
        from relpos.ops.triton import launch

        dq, dk, dv, drk, drv = launch.backward(
            grad_out, query.contiguous(), key.contiguous(), value.contiguous(), rel_keys,
            rel_values, key_mask, out, lse, pb, left=left, right=right, is_causal=is_causal,
            scale=scale, query_start=query_start,
        )
    return (
        dq, dk, dv,
        query.new_empty(0) if drk is None else drk,
        query.new_empty(0) if drv is None else drv,
    )


@triton_attention_backward.register_fake
def _(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, *_saved: object, **_options: object,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return empty_gradients(query, key, value, rel_keys, rel_values)


def _setup_context(
    ctx: object, inputs: tuple[object, ...], keyword_only_inputs: dict[str, object],
    output: tuple[Tensor, ...],
) -> None:
    out, lse, pb = output
    ctx.save_for_backward(*inputs, out, lse, pb)  # type: ignore[attr-defined]
    ctx.set_materialize_grads(False)  # type: ignore[attr-defined]  # only ``out`` is public
    ctx.options = dict(keyword_only_inputs)  # type: ignore[attr-defined]


def _backward(ctx: object, grad_out: Tensor | None, *_unused: object) -> tuple[object, ...]:
    q, k, v, rk, rv, km, out, lse, pb = ctx.saved_tensors  # type: ignore[attr-defined]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, drk, drv = triton_attention_backward(
        grad_out, q, k, v, rk, rv, km, out, lse, pb,
        **ctx.options,  # type: ignore[attr-defined]
    )
    return dq, dk, dv, None if rk is None else drk, None if rv is None else drv, None


torch.library.register_autograd(
    "relpos::triton_attention", _backward, setup_context=_setup_context
)
