"""Bucketed (eager) backend: relative terms through the 2K+1 buckets, never through (L, S, D).

Keys: ``QA = q @ rel_keys.T`` is ``(B, H, L, R)``; gathering it with the ``(L, S)`` relative
index gives the score bias. Values: the probabilities of each row are summed into their R
buckets (``scatter_add`` with the same index) and multiplied by ``rel_values``. Extra memory is
O(B·H·L·R) beside the ``(B, H, L, S)`` probabilities of eager attention. Serves every mask and
dropout. Equivalent to :mod:`relpos.ops.reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos.ops.reference import masked_softmax, visibility_mask
from relpos.positions import relative_position_index


def attention_and_weights(
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
) -> tuple[Tensor, Tensor]:
    """Bucketed attention that also returns the probabilities ``(B, H, L, S)`` (before dropout)."""
    B, H, L, _ = query.shape
    S = key.shape[-2]
    R = 2 * max_distance + 1
    q_scaled = query * scale
    scores = q_scaled @ key.transpose(-2, -1)  # (B, H, L, S)
    index_BHLS: Tensor | None = None
    if rel_keys is not None or rel_values is not None:
        index_LS = relative_position_index(
            L, S, max_distance, query_start=query_start, device=query.device
        )
        index_BHLS = index_LS.expand(B, H, L, S)
    if rel_keys is not None:
        assert index_BHLS is not None
        qa = q_scaled @ rel_keys.transpose(-2, -1)  # (B, H, L, R)
        scores = scores + qa.gather(-1, index_BHLS)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask
    keep = visibility_mask(
        L, S, attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal,
        query_start=query_start, device=query.device,
    )
    weights = masked_softmax(scores, keep)  # (B, H, L, S)
    probs = F.dropout(weights, p=dropout_p) if dropout_p > 0.0 else weights
    out = probs @ value  # (B, H, L, Dv)
    if rel_values is not None:
        assert index_BHLS is not None
        # A bucket sums up to S probabilities: accumulate half precision in float32.
        acc = torch.float32 if probs.dtype in (torch.float16, torch.bfloat16) else probs.dtype
        buckets = probs.new_zeros(B, H, L, R, dtype=acc).scatter_add(
            -1, index_BHLS, probs.to(acc)
        ).to(probs.dtype)  # (B, H, L, R)
        out = out + buckets @ rel_values  # (B, H, L, R) @ (Hr, R, Dv)
    return out, weights


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
    """Bucketed backend: see :func:`relpos.relative_attention` for the arguments."""
    out, _ = attention_and_weights(
        query, key, value, rel_keys=rel_keys, rel_values=rel_values, max_distance=max_distance,
        attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal, dropout_p=dropout_p,
        scale=scale, query_start=query_start,
    )
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
    """The bucketed backend serves every call."""
    return None
