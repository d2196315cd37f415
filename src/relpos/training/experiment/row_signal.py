"""The training signal each relative-table row receives: the handbook's undertraining argument,
measured.

In causal self-attention of length L, offset ``-d`` (the key ``d`` positions before the
query) occurs in ``L - d`` query-key pairs per sequence; a clipped table's last row ``-K``
collects every offset ``d >= K``: ``sum_{d=K}^{L-1} (L - d)`` pairs (:func:`pairs_per_row`).
:class:`RowSignal` records, during training, each row's gradient norm per step (the raw
gradient, before clipping) and, at the end, how far each row moved from its
initialization; rows are indexed by the distance back ``d = 0..K`` (row ``K - d`` of the
table). Keys and values tables are combined (``sqrt(|g_key|^2 + |g_value|^2)``) and averaged
over layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["RowSignal", "count_pairs_per_row", "pairs_per_row"]


def pairs_per_row(length: int, k: int) -> list[int]:
    """Query-key pairs per sequence of causal self-attention that use each row, by distance
    back ``d = 0..min(K, L-1)``: ``L - d`` for ``d < K``, and row ``K`` collects
    ``sum_{d=K}^{L-1} (L - d)`` (closed form ``(L - K)(L - K + 1) / 2``)."""
    if length < 1 or k < 0:
        raise ValueError(f"need length >= 1 and K >= 0, got length={length}, K={k}")
    top = min(k, length - 1)
    counts = [length - d for d in range(top)]
    if top == k:
        counts.append((length - k) * (length - k + 1) // 2)
    else:  # K >= L: row d = L-1 holds only its own pairs
        counts.append(length - top)
    return counts


def count_pairs_per_row(length: int, k: int) -> list[int]:
    """:func:`pairs_per_row` counted from the index relpos itself uses (a check of it)."""
    from relpos.positions import relative_position_index

    index = relative_position_index(length, length, k)  # (L, L) rows r + K
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    rows = torch.bincount(index[causal], minlength=2 * k + 1)
    top = min(k, length - 1)
    return [int(rows[k - d]) for d in range(top + 1)]


def _tables(model: nn.Module) -> list[tuple[nn.Parameter | None, nn.Parameter | None]]:
    found = []
    for module in model.modules():
        keys = getattr(module, "rel_keys", None)
        values = getattr(module, "rel_values", None)
        if isinstance(keys, nn.Parameter) or isinstance(values, nn.Parameter):
            found.append((keys, values))
    return found


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _rows(keys: torch.Tensor | None, values: torch.Tensor | None) -> torch.Tensor:
    """Per-row norm of the key and value tables together, (R,)."""
    total = None
    for t in (keys, values):
        if t is None:
            continue
        sq = t.detach().double().pow(2).flatten(0, -2).sum(-1) if t.dim() == 2 else (
            t.detach().double().pow(2).sum(-1).sum(0))  # (H, R, D) per-head tables
        total = sq if total is None else total + sq
    assert total is not None
    return total.sqrt()


class RowSignal:
    """Records per-row gradient norms (pass :meth:`on_backward` to ``train``) and the
    distance from initialization (call :meth:`finish` with the trained model).

    Args:
        k: the clip distance of the model's tables.
        length: the training length L (for the pair counts).
        batch_size: sequences per step.
    """

    def __init__(self, k: int, length: int, batch_size: int) -> None:
        self.k = k
        self.length = length
        self.batch_size = batch_size
        self.rows = k + 1  # causal: distances back 0..K
        self._init: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None
        self._grad_sum = torch.zeros(self.rows, dtype=torch.float64)
        self._steps = 0

    def _reachable(self, per_row: torch.Tensor) -> torch.Tensor:
        # Row K - d holds distance back d; return (K + 1,) indexed by d.
        return per_row[: self.k + 1].flip(0)

    def on_backward(self, step: int, model: nn.Module) -> None:
        tables = _tables(model)
        if not tables:
            return
        if self._init is None:
            self._init = [(_copy(a), _copy(b)) for a, b in tables]
        norms = torch.zeros(self.rows, dtype=torch.float64)
        for keys, values in tables:
            gk = None if keys is None or keys.grad is None else keys.grad
            gv = None if values is None or values.grad is None else values.grad
            if gk is None and gv is None:
                continue
            norms += self._reachable(_rows(gk, gv))
        self._grad_sum += norms / len(tables)
        self._steps += 1

    def finish(self, model: nn.Module) -> dict[str, Any]:
        """The record: ``pairs_per_batch``, ``mean_grad_norm`` and ``moved`` per distance
        back ``d = 0..K`` (lists; ``moved`` is ``|W - W_init|`` of the row)."""
        tables = _tables(model)
        moved = torch.zeros(self.rows, dtype=torch.float64)
        if self._init is not None and tables:
            for (keys, values), (k0, v0) in zip(tables, self._init, strict=True):
                dk = None if keys is None or k0 is None else keys.detach() - k0
                dv = None if values is None or v0 is None else values.detach() - v0
                moved += self._reachable(_rows(dk, dv))
            moved /= len(tables)
        pairs = pairs_per_row(self.length, self.k)
        pairs = pairs + [0] * (self.rows - len(pairs))  # rows beyond L - 1: never used
        grad = self._grad_sum / max(self._steps, 1)
        return {
            "k": self.k,
            "train_length": self.length,
            "pairs_per_batch": [p * self.batch_size for p in pairs],
            "mean_grad_norm": [float(f"{g:.4g}") for g in grad.tolist()],
            "moved": [float(f"{m:.4g}") for m in moved.tolist()],
            "steps": self._steps,
        }
