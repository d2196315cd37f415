"""Fused backend: exact clipped relative attention at about the cost of one flash attention.

Exact region decomposition (DESIGN.md §3): for query ``i`` at position ``p_i`` every key with
``j - p_i <= -K`` sees the relative row ``-K`` and every key with ``j - p_i >= K`` the row
``+K``, so those two far regions are plain attention plus one constant per row, served by a
flash kernel that returns its logsumexp (O(n) memory); the band ``|j - p_i| < K`` is computed
explicitly in tiles, and the three parts are merged by logsumexp. The backward hands each flash
backward the global output and logsumexp, so the whole backward is exact too, and
deterministic (no atomics, no scatter with duplicate indices). Equivalent to
:mod:`relpos.ops.reference`.

Registered as the custom op ``relpos::fused_attention`` (with a fake implementation and an
autograd formula through ``relpos::fused_attention_backward``), so it can be traced by
``torch.compile(fullgraph=True)``.

Serves: keys term and values term (each optional), shared or per-head tables, ``is_causal``,
``key_mask`` (any pattern, as an O(B·S) key bias, never an L x S mask), ``query_start`` and
``L != S``, every ``K >= 0``; float32, float64, bfloat16 and float16 on CPU; float32, bfloat16
and float16 on CUDA (without ``key_mask``). Not served (see :func:`unsupported_reason`):
dropout, a dense ``attn_mask``, ``Dv != D``.

Internal torch ops: ``aten::_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``) on
CPU and ``aten::_efficient_attention_forward`` / ``_backward`` on CUDA. Tested torch range:
2.13.x on CPU (the CUDA path is checked separately by ``benchmarks/cuda_check.py`` and is only
used when asked for by name). ``tests/test_fused.py`` compares the ops' schemas with the ones
this module was written against and fails loudly when a torch release changes them.

Auto-selection (:func:`auto_reason`) also leaves short sequences (``S < CROSSOVER_KEYS``) to
the bucketed backend, which is faster there; asking for ``implementation="fused"`` by name
only refuses the hard limitations of :func:`unsupported_reason`.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
K clip distance, R = 2K + 1 table rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from relpos.ops._fused_math import fused_backward, fused_forward

__all__ = ["CROSSOVER_KEYS", "attention", "auto_reason", "unsupported_reason"]

CROSSOVER_KEYS = 1024
"""Below this many keys (S) the bucketed backend is faster on CPU for forward + backward
(benchmarks/attention.md, K = 16 and 64: bucketed takes 0.72-0.74x the fused time at S=512,
fused is 2.3x faster at S=1024)."""

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _empty_grad(like: Tensor) -> Tensor:
    return like.new_empty(0)


@torch.library.custom_op("relpos::fused_attention", mutates_args=())
def _fused_attention_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    key_mask: Tensor | None,
    max_distance: int,
    is_causal: bool,
    scale: float,
    query_start: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``out``, logsumexp, far-left output, far masses."""
    B, H, L, _ = query.shape
    S, Dv = key.shape[2], value.shape[-1]
    acc = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    if L == 0 or S == 0 or B * H == 0:
        out = query.new_zeros(B, H, L, Dv)
        lse = torch.full((B, H, L), math.inf, dtype=acc, device=query.device)
        masses = torch.zeros(B, H, L, 2, dtype=acc, device=query.device)
        return out, lse, query.new_zeros(B, H, L, Dv), masses
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    return fused_forward(
        q, k, v, rel_keys, rel_values, key_mask, max_distance, is_causal, scale, query_start
    )


