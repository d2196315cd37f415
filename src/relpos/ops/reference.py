"""The definition of clipped relative attention, kept small and obvious.

Materializes ``aK[r(i, j)]`` and ``aV[r(i, j)]`` as ``(Hr, L, S, D)`` tensors: O(L·S·D) memory.
Every other backend is tested against this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos.positions import relative_position_index


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
    """Bool ``(B|1, H|1, L, S)`` mask of the pairs that may attend (None = all), bool masks only."""
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


def masked_softmax(scores_BHLS: Tensor, keep: Tensor | None) -> Tensor:
    """Softmax over the last dim; rows with nothing visible give all-zero probabilities.

    Half-precision scores get their softmax statistics (row max and sum) in float32; the
    probabilities come back in the scores' dtype.
    """
    if scores_BHLS.shape[-1] == 0:  # no keys at all: every row sees nothing
        return scores_BHLS.new_zeros(scores_BHLS.shape)
    if keep is not None:
        scores_BHLS = scores_BHLS.masked_fill(~keep, float("-inf"))
    row_max = scores_BHLS.amax(dim=-1, keepdim=True)  # (B, H, L, 1)
    dead = row_max == float("-inf")
    scores_BHLS = scores_BHLS.masked_fill(dead, 0.0)
    low = scores_BHLS.dtype in (torch.float16, torch.bfloat16)
    probs = torch.softmax(scores_BHLS, dim=-1, dtype=torch.float32 if low else None)
    return probs.masked_fill(dead, 0.0).to(scores_BHLS.dtype)


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
    """Reference backend: see :func:`relpos.relative_attention` for the arguments."""
    L, S = query.shape[-2], key.shape[-2]
    index_LS = relative_position_index(
        L, S, max_distance, query_start=query_start, device=query.device
    )
    scores = torch.einsum("bhld,bhsd->bhls", query, key)  # (B, H, L, S)
    if rel_keys is not None:
        ak = rel_keys[:, index_LS]  # (Hr, L, S, D)
        scores = scores + torch.einsum("bhld,hlsd->bhls", query, ak)
    scores = scores * scale
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask
    keep = visibility_mask(
        L, S, attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal,
        query_start=query_start, device=query.device,
    )
    probs = masked_softmax(scores, keep)  # (B, H, L, S)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.einsum("bhls,bhsd->bhld", probs, value)
    if rel_values is not None:
        av = rel_values[:, index_LS]  # (Hr, L, S, Dv)
        out = out + torch.einsum("bhls,hlsd->bhld", probs, av)
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
    """The reference backend serves every call."""
    return None
