"""Decode backend: few queries over many keys (KV-cache steps), with O(t·K) relative work.

For ``t`` queries at the end of ``S`` keys (``query_start = S - t``, the bottom-right
alignment of a KV-cache step) every key before the last ``W = min(S, K + t - 1)`` is at
offset ``<= -K`` from every query, so it sees the one relative row ``-K`` (DESIGN.md §3/§4).
With ``q' = scale * q``::

    scores = q' @ k.T                                  # (t, S): the content work, O(t·S·D)
    scores[:, :S-W] += q' . aK[-K]                     # far keys: one constant per row
    scores[:, S-W:] += (q' @ aK.T)[index (t, W)]       # band: only the last W keys
    P      = softmax(scores)
    out    = P @ v + (sum of P over far keys) * aV[-K] + buckets(P[:, S-W:]) @ aV

so the relative work is O(t·(K + t)·D) and nothing of size S x K x D or S x S is built.
Serves every mask, dropout, ``Dv != D``, shared and per-head tables; autograd runs through
plain tensor ops. Used for ``L <= MAX_QUERIES`` queries aligned to the end of the keys.
Equivalent to :mod:`relpos.ops.reference`.

Inference fast path (CPU, no autograd, no dense ``attn_mask``, no dropout, ``D == Dv``): the
far keys, which every query sees in full, go through the flash kernel
``aten::_scaled_dot_product_flash_attention_for_cpu`` (which returns its logsumexp), the
band of the last ``W`` keys is computed explicitly, and the two are merged by logsumexp
(DESIGN.md §3). That keeps a single-token step within a few percent of plain SDPA over the
same cache instead of materializing ``(t, S)`` scores several times.

Shape legend: B batch, H heads, t = L queries, S keys, D head dim, Dv value head dim,
K clip distance, R = 2K + 1 table rows, W band width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos.ops.reference import masked_softmax

__all__ = ["MAX_QUERIES", "attention", "auto_reason", "unsupported_reason"]

MAX_QUERIES = 64
"""Largest number of queries (t) served: beyond it the fused/bucketed backends are preferred."""


def _band_index(t: int, S: int, W: int, K: int, device: torch.device) -> Tensor:
    """``(t, W)`` table rows of the last ``W`` keys seen from queries at ``S - t .. S - 1``."""
    pos_q = torch.arange(S - t, S, device=device)  # (t,)
    pos_k = torch.arange(S - W, S, device=device)  # (W,)
    return (pos_k[None, :] - pos_q[:, None]).clamp(-K, K) + K  # (t, W)


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
    """Decode backend: see :func:`relpos.relative_attention` for the arguments."""
    B, H, t, _ = query.shape
    S = key.shape[-2]
    K = max_distance
    positional = rel_keys is not None or rel_values is not None or is_causal
    assert not positional or query_start == S - t, "bottom-right aligned queries only"
    W = max(0, min(S, K + t - 1))  # keys that may see a row other than -K
    F_ = S - W  # far keys: row -K for every query
    if _flash_ok(query, key, value, rel_keys, rel_values, attn_mask, dropout_p, F_):
        return _attention_flash(
            query, key, value, rel_keys=rel_keys, rel_values=rel_values, K=K,
            key_mask=key_mask, is_causal=is_causal, scale=scale, W=W,
        )
    q_scaled = query * scale  # (B, H, t, D)
    scores = q_scaled @ key.transpose(-2, -1)  # (B, H, t, S)
    index: Tensor | None = None
    if W > 0 and (rel_keys is not None or rel_values is not None):
        index = _band_index(t, S, W, K, query.device).expand(B, H, t, W)  # (B, H, t, W)
    if rel_keys is not None:
        qa = q_scaled @ rel_keys.transpose(-2, -1)  # (B, H, t, R)
        bias = scores.new_empty(B, H, t, S)
        if F_ > 0:
            bias[..., :F_] = qa[..., :1]  # broadcast the far constant over the far keys
        if index is not None:
            bias[..., F_:] = qa.gather(-1, index)  # (B, H, t, W)
        scores = scores + bias
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask
    keep: Tensor | None = None
    if is_causal and t > 1:  # only the last t - 1 keys can be after a query
        keep = torch.ones(t, S, dtype=torch.bool, device=query.device).tril(S - t)  # (t, S)
    if key_mask is not None:
        km = key_mask[:, None, None, :]  # (B, 1, 1, S)
        keep = km if keep is None else keep & km
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask if keep is None else keep & attn_mask
    if keep is None and attn_mask is None:  # every row sees a key: no guard needed
        probs = torch.softmax(scores, dim=-1)  # (B, H, t, S)
    else:  # a float mask of -inf may also hide a whole row
        probs = masked_softmax(scores, keep)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    out = probs @ value  # (B, H, t, Dv)
    if rel_values is not None:
        R = rel_values.shape[-2]
        parts = []
        if F_ > 0:
            parts.append(probs[..., :F_].sum(dim=-1, keepdim=True))  # (B, H, t, 1) far mass
            parts.append(probs.new_zeros(B, H, t, R - 1))
            buckets = torch.cat(parts, dim=-1)  # (B, H, t, R)
        else:
            buckets = probs.new_zeros(B, H, t, R)
        if index is not None:
            buckets = buckets.scatter_add(-1, index, probs[..., F_:])  # (B, H, t, R)
        out = out + buckets @ rel_values  # (B, H, t, R) @ (Hr, R, Dv)
    return out


_FLASH_DTYPES = (torch.float32, torch.float64)


def _flash_ok(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    attn_mask: Tensor | None,
    dropout_p: float,
    far: int,
) -> bool:
    """Whether the inference fast path (flash kernel over the far keys) serves the call."""
    if far == 0 or attn_mask is not None or dropout_p > 0.0:
        return False
    if query.device.type != "cpu" or query.dtype not in _FLASH_DTYPES:
        return False
    if value.shape[-1] != query.shape[-1]:
        return False
    leaves = (query, key, value, rel_keys, rel_values)
    return not (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in leaves))


def _attention_flash(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    K: int,
    key_mask: Tensor | None,
    is_causal: bool,
    scale: float,
    W: int,
) -> Tensor:
    """Far keys through the flash kernel, band explicit, merged by logsumexp (no autograd)."""
    B, H, t, _ = query.shape
    S = key.shape[-2]
    F_ = S - W
    neg_inf = float("-inf")
    bias = None
    far_dead: Tensor | None = None
    if key_mask is not None:
        far_mask = key_mask[:, :F_]  # (B, F)
        bias = torch.zeros(B, 1, 1, F_, dtype=query.dtype, device=query.device)
        bias.masked_fill_(~far_mask[:, None, None, :], neg_inf)  # (B, 1, 1, F) additive
        far_dead = ~far_mask.any(dim=-1)[:, None, None]  # (B, 1, 1): no visible far key
    o_far, lse_far = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key[:, :, :F_], value[:, :, :F_], 0.0, False, attn_mask=bias, scale=scale
    )  # (B, H, t, D), (B, H, t)
    log_far = lse_far
    q_scaled = query * scale  # (B, H, t, D)
    qa: Tensor | None = None
    if rel_keys is not None:
        qa = q_scaled @ rel_keys.transpose(-2, -1)  # (B, H, t, R)
        log_far = lse_far + qa[..., 0]  # the far keys' shared key term
    if far_dead is not None:
        log_far = log_far.masked_fill(far_dead, neg_inf)
    # One query with a full band (the common single-token step): its band keys are at
    # offsets -(K-1)..0, i.e. table rows 1..K, so a slice replaces the gather/scatter.
    single = t == 1 and W == K
    if W > 0:
        k_band, v_band = key[:, :, F_:], value[:, :, F_:]  # (B, H, W, D)
        index = _band_index(t, S, W, K, query.device)  # (t, W)
        s_band = q_scaled @ k_band.transpose(-2, -1)  # (B, H, t, W)
        if qa is not None:
            s_band = s_band + (
                qa[..., 1 : K + 1] if single else qa.gather(-1, index.expand(B, H, t, W))
            )
        keep: Tensor | None = None
        if is_causal and t > 1:
            pos_q = torch.arange(S - t, S, device=query.device)  # (t,)
            pos_k = torch.arange(F_, S, device=query.device)  # (W,)
            keep = pos_k[None, :] <= pos_q[:, None]  # (t, W)
        if key_mask is not None:
            km = key_mask[:, None, None, F_:]  # (B, 1, 1, W)
            keep = km if keep is None else keep & km
        if keep is not None:
            s_band = s_band.masked_fill(~keep, neg_inf)
        lse = torch.logaddexp(log_far, torch.logsumexp(s_band, dim=-1))  # (B, H, t)
    else:
        lse = log_far
    if key_mask is not None:  # rows that see no key: every mass below is 0
        lse = lse.masked_fill(lse == neg_inf, 0.0)
    m_far = torch.exp(log_far - lse).unsqueeze(-1)  # (B, H, t, 1)
    out = m_far * o_far  # (B, H, t, D)
    if W > 0:
        p_band = torch.exp(s_band - lse.unsqueeze(-1))  # (B, H, t, W)
        out = out + p_band @ v_band
    if rel_values is not None:
        R = rel_values.shape[-2]
        if single and W > 0:  # rows 0 | 1..K | K+1..2K
            buckets = torch.cat((m_far, p_band, m_far.new_zeros(B, H, t, K)), dim=-1)
        else:
            buckets = torch.cat((m_far, m_far.new_zeros(B, H, t, R - 1)), dim=-1)  # (B, H, t, R)
            if W > 0:
                buckets = buckets.scatter_add(-1, index.expand(B, H, t, W), p_band)
        out = out + buckets @ rel_values  # (B, H, t, R) @ (Hr, R, Dv)
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
    """Why the decode backend cannot serve the call, or None."""
    L, S = query.shape[-2], key.shape[-2]
    if L > MAX_QUERIES:
        return f"L={L} queries: the decode backend serves L <= {MAX_QUERIES} (KV-cache steps)"
    if L == 0 or S == 0:
        return f"empty attention (L={L}, S={S})"
    positional = rel_keys is not None or rel_values is not None or is_causal
    if positional and query_start != S - L:
        return (f"query_start={query_start}: the decode backend serves queries aligned to the "
                f"end of the keys only (query_start = S - L = {S - L})")
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
    """Why ``implementation=None`` does not pick the decode backend: a hard limit, or a call
    that is not a cache step (``L == S``: whole-sequence attention, served by fused/bucketed).
    None = decode is picked."""
    reason = unsupported_reason(
        query, key, value, rel_keys=rel_keys, rel_values=rel_values, max_distance=max_distance,
        attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal, dropout_p=dropout_p,
        scale=scale, query_start=query_start,
    )
    if reason is not None:
        return reason
    L, S = query.shape[-2], key.shape[-2]
    if L >= S:
        return f"L = S = {S}: not a cache step (fewer queries than keys)"
    return None
