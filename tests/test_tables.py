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


@pytest.mark.parametrize("implementation", ["reference", "bucketed", "fused"])
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
