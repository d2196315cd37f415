"""Merging partial attentions by logsumexp: what the flash_regions and decode backends share.

A query row's keys split into regions ``X``; each contributes its plain output ``o^X`` and its
log-mass ``z^X`` (the logsumexp of its scores, plus any constant the region adds to every
score), and the whole row is (docs/design.md §3)::

    LSE = logsumexp_X z^X,   m^X = exp(z^X - LSE),   out = sum_X m^X o^X

(plus, in the flash_regions and decode backends, each far region's value row times its mass).

Rows with no visible key get ``LSE = +inf`` and masses 0, never NaN.

Shape legend: B batch, H heads, L queries, Dv value head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from relpos.ops._numerics import exp_

__all__ = ["combine_log_masses", "merge_rows"]

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
