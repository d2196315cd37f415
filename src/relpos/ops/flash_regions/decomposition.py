"""The exact region decomposition (docs/design.md §3), forward and backward.

Every key ``j`` of query ``i`` (position ``p_i = query_start + i``, offset ``d = j - p_i``)
lies in exactly one region:

- far-left  ``FL``: ``d <= -left``             (relative key/value row 0)
- band      ``BD``: ``-left < d < fr``          (row ``d + left``; with ``is_causal`` ``d <= 0``)
- far-right ``FR``: ``d >= fr = max(right, 1 - left)``   (row R - 1; empty with ``is_causal``)

for a window ``(left, right)`` (``left = right = K`` for a clip distance). For ``left = 0`` the
offset 0 belongs to FL only, so it is counted once. FL and FR are plain
attention through the flash kernels (:mod:`~relpos.ops.flash_regions.far`), the band is explicit
(:mod:`~relpos.ops.flash_regions.band`), and the three are merged by logsumexp
(:mod:`~relpos.ops._lse`; the far rows' terms: :mod:`~relpos.ops.flash_regions.far_terms`). The
backward hands each far region's flash backward the GLOBAL output and logsumexp, shifted by
the region's constant, so its probabilities and its ``delta`` are the global ones. The
constants' own gradients are closed-form: ``dc_FL = m_FL (dO . (o_FL + aV[-K]) - delta)``,
and since the softmax gradient sums to zero over a row,
``dc_FR = -dc_FL - (sum of dS over the band)``, so the far-right output need not be kept.
Everything is deterministic: no atomics, no scatter with repeated indices.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
K clip distance, R = left + right + 1 table rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from relpos.ops._lse import combine_log_masses
from relpos.ops._numerics import accumulation_dtype, exp_
from relpos.ops.flash_regions.band import (
    BandLayout,
    BandOperands,
    band_backward,
    band_forward,
    pad_rows,
)
from relpos.ops.flash_regions.far import far_backward, far_forward, key_bias
from relpos.ops.flash_regions.far_terms import (
    add_far_rows,
    add_rows_times_table,
    far_key_terms,
    row_dot,
)

__all__ = ["fused_backward", "fused_forward", "region_offsets"]

_INF = math.inf


def region_offsets(
    query_len: int, key_len: int, left: int, right: int, is_causal: bool, query_start: int
) -> tuple[int, int | None]:
    """Offsets ``c`` of FL (``j <= i + c``) and of FR in reversed coordinates (None = empty)."""
    c_left = query_start - left
    if is_causal:
        return c_left, None
    # FR: j >= p_i + fr; reversed (i' = L-1-i, j' = S-1-j): j' <= i' + S - L - (qs + fr).
    return c_left, key_len - query_len - (query_start + max(right, 1 - left))


def _real_keys_only(key_mask: Tensor | None) -> Tensor | None:
    """``key_mask``, or None when every key is real (no bias, no dead-row bookkeeping)."""
    return None if key_mask is None or bool(key_mask.all()) else key_mask


def _flat(x: Tensor) -> Tensor:
    """``(B, H, ...) -> (1, B*H, ...)`` (a view for contiguous ``x``)."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def _far_value_rows(rel_values: Tensor, B: int, H: int) -> Tensor:
    """The first and last rows of ``rel_values`` per flat head: ``(B*H, 2, Dv)``."""
    rows = rel_values[:, [0, -1]]  # (Hr, 2, Dv)
    return rows[None].expand(B, H, *rows.shape[1:]).reshape(B * H, *rows.shape[1:])


