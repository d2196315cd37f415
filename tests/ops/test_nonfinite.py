"""A NaN in anything a row attends to gives NaN in that row, in every backend: the flash
kernels report a row whose scores are all NaN like an empty row, and must not hide it."""

from __future__ import annotations

import itertools

import pytest
import torch

import relpos
from helpers import F64

CASES = [(L, S, K, causal, j, what)
         for L, S, K, causal, j, what in itertools.product(
             (1, 3, 8), (5, 8, 20), (0, 1, 2, 4), (False, True), (0, 1, 4), ("key", "value"))
         if L <= S]


def _sees(L: int, S: int, causal: bool, j: int, key_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, L) True where query i attends key j (bottom-right aligned)."""
    pos = torch.arange(S - L, S)
    sees = (j <= pos) if causal else torch.ones(L, dtype=torch.bool)
    if key_mask is None:
        return sees[None].expand(2, L)
    return sees[None] & key_mask[:, j, None]


@pytest.mark.parametrize("implementation", relpos.available_backends())
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_nan_in_an_attended_key_or_value_gives_nan(implementation, grad, padded):
    g = torch.Generator().manual_seed(0)
    missed = []
    for L, S, K, causal, j, what in CASES:
        q = torch.randn(2, 2, L, 4, dtype=F64, generator=g, requires_grad=grad)
        k = torch.randn(2, 2, S, 4, dtype=F64, generator=g)
        v = torch.randn(2, 2, S, 4, dtype=F64, generator=g)
        (k if what == "key" else v).data[:, :, j, 0] = float("nan")
        key_mask = None
        if padded:  # batch row 1 hides key j (and keeps the last key real)
            key_mask = torch.ones(2, S, dtype=torch.bool)
            key_mask[1, j] = j == S - 1
        table = torch.randn(2 * K + 1, 4, dtype=F64, generator=g)
        out = relpos.relative_attention(q, k, v, max_distance=K, rel_keys=table,
                                        rel_values=table, is_causal=causal, key_mask=key_mask,
                                        implementation=implementation)
        nan_rows = out.isnan().any(-1).any(1)  # (B, L)
        if not bool(nan_rows[_sees(L, S, causal, j, key_mask)].all()):
            missed.append((L, S, K, causal, j, what))
    assert not missed, f"NaN swallowed for (L, S, K, causal, j, what) = {missed[:5]}"


@pytest.mark.parametrize("implementation", relpos.available_backends())
@pytest.mark.parametrize("K", [0, 2])
def test_nan_query_row_gives_nan_in_that_row(implementation, K):
    q = torch.randn(1, 2, 3, 4, dtype=F64)
    k = torch.randn(1, 2, 9, 4, dtype=F64)
    q[0, 1, 0] = float("nan")
    out = relpos.relative_attention(q, k, k, max_distance=K, rel_keys=torch.randn(2 * K + 1, 4,
                                    dtype=F64), implementation=implementation)
    assert out[0, 1, 0].isnan().all()
    assert out[0, 0].isfinite().all() and out[0, 1, 1:].isfinite().all()
