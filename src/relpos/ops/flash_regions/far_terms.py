"""The far regions' closed-form relative terms, and the row-wise products around them.

A far region ``X`` of a query row adds one constant to every score, ``scale * q . aK^X``, and
one value row ``aV^X`` to its output: the table's first row (offset ``-left``, far-left) or
its last (``+right``, far-right). Merged by logsumexp (:mod:`relpos.ops._lse`) with the
region's log-mass ``z^X`` and mass ``m^X`` (docs/design.md §3)::

    out = sum_X m^X (o^X + aV^X)

so the forward adds ``masses @ aV[first, last]`` and the backward the matching table and
query gradients, heads in chunks (no full-size temporary).

Shape legend: B batch, H heads, L queries, D head dim, Dv value head dim, K clip distance,
F far regions (1 or 2), Hr table heads (1 or H).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relpos.ops._numerics import accumulation_dtype

__all__ = ["add_far_rows", "add_rows_times_table", "far_key_terms", "row_dot"]


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
