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

import torch
from torch import Tensor

from relpos.ops._custom_op import Gradients, empty_outputs, is_empty, register_attention_autograd
from relpos.ops._numerics import accumulation_dtype

__all__ = ["triton_attention"]


def _fake(query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
          rel_values: Tensor | None, key_mask: Tensor | None, *, left: int, right: int,
          **_options: object) -> tuple[Tensor, Tensor, Tensor]:
    B, H, L, _ = query.shape
    acc = accumulation_dtype(query.dtype)
    pb_shape = (0,) if rel_values is None else (B, H, L, left + right + 1)
    return (query.new_empty(B, H, L, value.shape[-1]), query.new_empty(B, H, L, dtype=acc),
            query.new_empty(pb_shape, dtype=acc))


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
    if is_empty(query, key):
        return empty_outputs(_fake(query, key, value, rel_keys, rel_values, key_mask, left=left,
                                   right=right))
    from relpos.ops.triton import launch

    return launch.forward(
        query.contiguous(), key.contiguous(), value.contiguous(), rel_keys, rel_values, key_mask,
        left=left, right=right, is_causal=is_causal, scale=scale, query_start=query_start,
    )


triton_attention.register_fake(_fake)


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