@_fused_attention_op.register_fake
def _(
    query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_mask: Tensor | None, max_distance: int, is_causal: bool,
    scale: float, query_start: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    B, H, L, _ = query.shape
    Dv = value.shape[-1]
    acc = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    out = query.new_empty(B, H, L, Dv)
    lse = query.new_empty(B, H, L, dtype=acc)
    return out, lse, query.new_empty(B, H, L, Dv), query.new_empty(B, H, L, 2, dtype=acc)


@torch.library.custom_op("relpos::fused_attention_backward", mutates_args=())
def _fused_attention_backward_op(
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
    max_distance: int,
    is_causal: bool,
    scale: float,
    query_start: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients for q, k, v, rel_keys, rel_values (empty tensors for absent tables)."""
    B, H, L, _ = query.shape
    S = key.shape[2]
    if L == 0 or S == 0 or B * H == 0:
        dq, dk, dv = query.new_zeros(query.shape), key.new_zeros(key.shape), value.new_zeros(
            value.shape)
        drk = None if rel_keys is None else rel_keys.new_zeros(rel_keys.shape)
        drv = None if rel_values is None else rel_values.new_zeros(rel_values.shape)
    else:
        dq, dk, dv, drk, drv = fused_backward(
            grad_out, query.contiguous(), key.contiguous(), value.contiguous(), rel_keys,
            rel_values, key_mask, out, lse, o_left, masses, max_distance, is_causal,
            scale, query_start,
        )
    return (
        dq, dk, dv,
        _empty_grad(query) if drk is None else drk,
        _empty_grad(query) if drv is None else drv,
    )


@_fused_attention_backward_op.register_fake
def _(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_mask: Tensor | None, out: Tensor, lse: Tensor,
    o_left: Tensor, masses: Tensor, max_distance: int, is_causal: bool,
    scale: float, query_start: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # The real op returns fresh contiguous gradients whatever the inputs' strides.
    return (
        query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape),
        query.new_empty(0) if rel_keys is None else rel_keys.new_empty(rel_keys.shape),
        query.new_empty(0) if rel_values is None else rel_values.new_empty(rel_values.shape),
    )


def _setup_context(ctx: object, inputs: tuple[object, ...], output: tuple[Tensor, ...]) -> None:
    q, k, v, rk, rv, km, K, causal, scale, start = inputs
    out, lse, o_left, masses = output
    ctx.save_for_backward(q, k, v, rk, rv, km, out, lse, o_left, masses)  # type: ignore[attr-defined]
    ctx.set_materialize_grads(False)  # type: ignore[attr-defined]  # only ``out`` is public
    ctx.params = (K, causal, scale, start)  # type: ignore[attr-defined]


def _backward(ctx: object, grad_out: Tensor | None, *_unused: object) -> tuple[object, ...]:
    q, k, v, rk, rv, km, out, lse, o_left, masses = ctx.saved_tensors  # type: ignore[attr-defined]
    K, causal, scale, start = ctx.params  # type: ignore[attr-defined]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, drk, drv = _fused_attention_backward_op(
        grad_out, q, k, v, rk, rv, km, out, lse, o_left, masses, K, causal, scale,
        start,
    )
    return (
        dq, dk, dv,
        None if rk is None else drk,
        None if rv is None else drv,
        None, None, None, None, None,
    )


torch.library.register_autograd(
    "relpos::fused_attention", _backward, setup_context=_setup_context
)


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    max_distance: int,
    attn_mask: Tensor | None,
    key_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    scale: float,
    query_start: int,
) -> Tensor:
    """Fused backend: see :func:`relpos.relative_attention` for the arguments.

    Returns:
        ``(B, H, L, Dv)``; rows that see no key are zeros.
    """
    reason = unsupported_reason(
        query, key, value, rel_keys=rel_keys, rel_values=rel_values, max_distance=max_distance,
        attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal, dropout_p=dropout_p,
        scale=scale, query_start=query_start,
    )
    if reason is not None:
        raise RuntimeError(f"the fused backend cannot serve this call: {reason}")
    out = torch.ops.relpos.fused_attention(
        query, key, value, rel_keys, rel_values, key_mask, int(max_distance), bool(is_causal),
        float(scale), int(query_start),
    )[0]
    return out


def unsupported_reason(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    max_distance: int,
    attn_mask: Tensor | None,
    key_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    scale: float,
    query_start: int,
) -> str | None:
    """Why the fused backend cannot serve the call (hard limitations only), or None."""
    if dropout_p > 0.0:
        return (f"dropout_p={dropout_p} > 0: the fused backend has no attention dropout "
                "(the bucketed backend has)")
    if attn_mask is not None:
        return (f"a dense attn_mask of shape {tuple(attn_mask.shape)} is not supported by the "
                "fused backend; use key_mask (B, S) for padding and is_causal")
    if value.shape[-1] != query.shape[-1]:
        return (f"value head dim Dv={value.shape[-1]} differs from D={query.shape[-1]}; the "
                "flash kernels need Dv == D")
    device = query.device.type
    if device == "cpu":
        if query.dtype not in _CPU_DTYPES:
            return f"dtype {query.dtype} is not supported on CPU (allowed: {_CPU_DTYPES})"
    elif device == "cuda":
        if query.dtype not in _CUDA_DTYPES:
            return f"dtype {query.dtype} is not supported on CUDA (allowed: {_CUDA_DTYPES})"
        if key_mask is not None:
            return "key_mask is not supported by the fused backend on CUDA"
    else:
        return f"device {query.device} is not supported (allowed: cpu, cuda)"
    return None


def auto_reason(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    max_distance: int,
    attn_mask: Tensor | None,
    key_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    scale: float,
    query_start: int,
) -> str | None:
    """Why ``implementation=None`` does not pick the fused backend: a hard limitation
    (:func:`unsupported_reason`) or, for short sequences, speed. None = fused is picked."""
    reason = unsupported_reason(
        query, key, value, rel_keys=rel_keys, rel_values=rel_values, max_distance=max_distance,
        attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal, dropout_p=dropout_p,
        scale=scale, query_start=query_start,
    )
    if reason is not None:
        return reason
    if query.device.type == "cuda":
        return ("the CUDA path of the fused backend is only picked when asked for "
                "(implementation='fused'); check it with benchmarks/cuda_check.py")
    S = key.shape[-2]
    if S < CROSSOVER_KEYS:
        return (f"sequence length S={S} below the fused crossover (S >= {CROSSOVER_KEYS} on "
                "CPU); bucketed is faster")
    return None
