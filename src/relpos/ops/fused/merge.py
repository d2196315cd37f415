"""Merging partial attentions by logsumexp, and the far rows' closed-form terms.

A region ``X`` of a query row contributes its plain output ``o^X``, its log-mass ``z^X``
(logsumexp of its scores, plus its constant relative key term for a far region) and, for a
far region, its value row ``aV[-left]`` (the table's first row) or ``aV[+right]`` (its last
row) (DESIGN.md §3)::

    LSE = logsumexp_X z^X,   m^X = exp(z^X - LSE),   out = sum_X m^X (o^X + aV^X)

Used by the fused backend (far-left, far-right, band) and the decode backend (far keys, band).

Shape legend: B batch, H heads, L queries, D head dim, Dv value head dim, K clip distance,
F far regions (1 or 2), Hr table heads (1 or H).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from relpos.ops.call import accumulation_dtype, exp_

__all__ = [
    "add_far_rows",
    "add_rows_times_table",
    "combine_log_masses",
    "far_key_terms",
    "merge_rows",
    "row_dot",
]

_INF = math.inf


def combine_log_masses(log_masses: Tensor) -> tuple[Tensor, Tensor]:
    """Merged logsumexp and the regions' masses from their log-masses.

    Args:
        log_masses: ``(..., regions)``; ``-inf`` for an empty region.

    Returns:
        ``lse (...)``, ``+inf`` where every region is empty (so that ``exp(s - lse)`` is 0
        there, never NaN), and ``masses (..., regions)``, 0 for empty regions.
    """
    lse = torch.logsumexp(log_masses, -1).nan_to_num_(neginf=_INF)
    return lse, exp_(log_masses - lse[..., None])


def merge_rows(
    o: Tensor, lam: Tensor, rows: slice, po: Tensor, pl: Tensor, first: bool
) -> None:
    """Merge a partial output ``po`` with logsumexp ``pl`` into ``o[:, :, rows]`` and
    ``lam[:, :, rows]`` in place (``first``: overwrite instead)."""
    if first:
        o[:, :, rows] = po
        lam[:, :, rows] = pl
        return
    old_o, old_l = o[:, :, rows], lam[:, :, rows]
    new_l = torch.logaddexp(old_l, pl)
    safe = new_l.nan_to_num(neginf=_INF)
    w_old = exp_(old_l - safe)[..., None]
    w_new = exp_(pl - safe)[..., None]
    o[:, :, rows] = (old_o * w_old + po * w_new).to(o.dtype)
    lam[:, :, rows] = new_l


def far_key_terms(q: Tensor, rel_keys: Tensor, scale: float) -> Tensor:
    """``scale * q . rel_keys[first row]`` and ``... [last row]`` (offsets ``-left`` and
    ``+right``) as ``(B, H, L, 2)`` in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    rows = rel_keys[:, [0, -1]].to(acc).transpose(-1, -2) * scale  # (Hr, D, 2)
    return torch.matmul(q.to(acc), rows)  # (B, H, L, 2)


ROWS_PER_CHUNK = 1 << 16
"""Row-wise merges take heads in chunks of about this many rows: no temporary as large as a
whole ``(B, H, L, X)`` input, and no Python loop over B·H for short sequences."""


def _head_chunks(N: int, L: int) -> range:
    return range(0, N, max(1, ROWS_PER_CHUNK // max(1, L)))


def row_dot(a: Tensor, b: Tensor, acc: torch.dtype) -> Tensor:
    """``(a * b).sum(-1)`` of ``(B, H, L, X)`` tensors in ``acc``, heads in chunks."""
    B, H, L, X = a.shape
    af, bf = a.reshape(B * H, L, X), b.reshape(B * H, L, X)
    res = torch.empty(B * H, L, dtype=acc, device=a.device)
    step = _head_chunks(B * H, L).step
    for h in _head_chunks(B * H, L):
        res[h : h + step] = (af[h : h + step].to(acc) * bf[h : h + step].to(acc)).sum(-1)
    return res.view(B, H, L)


def add_rows_times_table(x: Tensor, w: Tensor, table: Tensor, alpha: float) -> None:
    """``x += alpha * w @ table[head]`` in place, heads in chunks (no full-size temporary).

    Args:
        x: ``(B, H, L, X)``, contiguous, updated in place.
        w: ``(B, H, L, F)``.
        table: ``(Hr, F, X)``.
    """
    B, H, L, X = x.shape
    tab = table.to(x.dtype).expand(H, *table.shape[1:])[None].expand(B, H, *table.shape[1:])
    xf, wf, tf = x.view(B * H, L, X), w.reshape(B * H, L, -1).to(x.dtype), tab.reshape(
        B * H, *table.shape[1:])
    step = _head_chunks(B * H, L).step
    for h in _head_chunks(B * H, L):
        xf[h : h + step].baddbmm_(wf[h : h + step], tf[h : h + step], alpha=alpha)


def add_far_rows(table_grad: Tensor, g_rows: Tensor) -> None:
    """Add ``(H, F, X)`` gradients of the first row (and the last) into a ``(Hr, R, X)`` table
    gradient (with one row, both go to it)."""
    if table_grad.shape[0] == 1:
        g_rows = g_rows.sum(0, keepdim=True)
    table_grad[:, 0] += g_rows[:, 0]
    if g_rows.shape[1] > 1:
        table_grad[:, -1] += g_rows[:, 1]
