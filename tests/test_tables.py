"""Resizing relative tables: grow by repeating the edge rows (exact under clipping), shrink
by clipping; whole models through load_state_dict_resized."""

from __future__ import annotations

import pytest
import torch

import relpos
from relpos.tables import resize_relative_table

F64 = torch.float64


def _mha(K: int, **kwargs: object) -> relpos.RelativeMultiheadAttention:
    torch.manual_seed(0)
    return relpos.RelativeMultiheadAttention(  # type: ignore[arg-type]
        12, 3, batch_first=True, max_distance=K, dtype=F64, **kwargs
    )


@pytest.mark.parametrize("per_head", [False, True])
def test_resize_grow_repeats_edges_and_shrink_clips(per_head):
    K, D = 2, 3
    table = torch.arange(float((2 * K + 1) * D)).view(2 * K + 1, D)
    if per_head:
        table = torch.stack([table, -table])  # (H, R, D)
    grown = resize_relative_table(table, 5)
    assert grown.shape[-2:] == (11, D) and grown.shape[:-2] == table.shape[:-2]
    for new_row in range(11):
        offset = new_row - 5
        old_row = max(-K, min(K, offset)) + K
        assert torch.equal(grown[..., new_row, :], table[..., old_row, :])
    shrunk = resize_relative_table(table, 1)
    assert torch.equal(shrunk, table[..., 1:4, :])
    assert torch.equal(resize_relative_table(table, 0), table[..., 2:3, :])
    same = resize_relative_table(table, K)
    assert torch.equal(same, table) and same.data_ptr() != table.data_ptr()


def test_resize_is_differentiable():
    table = torch.randn(5, 4, requires_grad=True)
    resize_relative_table(table, 4).sum().backward()
    assert table.grad is not None
    # The edge rows now stand for 3 offsets each (their own + 2 repeats).
    assert table.grad[:, 0].tolist() == [3.0, 1.0, 1.0, 1.0, 3.0]


