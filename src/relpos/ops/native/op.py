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

from relpos.ops.call import accumulation_dtype, empty_gradients
from relpos.ops.native.build import load

__all__ = ["dropout_mask", "forward", "native_attention"]


def _kernels():
    module = load()
    if module is None:
        raise RuntimeError("the native kernels are not available (see relpos.ops.native.build)")
    return module


def _wide(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _expanded(mask: Tensor | None, query: Tensor, key: Tensor) -> Tensor | None:
    """A mask broadcastable to ``(B, H, L, S)`` as a ``(B, H, L, S)`` view (stride 0 where it
    broadcasts; the kernels read it in place)."""
    if mask is None:
        return None
    B, H, L, _ = query.shape
    return mask.expand(B, H, L, key.shape[2])


def forward(
    query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_bias: Tensor | None, attn_bias: Tensor | None,
    seed: Tensor | None, *, left: int, right: int, is_causal: bool, scale: float,
    query_start: int, dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """The forward of :func:`native_attention`, without the custom op's dispatch (what
    inference calls directly: no autograd, no tracing)."""
    B, H, L, _ = query.shape
    S, Dv = key.shape[2], value.shape[-1]
    acc = accumulation_dtype(query.dtype)
    if L == 0 or S == 0 or B * H == 0:
        out = query.new_zeros(B, H, L, Dv)
        return out, torch.full((B, H, L), float("inf"), dtype=acc, device=query.device)
    q, k, v, rk, rv, kb, mb = (_wide(t, acc) for t in (query, key, value, rel_keys, rel_values,
                                                        key_bias, attn_bias))
    out, lse = _kernels().forward(
        q, k, v, rk, rv, kb, _expanded(mb, query, key), left, right, is_causal, scale,
        query_start, dropout_p, seed,
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


@native_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, *_inputs: object, **_options: object) -> tuple[
    Tensor, Tensor
]:
    B, H, L, _ = query.shape
    Dv = value.shape[-1]
    return query.new_empty(B, H, L, Dv), query.new_empty(
        B, H, L, dtype=accumulation_dtype(query.dtype))


@torch.library.custom_op("relpos::native_attention_backward", mutates_args=())
def native_attention_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    key_bias: Tensor | None,
    attn_bias: Tensor | None,
    seed: Tensor | None,
    out: Tensor,
    lse: Tensor,
    *,
    left: int,
    right: int,
    is_causal: bool,
    scale: float,
    query_start: int,
    dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients for query, key, value, rel_keys, rel_values (empty tensors for absent
    tables). Deterministic: the table gradients are reduced in a fixed order."""
    B, H, L, _ = query.shape
    S = key.shape[2]
    if L == 0 or S == 0 or B * H == 0:
        dq, dk, dv = (x.new_zeros(x.shape) for x in (query, key, value))
        drk = query.new_empty(0) if rel_keys is None else rel_keys.new_zeros(rel_keys.shape)
        drv = query.new_empty(0) if rel_values is None else rel_values.new_zeros(rel_values.shape)
        return dq, dk, dv, drk, drv
    acc = accumulation_dtype(query.dtype)
    go, q, k, v, rk, rv, kb, mb, o = (
        _wide(t, acc)
        for t in (grad_out, query, key, value, rel_keys, rel_values, key_bias, attn_bias, out)
    )
    dq, dk, dv, drk, drv = _kernels().backward(
        go, q, k, v, rk, rv, kb, _expanded(mb, query, key), o, lse, left, right, is_causal,
        scale, query_start, dropout_p, seed,
    )
    dtype = query.dtype
    return (
        dq.to(dtype), dk.to(dtype), dv.to(dtype),
        query.new_empty(0) if rel_keys is None else drk.to(dtype),
        query.new_empty(0) if rel_values is None else drv.to(dtype),
    )


@native_attention_backward.register_fake
def _(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, *_saved: object, **_options: object,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return empty_gradients(query, key, value, rel_keys, rel_values)


def _setup_context(
    ctx: object, inputs: tuple[object, ...], keyword_only_inputs: dict[str, object],
    output: tuple[Tensor, ...],
) -> None:
    out, lse = output
    ctx.save_for_backward(*inputs, out, lse)  # type: ignore[attr-defined]
    ctx.set_materialize_grads(False)  # type: ignore[attr-defined]  # only ``out`` is public
    ctx.options = dict(keyword_only_inputs)  # type: ignore[attr-defined]


def _backward(ctx: object, grad_out: Tensor | None, *_unused: object) -> tuple[object, ...]:
    q, k, v, rk, rv, kb, mb, seed, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, drk, drv = native_attention_backward(
        grad_out, q, k, v, rk, rv, kb, mb, seed, out, lse,
        **ctx.options,  # type: ignore[attr-defined]
    )
    return (dq, dk, dv, None if rk is None else drk, None if rv is None else drv, None, None,
            None)


torch.library.register_autograd(
    "relpos::native_attention", _backward, setup_context=_setup_context
)


def dropout_mask(seed: Tensor, shape: tuple[int, int, int, int], dropout_p: float) -> Tensor:
    """The keep mask ``(B, H, L, S)`` (True = kept) that the native kernels apply for the
    dropout stream ``seed`` (two int64) at probability ``dropout_p``: the attention output is
    ``(P * mask / (1 - dropout_p)) @ (V + aV)``. Lets a test apply the very same mask to the
    reference."""
    B, H, L, S = shape
    return _kernels().dropout_mask(seed, B, H, L, S, float(dropout_p))
