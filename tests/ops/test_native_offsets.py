"""The native kernels' internal entry at any query offset, and dropout placement: what
context parallelism (relpos.distributed) builds on.

A piece of a larger attention puts its queries anywhere relative to its keys: before them
(``query_start < 0``), past ``S - L``, or past every key. Forward (out and logsumexp) and
backward equal a plain float64 definition written here; with a dropout placement (a seed of
five int64) the keep mask of a piece is the matching block of the whole call's mask.
"""

from __future__ import annotations

import math

import pytest
import torch

from relpos.ops import native

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native kernels")

INF = math.inf


def _definition(q, k, v, rk, rv, kb, *, left, right, query_start, causal, scale):
    """out and logsumexp (+inf for rows that see no key) at positions query_start + i."""
    L, S = q.shape[2], k.shape[2]
    p = query_start + torch.arange(L)[:, None]
    j = torch.arange(S)[None, :]
    idx = (j - p).clamp(-left, right) + left
    s = torch.einsum("bhld,bhsd->bhls", q, k)
    if rk is not None:
        s = s + torch.einsum("bhld,hlsd->bhls", q, rk[:, idx])
    s = s * scale
    if kb is not None:
        s = s + kb[:, None, None, :]
    if causal:
        s = s.masked_fill(j > p, -INF)
    empty = (s == -INF).all(-1, keepdim=True)  # rows that see no key (no NaN gradient)
    lse = torch.logsumexp(s.masked_fill(empty, 0.0), -1)
    probs = torch.exp(s - lse[..., None]).masked_fill(empty, 0.0)
    lse = lse.masked_fill(empty[..., 0], -INF)
    out = probs @ v
    if rv is not None:
        out = out + torch.einsum("bhls,hlsd->bhld", probs, rv[:, idx])
    return out, lse.masked_fill(lse == -INF, INF)


def _op(q, k, v, rk, rv, kb, seed=None, dropout_p=0.0, **options):
    from relpos.ops.native import op  # noqa: F401  (registers the op)

    return torch.ops.relpos.native_attention(q, k, v, rk, rv, kb, None, seed,
                                             dropout_p=dropout_p, **options)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("query_start", [-12, -4, -1, 0, 3, 6, 9, 25])
@pytest.mark.parametrize("window", [(0, 0), (2, 2), (3, 1)])
def test_any_query_offset_forward_and_backward(query_start, causal, window):
    g = torch.Generator().manual_seed(query_start + 100 * causal)
    B, H, L, S, D, Dv = 2, 3, 5, 9, 4, 3
    left, right = window
    R = left + right + 1

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    q, k, v = t(B, H, L, D), t(B, H, S, D), t(B, H, S, Dv)
    rk, rv = t(H, R, D), t(1, R, Dv)
    kb = torch.zeros(B, S, dtype=torch.float64)
    kb[1, ::3] = -INF  # padded keys of batch row 1
    options = dict(left=left, right=right, is_causal=causal, scale=0.7,
                   query_start=query_start)
    out, lse = _op(q, k, v, rk, rv, kb, **options)
    want_out, want_lse = _definition(q, k, v, rk, rv, kb, left=left, right=right,
                                     query_start=query_start, causal=causal, scale=0.7)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    assert torch.equal(lse == INF, want_lse == INF)
    torch.testing.assert_close(lse[lse < INF], want_lse[want_lse < INF], rtol=0, atol=1e-12)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v, rk, rv))
    want = torch.autograd.grad((want_out * w).sum(), (q, k, v, rk, rv))
    for got, exp in zip(grads, want, strict=True):
        torch.testing.assert_close(got, exp, rtol=0, atol=1e-11)


@pytest.mark.parametrize("query_start", [-3, 4, 8])
def test_gradcheck_at_outside_offsets(query_start):
    g = torch.Generator().manual_seed(1)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    q, k, v, rk, rv = t(1, 2, 3, 2), t(1, 2, 5, 2), t(1, 2, 5, 2), t(1, 3, 2), t(1, 3, 2)

    def f(q, k, v, rk, rv):
        return _op(q, k, v, rk, rv, None, left=1, right=1, is_causal=False, scale=1.0,
                   query_start=query_start)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, rk, rv))


