"""The definition of clipped relative attention, kept small and obvious.

Materializes ``aK[r(i, j)]`` and ``aV[r(i, j)]`` as ``(Hr, L, S, D)`` tensors: O(L·S·D) memory.
Every other backend is tested against this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos.ops.call import AttentionCall, Reason
from relpos.ops.masking import call_softmax, masked_softmax, visibility_mask
from relpos.positions import relative_position_index

__all__ = ["attention", "masked_softmax", "unsupported_reason", "visibility_mask"]


def attention(call: AttentionCall) -> Tensor:
    """Reference backend: see :func:`relpos.relative_attention` for the meaning of the call."""
    query, key, value = call.query, call.key, call.value
    L, S = call.query_len, call.key_len
    if call.has_relative_terms:
        index_LS = relative_position_index(
            L, S, (call.left, call.right), query_start=call.query_start, device=query.device
        )
    scores = torch.einsum("bhld,bhsd->bhls", query, key)  # (B, H, L, S)
    if call.rel_keys is not None:
        ak = call.rel_keys[:, index_LS]  # (Hr, L, S, D)
        scores = scores + torch.einsum("bhld,hlsd->bhls", query, ak)
    scores = scores * call.scale
    if call.attn_mask is not None and call.attn_mask.dtype != torch.bool:
        scores = scores + call.attn_mask
    probs = call_softmax(scores, call)  # (B, H, L, S)
    if call.dropout_p > 0.0:
        probs = F.dropout(probs, p=call.dropout_p)
    out = torch.einsum("bhls,bhsd->bhld", probs, value)
    if call.rel_values is not None:
        av = call.rel_values[:, index_LS]  # (Hr, L, S, Dv)
        out = out + torch.einsum("bhls,hlsd->bhld", probs, av)
    return out


def unsupported_reason(call: AttentionCall) -> Reason | str | None:
    """The reference backend serves every call."""
    return None
