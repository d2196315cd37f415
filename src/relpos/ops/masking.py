"""Masks and the guarded softmax shared by the backends that materialize ``(L, S)`` scores.

Shape legend: B batch, H heads, L queries, S keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relpos.ops._numerics import accumulation_dtype
from relpos.ops.call import AttentionCall

__all__ = [
    "call_softmax", "call_visibility", "masked_softmax", "rows_may_be_empty", "visibility_mask",
]


def visibility_mask(
    query_len: int,
    key_len: int,
    *,
    attn_mask: Tensor | None,
    key_mask: Tensor | None,
    is_causal: bool,
    query_start: int,
    device: torch.device,
) -> Tensor | None:
    """Bool ``(B|1, H|1, L, S)`` mask of the pairs that may attend (None = all), bool masks only.

    With ``is_causal`` query ``i`` (at position ``query_start + i``) sees keys ``j <= p_i``.
    """
    keep: Tensor | None = None
    if is_causal:
        pos_q = torch.arange(query_start, query_start + query_len, device=device)  # (L,)
        pos_k = torch.arange(key_len, device=device)  # (S,)
        keep = (pos_k[None, :] <= pos_q[:, None])[None, None]  # (1, 1, L, S)
    if key_mask is not None:
        km = key_mask[:, None, None, :]  # (B, 1, 1, S)
        keep = km if keep is None else keep & km
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask if keep is None else keep & attn_mask
    return keep


def call_visibility(call: AttentionCall) -> Tensor | None:
    """:func:`visibility_mask` of a whole call: ``(B|1, H|1, L, S)`` bool or None."""
    return visibility_mask(
        call.query_len, call.key_len, attn_mask=call.attn_mask, key_mask=call.key_mask,
        is_causal=call.is_causal, query_start=call.query_start, device=call.query.device,
    )


def rows_may_be_empty(call: AttentionCall) -> bool:
    """Whether some query row of the call may see no key: only a ``key_mask`` or an
    ``attn_mask`` can hide every key of a row (a causal query at position ``p_i >= 0`` always
    sees key 0)."""
    return call.key_mask is not None or call.attn_mask is not None


def masked_softmax(
    scores_BHLS: Tensor, keep: Tensor | None, *, rows_may_be_empty: bool = True,
    overwrite: bool = False,
) -> Tensor:
    """Softmax over the last dim; rows with nothing visible give all-zero probabilities.

    Half-precision scores get their softmax statistics (row max and sum) in float32; the
    probabilities come back in the scores' dtype. With ``rows_may_be_empty=False`` (the
    caller knows every row sees a key, :func:`rows_may_be_empty`) the guard for empty rows,
    a row maximum and two masked fills over ``(B, H, L, S)``, is skipped. With
    ``overwrite=True`` (the scores are the caller's own temporary, which no backward reads)
    the masked fills of the scores run in place: no copy of them.
    """
    if scores_BHLS.shape[-1] == 0:  # no keys at all: every row sees nothing
        return scores_BHLS.new_zeros(scores_BHLS.shape)
    fill = Tensor.masked_fill_ if overwrite else Tensor.masked_fill
    if keep is not None:
        scores_BHLS = fill(scores_BHLS, ~keep, float("-inf"))
    acc = accumulation_dtype(scores_BHLS.dtype)
    if not rows_may_be_empty:
        probs = torch.softmax(scores_BHLS, dim=-1, dtype=None if acc == scores_BHLS.dtype else acc)
        return probs.to(scores_BHLS.dtype)
    dead = scores_BHLS.detach().amax(dim=-1, keepdim=True) == float("-inf")  # (B, H, L, 1)
    scores_BHLS = fill(scores_BHLS, dead, 0.0)
    probs = torch.softmax(scores_BHLS, dim=-1, dtype=None if acc == scores_BHLS.dtype else acc)
    return probs.masked_fill(dead, 0.0).to(scores_BHLS.dtype)  # softmax's backward reads probs


def call_softmax(scores_BHLS: Tensor, call: AttentionCall) -> Tensor:
    """:func:`masked_softmax` of a call's own score temporary: the call's masks, the empty-row
    guard only where a mask can empty a row (:func:`rows_may_be_empty`), fills in place.

    Hidden pairs are filled with -inf rather than given a -inf bias, so a NaN in a hidden key
    does not reach the rows that cannot see it.
    """
    return masked_softmax(scores_BHLS, call_visibility(call),
                          rows_may_be_empty=rows_may_be_empty(call), overwrite=True)