def _seed(*extra):
    return torch.tensor([1234567, 89101112, *extra], dtype=torch.int64)


def test_a_placed_piece_draws_the_whole_calls_dropout():
    """Queries [gq, gq + l) against keys [gk, gk + s) of a call over n positions, with the
    placement (n, gq, gk), keep exactly the whole call's mask there: the kernels' outputs
    and gradients equal the piece of the whole computation with that mask."""
    from relpos.ops.native.op import dropout_mask

    B, H, n, D, p = 2, 2, 12, 3, 0.4
    whole = dropout_mask(_seed(), (B, H, n, n), p)
    for gq, l, gk, s in [(0, 4, 0, 4), (4, 4, 0, 12), (8, 4, 4, 4), (3, 5, 7, 5)]:
        piece = dropout_mask(_seed(n, gq, gk), (B, H, l, s), p)
        assert torch.equal(piece, whole[:, :, gq:gq + l, gk:gk + s]), (gq, gk)
    assert 0.45 < whole.float().mean().item() < 0.75  # dropout really happens

    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, 4, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, H, 6, D, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    table = torch.randn(1, 5, D, generator=g, dtype=torch.float64, requires_grad=True)
    gq, gk = 5, 3
    options = dict(left=2, right=2, is_causal=False, scale=0.5, query_start=gq - gk)
    out, _ = _op(q, k, v, table, table, None, _seed(n, gq, gk), p, **options)
    keep = whole[:, :, gq:gq + 4, gk:gk + 6]
    pos = gq + torch.arange(4)[:, None]
    idx = (gk + torch.arange(6)[None, :] - pos).clamp(-2, 2) + 2
    s = (torch.einsum("bhld,bhsd->bhls", q, k)
         + torch.einsum("bhld,lsd->bhls", q, table[0][idx])) * 0.5
    probs = torch.softmax(s, -1) * keep / (1 - p)
    want = probs @ v + torch.einsum("bhls,lsd->bhld", probs, table[0][idx])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for got, exp in zip(torch.autograd.grad((out * w).sum(), (q, k, v, table)),
                        torch.autograd.grad((want * w).sum(), (q, k, v, table)), strict=True):
        torch.testing.assert_close(got, exp, rtol=0, atol=1e-11)


def test_a_seed_without_placement_is_unchanged():
    from relpos.ops.native.op import dropout_mask

    unplaced = dropout_mask(_seed(), (2, 3, 5, 7), 0.3)
    placed_as_itself = dropout_mask(_seed(5, 0, 0), (2, 3, 5, 7), 0.3)
    assert torch.equal(unplaced, placed_as_itself)


def test_bad_placements_are_refused():
    from relpos.ops.native.op import dropout_mask

    with pytest.raises(RuntimeError, match="two int64 \\(or five"):
        dropout_mask(_seed(5, 0), (1, 1, 2, 2), 0.3)
    with pytest.raises(RuntimeError, match=">= 0, got 5, -1, 0"):
        dropout_mask(_seed(5, -1, 0), (1, 1, 2, 2), 0.3)
    q = torch.randn(4, 1, 2, dtype=torch.float64)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    from relpos.ops.native import op

    with pytest.raises(RuntimeError, match="varlen call takes a dropout seed of two int64"):
        op.forward_varlen(q, q, q, None, None, cu.long(), cu.long(), None, _seed(4, 0, 0),
                          left=0, right=0, is_causal=False, scale=1.0, dropout_p=0.5)


def test_a_relative_cache_dir_is_made_absolute(monkeypatch, tmp_path):
    """The build runs in a child process with another working directory: a relative
    RELPOS_CACHE_DIR would point it elsewhere (its lock file was not found)."""
    from relpos.ops.native import build

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RELPOS_CACHE_DIR", "some/cache")
    assert build._cache_root() == tmp_path / "some" / "cache"
