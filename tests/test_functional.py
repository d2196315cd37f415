"""relative_attention: bucketed vs reference, invariants, gradcheck, masked rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import relpos
from helpers import F64, forward_backward, make_problem, run

# (L, S, query_start) with L != S, odd sizes.












@pytest.mark.parametrize("implementation", ["reference", "bucketed"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck(implementation, is_causal):
    p = make_problem(B=1, H=2, L=3, S=5, D=2, Dv=3, K=1, per_head=True, seed=5)
    key_mask = torch.tensor([[True, True, True, True, False]])

    def fn(q, k, v, ak, av):
        return relpos.relative_attention(
            q, k, v, max_distance=1, rel_keys=ak, rel_values=av, is_causal=is_causal,
            key_mask=key_mask, implementation=implementation,
        )

    assert torch.autograd.gradcheck(fn, tuple(p.leaves()))


# Invariants -------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["reference", "bucketed"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_zero_tables_equal_sdpa(implementation, is_causal):
    p = make_problem(L=7, K=3, seed=2)
    with torch.no_grad():
        p.rel_keys.zero_()
        p.rel_values.zero_()
    out = run(p, implementation, is_causal=is_causal)
    expected = F.scaled_dot_product_attention(p.query, p.key, p.value, is_causal=is_causal)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


def _unclipped_loops(q, k, v, full_k, full_v, query_start, scale):
    """Unclipped Shaw attention, written with Python loops over (i, j).

    ``full_k``/``full_v`` have one row per offset ``-(S-1) .. S-1`` (row = offset + S - 1).
    """
    B, H, L, _ = q.shape
    S = k.shape[2]
    out = torch.zeros(B, H, L, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                pos = query_start + i
                logits = torch.stack([
                    scale * torch.dot(q[b, h, i], k[b, h, j] + full_k[j - pos + S - 1])
                    for j in range(S)
                ])
                w = torch.softmax(logits, dim=0)
                out[b, h, i] = sum(w[j] * (v[b, h, j] + full_v[j - pos + S - 1]) for j in range(S))
    return out


@pytest.mark.parametrize("implementation", ["reference", "bucketed"])
@pytest.mark.parametrize("L,S,query_start,extra", [(5, 5, 0, 0), (3, 6, 3, 4), (2, 6, 1, 0)])
def test_large_k_is_unclipped(implementation, L, S, query_start, extra):
    K = S - 1 + extra  # K >= max(L, S) - 1: nothing is clipped
    p = make_problem(B=1, H=2, L=L, S=S, D=3, K=K, seed=4)
    out = run(p, implementation, query_start=query_start)
    # Offsets -(S-1)..S-1 use rows K-(S-1)..K+(S-1) of the table.
    rows = slice(K - (S - 1), K + S)
    expected = _unclipped_loops(
        p.query.detach(), p.key.detach(), p.value.detach(), p.rel_keys.detach()[rows],
        p.rel_values.detach()[rows], query_start, 1 / math.sqrt(3),
    )
    torch.testing.assert_close(out.detach(), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("implementation", ["reference", "bucketed"])
def test_k0_is_key_and_value_bias(implementation):
    p = make_problem(L=6, S=9, K=0, seed=8)
    out = run(p, implementation, is_causal=True)
    bias_k, bias_v = p.rel_keys[0], p.rel_values[0]
    # Causal with bottom-right alignment: query i sees keys j <= i + (S - L).
    L, S = 6, 9
    visible = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)
    expected = F.scaled_dot_product_attention(
        p.query, p.key + bias_k, p.value + bias_v, attn_mask=visible
    )
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


def test_scale_multiplies_both_terms():
    p = make_problem(L=4, K=2, seed=9)
    out = run(p, "reference", scale=0.3)
    idx = relpos.relative_position_index(4, 4, 2)
    content = p.query @ p.key.transpose(-1, -2)
    relative = torch.einsum("bhld,lsd->bhls", p.query, p.rel_keys[idx])
    scores = 0.3 * (content + relative)
    w = scores.softmax(-1)
    expected = w @ p.value + torch.einsum("bhls,lsd->bhld", w, p.rel_values[idx])
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(run(p, "bucketed", scale=0.3), expected, atol=1e-12, rtol=0)




# Fully masked rows ------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", relpos.available_backends())
@pytest.mark.parametrize("how", ["key_mask", "bool_mask", "float_mask"])
def test_fully_masked_rows_give_zeros(implementation, how):
    B, H, L, S = 2, 2, 4, 6
    p = make_problem(B=B, H=H, L=L, S=S, K=2, seed=12)
    kwargs: dict[str, object] = {}
    if how == "key_mask":
        km = torch.ones(B, S, dtype=torch.bool)
        km[1] = False  # batch row 1 sees nothing
        kwargs["key_mask"] = km
        dead = (slice(1, 2), slice(None), slice(None))
    elif how == "bool_mask":
        m = torch.ones(L, S, dtype=torch.bool)
        m[2] = False
        kwargs["attn_mask"] = m
        dead = (slice(None), slice(None), slice(2, 3))
    else:
        m = torch.zeros(L, S, dtype=F64)
        m[2] = float("-inf")
        kwargs["attn_mask"] = m
        dead = (slice(None), slice(None), slice(2, 3))
    if implementation == "flash_regions" and relpos.explain_backends(
        p.query, p.key, p.value, max_distance=2, rel_keys=p.rel_keys, rel_values=p.rel_values,
        **kwargs,  # type: ignore[arg-type]
    )["flash_regions"] is not None and how != "key_mask":
        # the flash_regions backend refuses dense masks; auto must still be right
        implementation = None
    out, grads = forward_backward(p, implementation, **kwargs)
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert torch.isfinite(out).all()
    for g in grads:
        assert torch.isfinite(g).all()
    out_ref, grads_ref = forward_backward(p, "reference", **kwargs)
    torch.testing.assert_close(out, out_ref, atol=1e-10, rtol=0)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-10, rtol=0)


def test_auto_dispatch_runs_a_backend_that_matches_reference():
    p = make_problem(L=9, K=3, seed=13)
    torch.testing.assert_close(run(p, None, is_causal=True), run(p, "reference", is_causal=True),
                               atol=1e-10, rtol=0)


