"""Decode backend: few queries over many keys (KV-cache steps), with O(t·K) relative work.

For ``t`` queries at the end of ``S`` keys (``query_start = S - t``, the bottom-right
alignment of a KV-cache step) every key before the last ``W = min(S, max(K, 1) + t - 1)`` is
at offset ``<= -K`` from every query and visible to every query, so it sees the one relative
row ``-K`` (docs/design.md §3, §4; for a window ``(left, right)`` read ``left`` for ``K`` here: only
the left bound matters for keys before the queries). With ``q' = scale * q``::

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
far keys go through the guarded flash-kernel wrapper the flash_regions backend uses too
(:func:`relpos.ops._flash.flash_forward`, which returns the logsumexp), the band of the
last ``W`` keys is computed explicitly, and the two are merged by logsumexp
(:func:`relpos.ops._lse.combine_log_masses`), as in the flash_regions backend's region
decomposition. That keeps a single-token step close to plain SDPA over the same cache.

Shape legend: B batch, H heads, t = L queries, S keys, D head dim, Dv value head dim,
K clip distance (the window's left bound), R = left + right + 1 table rows, W band width,
F = S - W far keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos.ops._flash import flash_forward, restore_nan_rows
from relpos.ops._lse import combine_log_masses
from relpos.ops._numerics import exp_
from relpos.ops.call import AttentionCall, Reason
from relpos.ops.masking import masked_softmax, visibility_mask
from relpos.positions import relative_position_index

__all__ = ["MAX_QUERIES", "attention", "auto_reason", "band_width", "unsupported_reason"]

MAX_QUERIES = 64
"""Largest number of queries (t) served: beyond it the flash_regions/bucketed backends are
preferred."""

_FLASH_DTYPES = (torch.float32, torch.float64)


def band_width(t: int, S: int, left: int) -> int:
    """W: the last keys that some of ``t`` end-aligned queries see at a row other than
    ``-left`` or may not see at all (causal); the other ``S - W`` keys are far for every
    query."""
    return min(S, max(left, 1) + t - 1)


def _buckets(far_mass: Tensor, p_band: Tensor, index_tW: Tensor, R: int) -> Tensor:
    """``(B, H, t, R)`` probability mass per table row: the far keys' mass in row 0, the band's
    probabilities summed into their rows."""
    B, H, t, W = p_band.shape
    buckets = torch.cat((far_mass, far_mass.new_zeros(B, H, t, R - 1)), dim=-1)  # (B, H, t, R)
    if W == 0:
        return buckets
    return buckets.scatter_add(-1, index_tW.expand(B, H, t, W), p_band)


def attention(call: AttentionCall) -> Tensor:
    """Decode backend: see :func:`relpos.relative_attention` for the meaning of the call."""
    query, key, value = call.query, call.key, call.value
    B, H, t, S, _, _ = call.dims
    assert not (call.has_relative_terms or call.is_causal) or call.query_start == S - t, (
        "bottom-right aligned queries only")
    W = band_width(t, S, call.left)
    if _flash_ok(call, S - W):
        if call.key_mask is None and t == 1 and call.left == W:
            return _attention_single_token(call)
        return _attention_flash(call, W)
    F_ = S - W
    q_scaled = query * call.scale  # (B, H, t, D)
    scores = q_scaled @ key.transpose(-2, -1)  # (B, H, t, S)
    if call.has_relative_terms:
        index = relative_position_index(t, W, (call.left, call.right), device=query.device)
    if call.rel_keys is not None:
        qa = q_scaled @ call.rel_keys.transpose(-2, -1)  # (B, H, t, R)
        bias = scores.new_empty(B, H, t, S)
        bias[..., :F_] = qa[..., :1]  # broadcast the far constant over the far keys
        bias[..., F_:] = qa.gather(-1, index.expand(B, H, t, W))  # (B, H, t, W)
        scores = scores + bias
    if call.attn_mask is not None and call.attn_mask.dtype != torch.bool:
        scores = scores + call.attn_mask
    keep = visibility_mask(  # only the last t - 1 keys can be after a query
        t, S, attn_mask=call.attn_mask, key_mask=call.key_mask,
        is_causal=call.is_causal and t > 1, query_start=S - t, device=query.device,
    )
    if keep is None and call.attn_mask is None:  # every row sees a key: no guard needed
        probs = torch.softmax(scores, dim=-1)  # (B, H, t, S)
    else:  # a float mask of -inf may also hide a whole row
        probs = masked_softmax(scores, keep)
    if call.dropout_p > 0.0:
        probs = F.dropout(probs, p=call.dropout_p)
    out = probs @ value  # (B, H, t, Dv)
    if call.rel_values is not None:
        far_mass = probs[..., :F_].sum(dim=-1, keepdim=True)  # (B, H, t, 1)
        buckets = _buckets(far_mass, probs[..., F_:], index, call.rel_values.shape[-2])
        out = out + buckets @ call.rel_values  # (B, H, t, R) @ (Hr, R, Dv)
    return out


def _flash_ok(call: AttentionCall, far: int) -> bool:
    """Whether the inference fast path (flash kernel over the far keys) serves the call."""
    if far == 0 or call.attn_mask is not None or call.dropout_p > 0.0:
        return False
    if call.query.numel() == 0:  # B, H or L is 0: nothing for a kernel to do
        return False
    if call.query.device.type != "cpu" or call.query.dtype not in _FLASH_DTYPES:
        return False
    if call.value.shape[-1] != call.query.shape[-1]:
        return False
    leaves = (call.query, call.key, call.value, call.rel_keys, call.rel_values)
    return not (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in leaves))


def _attention_single_token(call: AttentionCall) -> Tensor:
    """One query whose band is the last K keys (the common cache step), without a merge.

    One flash call over every key, the band's relative key terms in its ``(B, H, 1, S)`` float
    mask: the far keys' shared term ``q . rel_keys[0]`` cancels in the softmax once the band's
    are taken relative to it, so the mask is 0 on the far keys and
    ``q . (rel_keys[r] - rel_keys[0])`` on the last K. The kernel's logsumexp gives the band's
    probabilities, and since they and the far keys' sum to one,
    ``out = o + rel_values[0] + p_band @ (rel_values[1:K+1] - rel_values[0])``. The band keys
    sit at offsets ``-(K-1)..0`` (table rows ``1..K``): tables are sliced, not gathered.
    After the flash call has streamed the whole cache each further operation, however small,
    starts from cold caches, so the count matters more than the sizes: 15 computing kernels
    against the 31 of :func:`_attention_flash` (no autograd; no key mask).
    With ``t > 1`` queries the mask would be ``(B, H, t, S)``, a full pass over the cache's
    length per query: the merge of :func:`_attention_flash` is cheaper there.
    """
    query, key, value, K = call.query, call.key, call.value, call.left
    B, H, _, S, D, Dv = call.dims
    F_ = S - K
    q_scaled = query * call.scale  # (B, H, 1, D)
    bias_band: Tensor | None = None  # (B, H, 1, K): band key terms relative to the far row
    if call.rel_keys is not None:
        ak = call.rel_keys  # (Hr, R, D)
        bias_band = q_scaled @ (ak[:, 1 : K + 1] - ak[:, :1]).transpose(-2, -1)
    out, lse = flash_forward(query, key, value, is_causal=False,
                             bias=None if bias_band is None else F.pad(bias_band, (F_, 0)),
                             scale=call.scale)
    out, lse = restore_nan_rows(query, key, out, lse, None, is_causal=False, bias=None)
    if call.rel_values is None:
        return out
    shift = -lse.unsqueeze(-1) if bias_band is None else bias_band - lse.unsqueeze(-1)
    s_band = torch.baddbmm(  # (B*H, 1, K): the band's scores minus the logsumexp
        shift.reshape(B * H, 1, -1), q_scaled.reshape(B * H, 1, D),
        key[:, :, F_:].reshape(B * H, K, D).transpose(1, 2))
    p_band = exp_(s_band)  # the band's probabilities
    av = call.rel_values  # (Hr, R, Dv)
    delta = av[:, 1 : K + 1] - av[:, :1]  # (Hr, K, Dv)
    if av.shape[0] == 1:  # shared: rel_values[0] + p_band @ delta in one GEMM
        extra = torch.addmm(av[0, 0], p_band.view(B * H, K), delta[0])
    else:
        extra = torch.baddbmm(av[:, 0, None].repeat(B, 1, 1), p_band,
                              delta.repeat(B, 1, 1))  # (B*H, 1, Dv)
    return out.add_(extra.view(B, H, 1, Dv))


def _attention_flash(call: AttentionCall, W: int) -> Tensor:
    """Far keys through the flash kernel, band explicit, merged by logsumexp (no autograd)."""
    query, key, value, K = call.query, call.key, call.value, call.left
    B, H, t, S, _, _ = call.dims
    F_ = S - W
    neg_inf = float("-inf")
    far_bias: Tensor | None = None
    far_dead: Tensor | None = None
    if call.key_mask is not None:
        far_mask = call.key_mask[:, :F_]  # (B, F)
        far_bias = torch.zeros(B, 1, 1, F_, dtype=query.dtype, device=query.device)
        far_bias.masked_fill_(~far_mask[:, None, None, :], neg_inf)  # (B, 1, 1, F) additive
        far_dead = ~far_mask.any(dim=-1)[:, None, None]  # (B, 1, 1): no visible far key
    k_far = key[:, :, :F_]
    o_far, lse_far = flash_forward(
        query, k_far, value[:, :, :F_], is_causal=False, bias=far_bias, scale=call.scale
    )  # (B, H, t, D), (B, H, t)
    o_far, lse_far = restore_nan_rows(query, k_far, o_far, lse_far,
                                      None if far_dead is None else ~far_dead,
                                      is_causal=False, bias=far_bias)
    z_far = lse_far
    q_scaled = query * call.scale  # (B, H, t, D)
    qa: Tensor | None = None
    if call.rel_keys is not None:
        qa = q_scaled @ call.rel_keys.transpose(-2, -1)  # (B, H, t, R)
        z_far = z_far + qa[..., 0]  # the far keys' shared key term
    if far_dead is not None:
        z_far = z_far.masked_fill(far_dead, neg_inf)
    # One query with a full band (the common single-token step): its band keys are at
    # offsets -(K-1)..0, i.e. table rows 1..K, so a slice replaces the gather/scatter.
    single = t == 1 and W == K
    index = relative_position_index(t, W, (K, call.right), device=query.device)  # (t, W)
    k_band, v_band = key[:, :, F_:], value[:, :, F_:]  # (B, H, W, D)
    s_band = q_scaled @ k_band.transpose(-2, -1)  # (B, H, t, W)
    if qa is not None:
        band_terms = qa[..., 1 : K + 1] if single else qa.gather(-1, index.expand(B, H, t, W))
        s_band = s_band + band_terms
    keep = visibility_mask(
        t, W, attn_mask=None, key_mask=None if call.key_mask is None else call.key_mask[:, F_:],
        is_causal=call.is_causal and t > 1, query_start=W - t, device=query.device,
    )
    if keep is not None:
        s_band = s_band.masked_fill(~keep, neg_inf)
    lse, masses = combine_log_masses(torch.stack((z_far, torch.logsumexp(s_band, -1)), -1))
    far_mass = masses[..., :1]  # (B, H, t, 1)
    p_band = exp_(s_band - lse.unsqueeze(-1))  # (B, H, t, W)
    out = far_mass * o_far + p_band @ v_band  # (B, H, t, D)
    if call.rel_values is not None:
        R = call.rel_values.shape[-2]
        if single:  # rows 0 | 1..K | K+1..K+right
            buckets = torch.cat((far_mass, p_band, far_mass.new_zeros(B, H, t, call.right)),
                                dim=-1)
        else:
            buckets = _buckets(far_mass, p_band, index, R)
        out = out + buckets @ call.rel_values  # (B, H, t, R) @ (Hr, R, Dv)
    return out


def unsupported_reason(call: AttentionCall) -> Reason | str | None:
    """Why the decode backend cannot serve the call, or None."""
    L, S = call.query_len, call.key_len
    if L > MAX_QUERIES:
        return Reason.of("L={L} queries: the decode backend serves L <= {most} (KV-cache steps)",
                         L=L, most=MAX_QUERIES)
    positional = call.has_relative_terms or call.is_causal
    if positional and call.query_start != S - L:
        return Reason.of("query_start={start}: the decode backend serves queries aligned to the "
                         "end of the keys only (query_start = S - L = {end})",
                         start=call.query_start, end=S - L)
    return None


def auto_reason(call: AttentionCall) -> Reason | str | None:
    """Why ``implementation=None`` does not pick the decode backend: a call that is not a cache
    step (``L >= S``: whole-sequence attention, served by flash_regions/bucketed), or a hard limit.
    None = decode is picked. (The cache-step test comes first: a compiled self-attention then
    depends on ``L >= S`` only, not on how ``L`` compares with ``MAX_QUERIES``.)"""
    if call.query_len >= call.key_len:
        return Reason.of("L = {L}, S = {S}: not a cache step (fewer queries than keys)",
                         L=call.query_len, S=call.key_len)
    if call.query.numel() == 0:
        return "empty attention: nothing to decode"
    return unsupported_reason(call)
