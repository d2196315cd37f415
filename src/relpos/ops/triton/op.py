"""The Triton backend as the custom op ``relpos::triton_attention``, with its autograd formula.

The op has a fake implementation (for ``torch.compile`` and ``torch.export``) and a backward
through the op ``relpos::triton_attention_backward``; both are checked with
``torch.library.opcheck`` under the interpreter. The op reads its inputs in any layout (it
makes them contiguous once). Importing this module does not import Triton: the kernels load
on the first call.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim, R table rows.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from relpos.ops._custom_op import (
    Gradients,
    define_key_mask_op,
    define_op,
    empty_outputs,
    register_attention_autograd,
)
from relpos.ops._numerics import accumulation_dtype
from relpos.ops.native.op import is_empty_varlen

__all__ = ["triton_attention", "triton_attention_varlen"]


def _fake(query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
          rel_values: Tensor | None, key_mask: Tensor | None, *, left: int, right: int,
          **_options: object) -> tuple[Tensor, Tensor, Tensor]:
    B, H, L, _ = query.shape
    acc = accumulation_dtype(query.dtype)
    pb_shape = (0,) if rel_values is None else (B, H, L, left + right + 1)
    return (query.new_empty(B, H, L, value.shape[-1]), query.new_empty(B, H, L, dtype=acc),
            query.new_empty(pb_shape, dtype=acc))


def _forward(*inputs: Tensor | None, **options: Any) -> tuple[Tensor, Tensor, Tensor]:
    from relpos.ops.triton import launch  # Triton loads on the first call

    return launch.forward(*inputs, **options)  # type: ignore[arg-type]


triton_attention = define_key_mask_op(
    "relpos::triton_attention", _forward, _fake, outputs=3,
    doc="""``(query, key, value, rel_keys, rel_values, key_mask, *, left, right, is_causal,
    scale, query_start)`` -> ``out (B, H, L, Dv)``, logsumexp ``(B, H, L)`` and the bucket
    masses ``Pb (B, H, L, R)`` (empty without a values table; the last two for the
    backward).""",
)


def _backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_mask: Tensor | None, out: Tensor, lse: Tensor, pb: Tensor,
    **options: Any,
) -> Gradients:
    """What ``relpos::triton_attention_backward`` computes for a non-empty call."""
    from relpos.ops.triton import launch

    return launch.backward(
        grad_out, query.contiguous(), key.contiguous(), value.contiguous(), rel_keys,
        rel_values, key_mask, out, lse, pb, **options,
    )


triton_attention_backward = register_attention_autograd(
    "relpos::triton_attention", _backward, saved_outputs=("out", "lse", "pb")
)


# ------------------------------------------------------------------------------------------
# Packed variable-length batches


def _fake_varlen(query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
                 rel_values: Tensor | None, *_inputs: object, left: int, right: int,
                 **_options: object) -> tuple[Tensor, Tensor, Tensor]:
    Tq, H, _ = query.shape
    acc = accumulation_dtype(query.dtype)
    pb_shape = (0,) if rel_values is None else (1, H, Tq, left + right + 1)
    return (query.new_empty(Tq, H, value.shape[-1]), query.new_empty(H, Tq, dtype=acc),
            query.new_empty(pb_shape, dtype=acc))


@define_op("relpos::triton_attention_varlen")
def triton_attention_varlen(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    seqused_k: Tensor | None,
    *,
    left: int,
    right: int,
    is_causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention over a packed batch of N sequences, laid out as flash-attention's
    ``flash_attn_varlen_func``, in one launch per kernel. Returns ``out (Tq, H, Dv)``, the
    logsumexp ``(H, Tq)`` in the accumulation dtype (``+inf`` for rows that see no key) and the
    bucket masses ``Pb (1, H, Tq, R)`` (empty without a values table; the last two for the
    backward).

    ``query (Tq, H, D)``, ``key (Tk, H, D)``, ``value (Tk, H, Dv)`` in any strides;
    ``cu_seqlens_q``, ``cu_seqlens_k`` ``(N + 1,)`` int64 CPU tensors (read once per call:
    from 0, non-decreasing, ending at ``Tq`` and ``Tk``); ``seqused_k`` ``(N,)`` int64 CPU or
    None: sequence ``s`` uses the first ``S_s = seqused_k[s]`` rows of its key region (the
    rest is never read and gets a zero gradient). Each sequence is attended on its own, its
    query ``i`` at position ``S_s - L_s + i``, as ``relpos::triton_attention`` attends one batch
    row with ``query_start = S_s - L_s``. Tables ``(Hr, R, D)``, ``(Hr, R, Dv)``.
    """
    if is_empty_varlen(query, key):
        return empty_outputs(_fake_varlen(query, key, value, rel_keys, rel_values, left=left,
                                          right=right))
    from relpos.ops.triton import launch

    return launch.forward_varlen(
        query, key, value, rel_keys, rel_values,
        launch.Packed.of(cu_seqlens_q, cu_seqlens_k, seqused_k),
        left=left, right=right, is_causal=is_causal, scale=scale,
    )


triton_attention_varlen.register_fake(_fake_varlen)


def _backward_varlen(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    seqused_k: Tensor | None, out: Tensor, lse: Tensor, pb: Tensor, **options: Any,
) -> Gradients:
    """What ``relpos::triton_attention_varlen_backward`` computes for a non-empty call."""
    from relpos.ops.triton import launch

    return launch.backward_varlen(
        grad_out, query, key, value, rel_keys, rel_values,
        launch.Packed.of(cu_seqlens_q, cu_seqlens_k, seqused_k), out, lse, pb, **options,
    )


triton_attention_varlen_backward = register_attention_autograd(
    "relpos::triton_attention_varlen", _backward_varlen, saved_outputs=("out", "lse", "pb"),
    empty=is_empty_varlen,
)
