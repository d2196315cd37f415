"""The flash_regions backend as the custom op ``relpos::fused_attention`` (the name it had before
the backend was renamed, kept so that exported programs still load), with its autograd formula.

The op has a fake implementation (for ``torch.compile`` and ``torch.export``) and a backward
through the op ``relpos::fused_attention_backward``; both are checked with
``torch.library.opcheck``. The op reads its inputs in any layout (it makes them contiguous).

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from relpos.ops._custom_op import Gradients, define_key_mask_op, register_attention_autograd
from relpos.ops._numerics import accumulation_dtype
from relpos.ops.flash_regions.decomposition import fused_backward, fused_forward

__all__ = ["fused_attention"]


def _fake(query: Tensor, key: Tensor, value: Tensor, *_tables: object, **_options: object) -> tuple[
    Tensor, Tensor, Tensor, Tensor
]:
    B, H, L, _ = query.shape
    Dv = value.shape[-1]
    acc = accumulation_dtype(query.dtype)
    out = query.new_empty(B, H, L, Dv)
    lse = query.new_empty(B, H, L, dtype=acc)
    return out, lse, query.new_empty(B, H, L, Dv), query.new_empty(B, H, L, 2, dtype=acc)


fused_attention = define_key_mask_op(
    "relpos::fused_attention", fused_forward, _fake, outputs=4,
    doc="""``(query, key, value, rel_keys, rel_values, key_mask, *, left, right, is_causal,
    scale, query_start)`` -> ``out (B, H, L, Dv)``, logsumexp ``(B, H, L)``, the far-left
    output and the far masses ``(B, H, L, 2)`` (the last three for the backward).""",
)


def _backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_mask: Tensor | None, out: Tensor, lse: Tensor,
    o_left: Tensor, masses: Tensor, **options: Any,
) -> Gradients:
    """What ``relpos::fused_attention_backward`` computes for a non-empty call."""
    return fused_backward(
        grad_out, query.contiguous(), key.contiguous(), value.contiguous(), rel_keys,
        rel_values, key_mask, out, lse, o_left, masses, **options,
    )


fused_attention_backward = register_attention_autograd(
    "relpos::fused_attention", _backward, saved_outputs=("out", "lse", "o_left", "masses")
)