def fused_forward(
    query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_mask: Tensor | None, *, left: int, right: int, is_causal: bool,
    scale: float, query_start: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Exact clipped relative attention of contiguous ``query``, ``key``, ``value``.

    Returns:
        ``out (B, H, L, Dv)``, merged logsumexp ``(B, H, L)`` (+inf for rows with no key),
        the far-left plain output ``(B, H, L, Dv)`` and the far regions' masses
        ``(B, H, L, 2)``, which the backward needs.
    """
    (B, H, L, _), S, Dv = query.shape, key.shape[2], value.shape[-1]
    acc, dev = accumulation_dtype(query.dtype), query.device
    key_mask = _real_keys_only(key_mask)
    bias, counts = key_bias(key_mask, query.dtype, H)
    c_left, c_right = region_offsets(L, S, left, right, is_causal, query_start)
    qf, kf, vf = _flat(query), _flat(key), _flat(value)

    o_left, lam_left = far_forward(qf, kf, vf, c_left, bias, counts, scale, reversed=False)
    o_left, lam_left = o_left.view(B, H, L, Dv), lam_left.view(B, H, L)
    o_right: Tensor | None = None
    lam_right = torch.full((B, H, L), -_INF, dtype=acc, device=dev)
    if c_right is not None:
        o_right, lam_right = far_forward(qf, kf, vf, c_right, bias, counts, scale, reversed=True)
        o_right, lam_right = o_right.view(B, H, L, Dv), lam_right.view(B, H, L)

    z_left, z_right = lam_left, lam_right
    if rel_keys is not None:
        c_far = far_key_terms(query, rel_keys, scale)  # (B, H, L, 2)
        # A region with no visible key keeps log-mass -inf: a non-finite edge row of rel_keys
        # reaches only the rows that see a key at its offset.
        z_left = torch.where(lam_left == -_INF, lam_left, lam_left + c_far[..., 0])
        z_right = torch.where(lam_right == -_INF, lam_right, lam_right + c_far[..., 1])

    layout = BandLayout.build(L, S, left, right, is_causal, query_start)
    if layout.num_offsets > 0:
        operands = BandOperands.prepare(
            layout, query, key, value, rel_keys, rel_values, key_mask, scale
        )
        o_band, m_band, z_band = band_forward(layout, operands)
        del operands
        lse, masses = combine_log_masses(
            torch.stack((z_left, z_right, z_band[:, :L].view(B, H, L)), -1)  # (B, H, L, 3)
        )
        masses = masses[..., :2]  # (B, H, L, 2): the far regions'
        out = o_band[:, :L].view(B, H, L, Dv)
        out = out.mul_(exp_(m_band[:, :L].view(B, H, L) - lse)[..., None])
    else:
        lse, masses = combine_log_masses(torch.stack((z_left, z_right), -1))
        out = torch.zeros(B, H, L, Dv, dtype=acc, device=dev)
    out = out.addcmul_(masses[..., 0, None], o_left)
    if o_right is not None:
        out = out.addcmul_(masses[..., 1, None], o_right)
    if rel_values is not None:
        rows = rel_values[:, [0, -1]].to(acc)  # (Hr, 2, Dv)
        if bool(rows.isfinite().all()):
            add_rows_times_table(out, masses, rows, 1.0)
        else:  # a non-finite edge row reaches only the rows that see a key in its region
            for side, lam in enumerate((lam_left, lam_right)):
                term = masses[..., side, None] * rows[None, :, side, None, :]  # (B, H, L, Dv)
                out += torch.where((lam != -_INF)[..., None], term, 0.0)
    return out.to(query.dtype).contiguous(), lse.contiguous(), o_left, masses.contiguous()


def fused_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_mask: Tensor | None, out: Tensor, lse: Tensor,
    o_left: Tensor, masses: Tensor, *, left: int, right: int, is_causal: bool, scale: float,
    query_start: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Gradients of :func:`fused_forward` w.r.t. query, key, value, rel_keys, rel_values."""
    (B, H, L, D), S, Dv = query.shape, key.shape[2], value.shape[-1]
    acc, dev = accumulation_dtype(query.dtype), query.device
    key_mask = _real_keys_only(key_mask)
    bias, _ = key_bias(key_mask, query.dtype, H)
    c_left, c_right = region_offsets(L, S, left, right, is_causal, query_start)
    grad_out = grad_out.contiguous()
    go_acc = grad_out.to(acc)
    delta = row_dot(go_acc, out, acc)  # (B, H, L)
    dk = torch.zeros(B * H, S, D, dtype=acc, device=dev)
    dv = torch.zeros(B * H, S, Dv, dtype=acc, device=dev)
    dak = None if rel_keys is None else torch.zeros(rel_keys.shape, dtype=acc, device=dev)
    dav = None if rel_values is None else torch.zeros(rel_values.shape, dtype=acc, device=dev)

    # Band first: its dq initializes the accumulator.
    layout = BandLayout.build(L, S, left, right, is_causal, query_start)
    if layout.num_offsets > 0:
        operands = BandOperands.prepare(
            layout, query, key, value, rel_keys, rel_values, key_mask, scale
        )
        Lp = layout.padded_queries
        band_dq, ds_sum, band_dak, band_dav = band_backward(
            layout, operands, pad_rows(go_acc.reshape(B * H, L, Dv), Lp),
            pad_rows(lse.reshape(B * H, L), Lp, _INF), pad_rows(delta.reshape(B * H, L), Lp),
            dk, dv,
        )
        del operands
        dq = band_dq[:, :L].contiguous().view(B, H, L, D)
        band_ds = ds_sum[:, :L].reshape(B, H, L)  # sum of dS over each row's band
        for table_grad, per_head in ((dak, band_dak), (dav, band_dav)):
            if table_grad is not None and per_head is not None:  # per_head: (H, rows, X)
                if table_grad.shape[0] == 1:
                    per_head = per_head.sum(0, keepdim=True)
                table_grad[:, layout.table_slice] += per_head
    else:
        dq = torch.zeros(B, H, L, D, dtype=acc, device=dev)
        band_ds = torch.zeros(B, H, L, dtype=acc, device=dev)

    c_far = None if rel_keys is None else far_key_terms(query, rel_keys, scale)  # (B, H, L, 2)
    av_flat = None if rel_values is None else _far_value_rows(rel_values, B, H)  # (BH, 2, Dv)
    dqf, dkf, dvf = dq.view(1, B * H, L, D), dk[None], dv[None]  # views: updated in place
    regions = [(0, False, c_left)] if c_right is None else [(0, False, c_left), (1, True, c_right)]
    for side, reversed_, c in regions:
        lse_s = lse if c_far is None else lse - c_far[..., side]  # (B, H, L)
        far_backward(
            _flat(grad_out), _flat(query), _flat(key), _flat(value), _flat(out), _flat(lse_s),
            None if av_flat is None else av_flat[:, side], c, bias, scale, reversed_,
            dqf, dkf, dvf,
        )

    # Closed-form gradients of the far regions' constant terms: dc_X = sum of dS over region X.
    # FL directly; FR from "dS sums to zero over each row".
    dot = row_dot(go_acc, o_left, acc)  # (B, H, L)
    if rel_values is not None:
        av = rel_values[:, [0, -1]].to(acc)  # (Hr, 2, Dv)
        dot = dot + torch.matmul(go_acc, av[:, 0, :, None]).squeeze(-1)
    dc_left = masses[..., 0] * (dot - delta)  # (B, H, L)
    # (B, H, L, F)
    dc = dc_left[..., None] if c_right is None else torch.stack((dc_left, -dc_left - band_ds), -1)
    n_far = dc.shape[-1]
    if rel_keys is not None and dak is not None:
        ak = rel_keys[:, [0, -1]].to(acc)  # (Hr, 2, D)
        add_rows_times_table(dq, dc, ak[:, :n_far], scale)  # (B, H, L, D)
        g_rows = torch.einsum("bhlf,bhld->hfd", dc, query.to(acc)) * scale  # (H, F, D)
        add_far_rows(dak, g_rows)
    if rel_values is not None and dav is not None:
        g_rows = torch.einsum("bhlf,bhld->hfd", masses[..., :n_far].to(acc), go_acc)
        add_far_rows(dav, g_rows)
    dt = query.dtype
    return (
        dq.to(dt), dk.view(B, H, S, D).to(dt), dv.view(B, H, S, Dv).to(dt),
        None if dak is None else dak.to(dt), None if dav is None else dav.to(dt),
    )