@pytest.mark.parametrize("implementation", ["reference", "bucketed", "flash_regions", "native"])
def test_grown_tables_give_identical_outputs_at_every_length(implementation):
    K, K_big, H, D = 2, 7, 2, 4
    g = torch.Generator().manual_seed(0)
    tables = {}
    for per_head in (False, True):
        lead = (H,) if per_head else ()
        rk = torch.randn(*lead, 2 * K + 1, D, generator=g, dtype=F64)
        rv = torch.randn(*lead, 2 * K + 1, D, generator=g, dtype=F64)
        big = (resize_relative_table(rk, K_big), resize_relative_table(rv, K_big))
        tables[per_head] = (rk, rv, *big)
    for S in range(1, 2 * K_big + 4):  # every length up to past 2K'+1
        rk, rv, rk_big, rv_big = tables[S % 2 == 0]  # shared and per-head tables alternate
        for L, causal in ((S, False), (max(1, S // 2), True)):
            q = torch.randn(2, H, L, D, generator=g, dtype=F64)
            k, v = (torch.randn(2, H, S, D, generator=g, dtype=F64) for _ in range(2))
            small = relpos.relative_attention(
                q, k, v, max_distance=K, rel_keys=rk, rel_values=rv, is_causal=causal,
                implementation=implementation,
            )
            big = relpos.relative_attention(
                q, k, v, max_distance=K_big, rel_keys=rk_big, rel_values=rv_big,
                is_causal=causal, implementation=implementation,
            )
            torch.testing.assert_close(big, small, rtol=0, atol=1e-12, msg=f"L={L} S={S}")


def test_load_state_dict_resized_grow_is_exact_and_shrink_clips():
    small, big = _mha(2), _mha(6)
    relpos.load_state_dict_resized(big, small.state_dict())
    assert big.state_dict()["_extra_state"][1] == 6
    for n in (1, 3, 9, 20):
        x = torch.randn(2, n, 12, dtype=F64)
        for causal in (False, True):
            torch.testing.assert_close(
                big(x, is_causal=causal)[0], small(x, is_causal=causal)[0], rtol=0, atol=1e-12
            )
    shrunk = _mha(1)
    relpos.load_state_dict_resized(shrunk, big.state_dict())
    assert big.rel_keys is not None and shrunk.rel_keys is not None
    assert torch.equal(shrunk.rel_keys, big.rel_keys[5:8])


def test_load_state_dict_resized_nested_per_head_and_strict_keys():
    torch.manual_seed(0)
    a = relpos.RelativeTransformerDecoderLayer(
        12, 3, 24, max_distance=2, share_heads=False, relative_cross_attention=True
    )
    b = relpos.RelativeTransformerDecoderLayer(
        12, 3, 24, max_distance=5, share_heads=False, relative_cross_attention=True
    )
    relpos.load_state_dict_resized(b, a.state_dict())
    assert b.multihead_attn.rel_values is not None
    assert b.multihead_attn.rel_values.shape == (3, 11, 4)
    sd = a.state_dict()
    sd["extra.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        relpos.load_state_dict_resized(b, sd)


@pytest.mark.parametrize(
    ("table", "k", "error", "fragment"),
    [
        (torch.zeros(4, 3), 2, ValueError, "odd number 2K\\+1"),
        (torch.zeros(5), 2, ValueError, "shape \\(2K\\+1, D\\)"),
        ("table", 2, TypeError, "must be a torch.Tensor"),
        (torch.zeros(5, 3), -1, ValueError, "new_max_distance must be a non-negative int"),
        (torch.zeros(5, 3), 2.0, TypeError, "new_max_distance must be a non-negative int"),
    ],
)
def test_resize_bad_input(table, k, error, fragment):
    with pytest.raises(error, match=fragment):
        resize_relative_table(table, k)


# --- windows (left, right): each side resized on its own ---------------------------------

WINDOW_PAIRS = [((2, 2), (5, 1)), ((5, 1), (2, 2)), ((0, 0), (3, 4)), ((3, 4), (0, 0)),
                ((0, 5), (5, 0)), ((64, 8), (8, 64)), ((2, 1), (2, 1)), ((1, 3), (1, 9)),
                ((4, 0), (1, 0))]


@pytest.mark.parametrize(("old", "new"), WINDOW_PAIRS)
@pytest.mark.parametrize("per_head", [False, True])
def test_resize_each_side_repeats_or_clips_that_side(old, new, per_head):
    (left, right), (new_left, new_right) = old, new
    D = 2
    table = torch.arange(float((left + right + 1) * D)).view(left + right + 1, D)
    if per_head:
        table = torch.stack([table, -table, 2 * table])  # (H, R, D)
    got = resize_relative_table(table, new, old_max_distance=old)
    assert got.shape[-2] == new_left + new_right + 1 and got.shape[:-2] == table.shape[:-2]
    for new_row in range(new_left + new_right + 1):
        offset = new_row - new_left
        old_row = max(-left, min(right, offset)) + left  # where that offset read before
        assert torch.equal(got[..., new_row, :], table[..., old_row, :]), (new_row, offset)
    assert got.data_ptr() != table.data_ptr()


def test_resize_to_a_window_from_a_symmetric_table_needs_no_old_window():
    table = torch.arange(5.0).view(5, 1)  # K = 2: offsets -2..2
    assert resize_relative_table(table, (4, 0)).flatten().tolist() == [0, 0, 0, 1, 2]
    assert resize_relative_table(table, (0, 3)).flatten().tolist() == [2, 3, 4, 4]
    # A symmetric old window spelled as a pair means the same.
    assert torch.equal(resize_relative_table(table, (4, 0), old_max_distance=(2, 2)),
                       resize_relative_table(table, (4, 0), old_max_distance=2))


def test_resize_window_is_differentiable_edges_collect_their_copies():
    table = torch.randn(4, 3, requires_grad=True)  # (2, 1)
    resize_relative_table(table, (4, 3), old_max_distance=(2, 1)).sum().backward()
    assert table.grad is not None
    assert table.grad[:, 0].tolist() == [3.0, 1.0, 1.0, 3.0]


@pytest.mark.parametrize(("table", "old", "error", "fragment"), [
    (torch.zeros(4, 3), None, ValueError, r"4 rows .*old_max_distance=\(left, right\)"),
    (torch.zeros(6, 3), (2, 2), ValueError, r"6 rows .*means 5 rows"),
    (torch.zeros(5, 3), (1, 2), ValueError, r"5 rows .*means 4 rows"),
    (torch.zeros(5, 3), (1, 2, 1), ValueError, "3 values"),
    (torch.zeros(5, 3), (-1, 5), ValueError, "old_max_distance"),
    (torch.zeros(5, 3), "2", TypeError, "old_max_distance"),
])
def test_resize_old_window_errors(table, old, error, fragment):
    with pytest.raises(error, match=fragment):
        resize_relative_table(table, 3, old_max_distance=old)


@pytest.mark.parametrize("new", [(1, 2, 3), (2, -1), (2, 0.5)])
def test_resize_new_window_errors(new):
    with pytest.raises((TypeError, ValueError), match="new_max_distance"):
        resize_relative_table(torch.zeros(5, 3), new)


@pytest.mark.parametrize("implementation", ["reference", "bucketed", "flash_regions", "native"])
@pytest.mark.parametrize(("old", "new"), [((2, 1), (6, 4)), ((0, 3), (5, 3)), ((4, 0), (4, 7)),
                                          ((0, 0), (3, 2))])
def test_grown_window_tables_give_identical_outputs_at_every_length(implementation, old, new):
    H, D = 2, 4
    g = torch.Generator().manual_seed(0)
    for per_head in (False, True):
        lead = (H,) if per_head else ()
        rk = torch.randn(*lead, sum(old) + 1, D, generator=g, dtype=F64)
        rv = torch.randn(*lead, sum(old) + 1, D, generator=g, dtype=F64)
        rk_big, rv_big = (resize_relative_table(t, new, old_max_distance=old) for t in (rk, rv))
        for S in range(1, max(new) + 4):
            for L, causal in ((S, False), (max(1, S // 2), True)):
                q = torch.randn(2, H, L, D, generator=g, dtype=F64)
                k, v = (torch.randn(2, H, S, D, generator=g, dtype=F64) for _ in range(2))
                kw = dict(is_causal=causal, implementation=implementation)
                small = relpos.relative_attention(q, k, v, max_distance=old, rel_keys=rk,
                                                  rel_values=rv, **kw)
                big = relpos.relative_attention(q, k, v, max_distance=new, rel_keys=rk_big,
                                                rel_values=rv_big, **kw)
                torch.testing.assert_close(big, small, rtol=0, atol=1e-12, msg=f"{L} {S}")


@pytest.mark.parametrize(("old", "new"), [(2, (6, 3)), ((6, 3), 7), ((3, 0), (5, 2)),
                                          ((0, 4), (2, 4))])
def test_load_state_dict_resized_between_windows_is_exact_when_growing(old, new):
    small, big = _mha(old), _mha(new)
    relpos.load_state_dict_resized(big, small.state_dict())
    assert big.state_dict()["_extra_state"].tolist() == (
        relpos.RelativeMultiheadAttention(12, 3, max_distance=new).state_dict()["_extra_state"]
        .tolist())
    for n in (1, 4, 9, 20):
        x = torch.randn(2, n, 12, dtype=F64)
        for causal in (False, True):
            torch.testing.assert_close(big(x, is_causal=causal)[0], small(x, is_causal=causal)[0],
                                       rtol=0, atol=1e-12)
    back = _mha(old, share_heads=True)
    relpos.load_state_dict_resized(back, big.state_dict())  # shrinking back restores the tables
    assert small.rel_keys is not None and back.rel_keys is not None
    assert torch.equal(back.rel_keys, small.rel_keys)


def test_load_state_dict_resized_shrinks_each_side_and_resizes_nested_per_head_tables():
    torch.manual_seed(0)
    a = relpos.RelativeTransformerDecoderLayer(12, 3, 24, max_distance=(64, 8), share_heads=False,
                                               relative_cross_attention=True)
    b = relpos.RelativeTransformerDecoderLayer(12, 3, 24, max_distance=(4, 10),
                                               share_heads=False, relative_cross_attention=True)
    relpos.load_state_dict_resized(b, a.state_dict())
    for name in ("self_attn", "multihead_attn"):
        old, new = getattr(a, name), getattr(b, name)
        assert new.rel_values.shape == (3, 15, 4)
        # offsets -4..8 are the old rows 60..72, then +9, +10 repeat the old edge row (+8).
        assert torch.equal(new.rel_values[:, :13], old.rel_values[:, 60:])
        assert torch.equal(new.rel_values[:, 13:], old.rel_values[:, -1:].expand(3, 2, 4))


def test_load_state_dict_resized_needs_the_window_of_an_even_table_without_state():
    sd = _mha((2, 1)).state_dict()
    del sd["_extra_state"]
    with pytest.raises(ValueError, match="odd number 2K\\+1 of rows"):
        relpos.load_state_dict_resized(_mha(3), sd, strict=False)
    sd = _mha((2, 1)).state_dict()
    sd["rel_keys"] = torch.zeros(5, 4, dtype=F64)  # disagrees with the saved (2, 1)
    with pytest.raises(ValueError, match=r"rel_keys has shape \(5, 4\) .*max_distance=\(2, 1\)"):
        relpos.load_state_dict_resized(_mha(3), sd)
