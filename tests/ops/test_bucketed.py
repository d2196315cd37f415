"""The bucketed backend against the reference: grids, tables and terms, masks, dropout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relpos
from helpers import F64, assert_same_as_reference, make_problem, run

SHAPES = [(7, 7, None), (1, 9, None), (4, 11, 2), (5, 5, 0), (3, 8, 5), (9, 13, None)]


def _masks(B, H, L, S, seed):
    g = torch.Generator().manual_seed(seed)
    bool_mask = torch.rand(B, 1, L, S, generator=g) > 0.3
    float_mask = torch.randn(1, H, L, S, generator=g, dtype=F64)
    float_mask[..., 0, 1] = float("-inf")
    key_mask = torch.ones(B, S, dtype=torch.bool)
    key_mask[0, S - 3:] = False
    return bool_mask, float_mask, key_mask


@pytest.mark.parametrize("L,S,query_start", SHAPES)
@pytest.mark.parametrize("K_rule", ["0", "1", "3", "n-1", "n+5"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_bucketed_matches_reference_grid(L, S, query_start, K_rule, is_causal):
    n = max(L, S)
    K = {"0": 0, "1": 1, "3": 3, "n-1": n - 1, "n+5": n + 5}[K_rule]
    p = make_problem(L=L, S=S, K=K, D=4, Dv=6, seed=L * 31 + S)
    assert_same_as_reference(p, "bucketed", query_start=query_start, is_causal=is_causal)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("keys_term,values_term", [(True, True), (True, False), (False, True),
                                                   (False, False)])
def test_bucketed_tables_and_terms(per_head, keys_term, values_term):
    p = make_problem(L=6, S=9, K=2, Dv=3, per_head=per_head, keys_term=keys_term,
                     values_term=values_term, seed=3)
    assert_same_as_reference(p, "bucketed", is_causal=True)


@pytest.mark.parametrize("which", ["bool", "float", "key_mask", "all_bool"])
def test_bucketed_masks(which):
    B, H, L, S = 2, 3, 5, 8
    bool_mask, float_mask, key_mask = _masks(B, H, L, S, seed=7)
    kwargs = {
        "bool": {"attn_mask": bool_mask},
        "float": {"attn_mask": float_mask},
        "key_mask": {"key_mask": key_mask},
        "all_bool": {"attn_mask": bool_mask[0, 0], "key_mask": key_mask, "is_causal": True},
    }[which]
    p = make_problem(B=B, H=H, L=L, S=S, K=2, per_head=True, seed=11)
    assert_same_as_reference(p, "bucketed", **kwargs)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), L=st.integers(1, 9), extra=st.integers(0, 6),
    D=st.integers(1, 5), Dv=st.integers(1, 5), K=st.integers(0, 12),
    causal=st.booleans(), per_head=st.booleans(), seed=st.integers(0, 2**16),
)
def test_bucketed_matches_reference_hypothesis(B, H, L, extra, D, Dv, K, causal, per_head, seed):
    p = make_problem(B=B, H=H, L=L, S=L + extra, D=D, Dv=Dv, K=K, per_head=per_head, seed=seed)
    assert_same_as_reference(p, "bucketed", is_causal=causal)


def test_dropout_same_mask_in_reference_and_bucketed():
    p = make_problem(L=6, K=2, seed=10)
    torch.manual_seed(123)
    a = run(p, "reference", dropout_p=0.4)
    torch.manual_seed(123)
    b = run(p, "bucketed", dropout_p=0.4)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert not torch.allclose(a, run(p, "reference"))


def test_auto_prefers_the_reference_at_the_shortest_sequences(no_native: None) -> None:
    from relpos.ops import bucketed

    def args(n: int, K: int, grad: bool) -> dict:
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 2, n, 8, requires_grad=grad) for _ in range(3))
        ak, av = (torch.randn(2 * K + 1, 8, requires_grad=grad) for _ in range(2))
        return dict(query=q, key=k, value=v, max_distance=K, rel_keys=ak, rel_values=av)

    most_fwd, most_bwd = bucketed.REFERENCE_MAX_KEYS[False], bucketed.REFERENCE_MAX_KEYS[True]
    with torch.no_grad():
        assert relpos.select_backend(**args(most_fwd, 4, False)) == "reference"
        assert relpos.select_backend(**args(most_fwd + 1, 4, False)) == "bucketed"
    # with a backward: only when the window spans every offset
    assert relpos.select_backend(**args(most_bwd, most_bwd, True)) == "reference"
    assert relpos.select_backend(**args(most_bwd, 4, True)) == "bucketed"
    assert relpos.select_backend(**args(most_bwd + 1, most_bwd + 1, True)) == "bucketed"
    # either way the result is the reference's
    a = args(16, 3, True)
    torch.testing.assert_close(relpos.relative_attention(**a),
                               relpos.relative_attention(**a, implementation="bucketed"))
