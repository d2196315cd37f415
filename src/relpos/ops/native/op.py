"""The native kernels as the custom op ``relpos::native_attention``, with its autograd formula.

The op has a fake implementation (for ``torch.compile`` and ``torch.export``) and a backward
through the op ``relpos::native_attention_backward``; both are checked with
``torch.library.opcheck``. The op reads its inputs in any layout (the kernels make them
contiguous once). Half precision (``float16``, ``bfloat16``) runs in float32 inside: the
inputs are widened once, every sum and statistic is float32, the result is rounded once.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
R = left + right + 1 table rows, Hr table heads (1 or H).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relpos.ops._custom_op import Gradients, empty_outputs, is_empty, register_attention_autograd
from relpos.ops._numerics import accumulation_dtype
from relpos.ops.native.build import load

__all__ = ["dropout_mask", "forward", "native_attention"]


def _kernels():
    module = load()
    if module is None:
        raise RuntimeError("the native kernels are not available (see relpos.ops.native.build)")
    return module


def _kernel_options(
    *, left: int, right: int, is_causal: bool, scale: float, query_start: int, dropout_p: float
) -> object:
    """The op's keyword options as the kernels' one ``AttentionOptions`` struct."""
    return _kernels().AttentionOptions(
        left=left, right=right, is_causal=is_causal, scale=scale, query_start=query_start,
        dropout_p=dropout_p,
    )


def _wide(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _expanded(mask: Tensor | None, query: Tensor, key: Tensor) -> Tensor | None:
    """A mask broadcastable to ``(B, H, L, S)`` as a ``(B, H, L, S)`` view (stride 0 where it
    broadcasts; the kernels read it in place)."""
    if mask is None:
        return None
    B, H, L, _ = query.shape
    return mask.expand(B, H, L, key.shape[2])


def _fake(query: Tensor, key: Tensor, value: Tensor, *_inputs: object, **_options: object) -> tuple[
    Tensor, Tensor
]:
    B, H, L, _ = query.shape
    Dv = value.shape[-1]
    return query.new_empty(B, H, L, Dv), query.new_empty(
        B, H, L, dtype=accumulation_dtype(query.dtype))


def forward(
    query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_bias: Tensor | None, attn_bias: Tensor | None,
    seed: Tensor | None, *, left: int, right: int, is_causal: bool, scale: float,
    query_start: int, dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """The forward of :func:`native_attention`, without the custom op's dispatch (what
    inference calls directly: no autograd, no tracing)."""
    if is_empty(query, key):
        return empty_outputs(_fake(query, key, value))
    acc = accumulation_dtype(query.dtype)
    q, k, v, rk, rv, kb, mb = (_wide(t, acc) for t in (query, key, value, rel_keys, rel_values,
                                                        key_bias, attn_bias))
    out, lse = _kernels().forward(
        q, k, v, rk, rv, kb, _expanded(mb, query, key), seed,
        _kernel_options(left=left, right=right, is_causal=is_causal, scale=scale,
                        query_start=query_start, dropout_p=dropout_p),
    )
    return out.to(query.dtype), lse


@torch.library.custom_op("relpos::native_attention", mutates_args=())
def native_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    key_bias: Tensor | None,
    attn_bias: Tensor | None,
    seed: Tensor | None,
    *,
    left: int,
    right: int,
    is_causal: bool,
    scale: float,
    query_start: int,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """Returns ``out (B, H, L, Dv)`` and the logsumexp ``(B, H, L)`` (``+inf`` for rows that
    see no key; kept for the backward).

    ``key_bias`` is ``(B, S)``, added to every query's score of key ``j`` (``-inf`` hides the
    key); ``attn_bias`` a float mask broadcastable to ``(B, H, L, S)``, added to the scores
    (``-inf`` hides the pair); ``seed`` is two int64 (the dropout stream), or None without
    dropout.
    """
    return forward(
        query, key, value, rel_keys, rel_values, key_bias, attn_bias, seed, left=left,
        right=right, is_causal=is_causal, scale=scale, query_start=query_start,
        dropout_p=dropout_p,
    )


native_attention.register_fake(_fake)


def _backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_bias: Tensor | None, attn_bias: Tensor | None,
    seed: Tensor | None, out: Tensor, lse: Tensor, *, left: int, right: int, is_causal: bool,
    scale: float, query_start: int, dropout_p: float,
) -> Gradients:
    """What ``relpos::native_attention_backward`` computes for a non-empty call.
    Deterministic: the table gradients are reduced in a fixed order."""
    acc = accumulation_dtype(query.dtype)
    go, q, k, v, rk, rv, kb, mb, o = (
        _wide(t, acc)
        for t in (grad_out, query, key, value, rel_keys, rel_values, key_bias, attn_bias, out)
    )
    dq, dk, dv, drk, drv = _kernels().backward(
        go, q, k, v, rk, rv, kb, _expanded(mb, query, key), seed, o, lse,
        _kernel_options(left=left, right=right, is_causal=is_causal, scale=scale,
                        query_start=query_start, dropout_p=dropout_p),
    )
    dtype = query.dtype
    return (
        dq.to(dtype), dk.to(dtype), dv.to(dtype),
        None if rel_keys is None else drk.to(dtype),
        None if rel_values is None else drv.to(dtype),
    )


native_attention_backward = register_attention_autograd(
    "relpos::native_attention", _backward, saved_outputs=("out", "lse")
)


def dropout_mask(seed: Tensor, shape: tuple[int, int, int, int], dropout_p: float) -> Tensor:
    """The keep mask ``(B, H, L, S)`` (True = kept) that the native kernels apply for the
    dropout stream ``seed`` (two int64) at probability ``dropout_p``: the attention output is
    ``(P * mask / (1 - dropout_p)) @ (V + aV)``. Lets a test apply the very same mask to the
    reference."""
    B, H, L, S = shape
    return _kernels().dropout_mask(seed, B, H, L, S, float(dropout_p))
