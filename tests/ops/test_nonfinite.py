"""A NaN in anything a row attends to gives NaN in that row, in every backend: the flash
kernels report a row whose scores are all NaN like an empty row, and must not hide it."""

from __future__ import annotations

import itertools

import pytest
import torch

import relpos
from helpers import F64, serving_backends

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


VALUE_ROWS_CONTAINED = ("reference", "flash_regions")
"""The backends that keep a non-finite ``rel_values`` row from the rows with no key at its
offset; the others multiply per-row value buckets by the whole table (documented)."""


@pytest.mark.parametrize("what", ["rel_keys", "rel_values"])
@pytest.mark.parametrize(("L", "S", "causal", "padded"), [
    (20, 20, False, False), (20, 20, True, False), (20, 20, False, True), (2, 20, False, False),
    (1, 20, True, True),
])
def test_nan_in_a_table_row_reaches_only_the_rows_that_read_it(what, L, S, causal, padded):
    """Every row that sees a key at offset r of a non-finite table row r is NaN; a row with no
    key at that offset at all stays finite and unchanged, in every backend, edge rows
    included (except where value buckets multiply the whole table: documented)."""
    K = 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 4, dtype=F64, generator=g) for n in (L, S, S))
    key_mask = None
    if padded:
        key_mask = torch.ones(2, S, dtype=torch.bool)
        key_mask[1, :5] = False
    index = relpos.relative_position_index(L, S, K)  # (L, S) table rows
    visible = torch.ones(2, L, S, dtype=torch.bool)
    if causal:
        visible &= torch.arange(S)[None, :] <= torch.arange(S - L, S)[:, None]
    if key_mask is not None:
        visible &= key_mask[:, None, :]
    for row in range(2 * K + 1):
        tables = {name: torch.randn(2 * K + 1, 4, dtype=F64, generator=g)
                  for name in ("rel_keys", "rel_values")}
        clean = dict(tables)
        tables[what] = tables[what].clone()
        tables[what][row, 1] = float("nan")
        call = dict(query=q, key=k, value=v, max_distance=K, is_causal=causal, key_mask=key_mask)
        sees = ((index == row)[None] & visible).any(-1)  # (B, L)
        never = ~(index == row).any(-1)[None].expand(2, L)  # (B, L): no key at that offset
        for name in serving_backends(**call, **tables):
            out = relpos.relative_attention(**call, **tables, implementation=name)
            ref = relpos.relative_attention(**call, **clean, implementation=name)
            bad = ~out.isfinite().all(-1).all(1)  # (B, L)
            assert bad[sees].all(), (name, row)
            if what == "rel_values" and name not in VALUE_ROWS_CONTAINED:
                continue  # documented: their value buckets multiply the whole table
            assert not bad[never].any(), (name, row, bad)
            keep = never[:, None, :, None].expand_as(out)
            torch.testing.assert_close(out[keep], ref[keep], rtol=0, atol=1e-12)
