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

from relpos.ops._numerics import accumulation_dtype
from relpos.ops.call import AttentionCall, Reason, needs_backward
from relpos.ops.masking import call_softmax
from relpos.positions import relative_position_index

__all__ = [
    "REFERENCE_MAX_KEYS",
    "attention",
    "attention_and_weights",
    "auto_reason",
    "reference_is_faster",
    "unsupported_reason",
]

REFERENCE_MAX_KEYS: dict[bool, int] = {False: 128, True: 64}
"""Needs a backward pass -> the most keys S at which auto-selection prefers the reference
backend (float32/float64, eager; with a backward, only when the window spans every offset
of the call). At these
sizes the reference's ``(L, S, D)`` gathered tables are small and shared by every batch row
and head, and its relative terms are batched matmuls, while this backend gathers and
scatters over all ``B·H·L·S`` scores: the training-shapes table
(benchmarks/training_shapes_xeon.md) has the reference 1.0-1.5x faster in the forward at
n = 64 and 128, and 1.2x faster forward + backward at n = 64 with K = 64."""

_REFERENCE_MAX_TABLE_BYTES = 32 << 20


def attention_and_weights(call: AttentionCall) -> tuple[Tensor, Tensor]:
    """Bucketed attention that also returns the probabilities ``(B, H, L, S)`` (before dropout)."""
    query, key, value = call.query, call.key, call.value
    B, H, L, S, _, _ = call.dims
    R = call.table_rows
    q_scaled = query * call.scale
    scores = q_scaled @ key.transpose(-2, -1)  # (B, H, L, S)
    index_BHLS: Tensor | None = None
    if call.has_relative_terms:
        index_LS = relative_position_index(
            L, S, (call.left, call.right), query_start=call.query_start, device=query.device
        )
        index_BHLS = index_LS.expand(B, H, L, S)
    if call.rel_keys is not None:
        assert index_BHLS is not None
        qa = q_scaled @ call.rel_keys.transpose(-2, -1)  # (B, H, L, R)
        scores = scores.add_(qa.gather(-1, index_BHLS))  # in place: matmul keeps no output
    if call.attn_mask is not None and call.attn_mask.dtype != torch.bool:
        scores = scores + call.attn_mask
    weights = call_softmax(scores, call)  # (B, H, L, S)
    probs = F.dropout(weights, p=call.dropout_p) if call.dropout_p > 0.0 else weights
    out = probs @ value  # (B, H, L, Dv)
    if call.rel_values is not None:
        assert index_BHLS is not None
        # A bucket sums up to S probabilities: accumulate half precision in float32.
        acc = accumulation_dtype(probs.dtype)
        buckets = probs.new_zeros(B, H, L, R, dtype=acc).scatter_add_(
            -1, index_BHLS, probs.to(acc)
        ).to(probs.dtype)  # (B, H, L, R)
        out = out.add_(buckets @ call.rel_values)  # (B, H, L, R) @ (Hr, R, Dv)
    return out, weights


def attention(call: AttentionCall) -> Tensor:
    """Bucketed backend: see :func:`relpos.relative_attention` for the meaning of the call."""
    return attention_and_weights(call)[0]


def unsupported_reason(call: AttentionCall) -> Reason | str | None:
    """The bucketed backend serves every call."""
    return None


def reference_is_faster(call: AttentionCall) -> bool:
    """Whether auto-selection runs the reference backend instead (:data:`REFERENCE_MAX_KEYS`;
    its gathered tables must also stay under 32 MiB)."""
    if not call.has_relative_terms or call.query.dtype not in (torch.float32, torch.float64):
        return False
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False  # one traced graph serves many lengths: no choice by length here
    grad = needs_backward(call)
    S, L = call.key_len, call.query_len
    if REFERENCE_MAX_KEYS[grad] < S or (grad and call.table_rows < S):
        return False
    tables = [t for t in (call.rel_keys, call.rel_values) if t is not None]
    size = sum(t.shape[0] * L * S * t.shape[-1] * t.element_size() for t in tables)
    return size <= _REFERENCE_MAX_TABLE_BYTES


def auto_reason(call: AttentionCall) -> Reason | str | None:
    """Why ``implementation=None`` passes the bucketed backend by: at the shortest sequences
    the reference backend is faster (:func:`reference_is_faster`). None = bucketed is picked."""
    if reference_is_faster(call):
        return Reason.of("S={S} keys: the reference backend is faster at S <= {most} "
                         "(batched matmuls over small (L, S, D) tables)", S=call.key_len,
                         most=REFERENCE_MAX_KEYS[needs_backward(call)])
    return None
