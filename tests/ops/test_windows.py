"""Asymmetric clip windows ``max_distance=(left, right)``: offsets clipped to ``[-left, +right]``,
tables of ``left + right + 1`` rows. Every backend against the reference in float64, forward
and all five gradients, at awkward windows (one side 0, both 0, w2v-BERT's (64, 8), one side
wider than the sequence)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import relpos
from helpers import F64

WINDOWS = [(0, 0), (0, 5), (5, 0), (3, 1), (1, 3), (64, 8), (2, 40)]


def _problem(L, S, window, *, per_head=False, keys=True, values=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    left, right = window
    R = left + right + 1

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(True)

    lead = (3,) if per_head else ()
    return dict(query=rnd(2, 3, L, 4), key=rnd(2, 3, S, 4), value=rnd(2, 3, S, 4),
                rel_keys=rnd(*lead, R, 4) if keys else None,
                rel_values=rnd(*lead, R, 4) if values else None, max_distance=window)


def _leaves(p):
    return [t for t in (p["query"], p["key"], p["value"], p["rel_keys"], p["rel_values"])
            if t is not None]


def _check(p, implementation, **kw):
    out = relpos.relative_attention(**p, implementation=implementation, **kw)
    ref = relpos.relative_attention(**p, implementation="reference", **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    up = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, _leaves(p), up)
    want = torch.autograd.grad(ref, _leaves(p), up)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)
    with torch.no_grad():  # the decode backend's inference path
        fast = relpos.relative_attention(**p, implementation=implementation, **kw)
    torch.testing.assert_close(fast, ref.detach(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("implementation", ["bucketed", "flash_regions", "decode", "native"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
def test_window_matches_reference(implementation, window, causal):
    shapes = [(1, 9), (3, 9), (9, 9)] if implementation == "decode" else [(9, 9), (5, 11), (1, 9)]
    for (L, S), per_head, (keys, values) in itertools.product(
            shapes, (False, True), ((True, True), (True, False), (False, True))):
        _check(_problem(L, S, window, per_head=per_head, keys=keys, values=values),
               implementation, is_causal=causal)


@pytest.mark.parametrize("implementation", ["bucketed", "flash_regions", "decode", "native"])
@pytest.mark.parametrize("window", [(0, 5), (5, 0), (64, 8), (3, 1)])
def test_window_with_key_mask_and_query_start(implementation, window):
    p = _problem(4, 13, window, seed=3)
    key_mask = torch.ones(2, 13, dtype=torch.bool)
    key_mask[1, :5] = False
    _check(p, implementation, key_mask=key_mask, is_causal=True)
    if implementation != "decode":  # decode serves end-aligned queries only
        _check(p, implementation, key_mask=key_mask, query_start=3)


@pytest.mark.parametrize("implementation", ["bucketed", "flash_regions", "native"])
def test_window_gradcheck(implementation):
    p = _problem(5, 7, (2, 1))

    def f(q, k, v, ak, av):
        return relpos.relative_attention(q, k, v, max_distance=(2, 1), rel_keys=ak, rel_values=av,
                                         is_causal=False, implementation=implementation)

    assert torch.autograd.gradcheck(f, tuple(_leaves(p)))


def test_symmetric_window_equals_the_clip_distance():
    p = _problem(6, 9, (3, 3))
    as_pair = relpos.relative_attention(**p)
    p["max_distance"] = 3
    torch.testing.assert_close(relpos.relative_attention(**p), as_pair, rtol=0, atol=0)


@pytest.mark.parametrize("implementation", relpos.available_backends())
def test_window_wider_than_the_sequence_is_unclipped(implementation):
    # (20, 30) over 9 keys clips nothing: the same as (8, 8) with the matching middle rows.
    p = _problem(1 if implementation == "decode" else 9, 9, (20, 30))
    narrow = dict(p, max_distance=(8, 8), rel_keys=p["rel_keys"][12:29],
                  rel_values=p["rel_values"][12:29])
    torch.testing.assert_close(relpos.relative_attention(**p, implementation=implementation),
                               relpos.relative_attention(**narrow, implementation="reference"),
                               rtol=0, atol=1e-10)


def test_index_and_clip_agree_for_windows():
    for window in WINDOWS:
        for L, S, start in ((3, 8, None), (4, 9, 2), (6, 6, 0)):
            index = relpos.relative_position_index(L, S, window, query_start=start)
            first = S - L if start is None else start
            want = [[relpos.clip_relative_position(j, first + i, window) + window[0]
                     for j in range(S)] for i in range(L)]
            assert index.tolist() == want, (window, L, S, start)


@pytest.mark.parametrize("bad,error,fragment", [
    ((1, 2, 3), ValueError, "3 values"),
    ((-1, 2), ValueError, "left"),
    ((1, 2.5), TypeError, "right"),
    ("(1, 2)", TypeError, "pair"),
])
def test_bad_windows_are_refused(bad, error, fragment):
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(error, match=fragment):
        relpos.relative_attention(q, q, q, max_distance=bad)


def test_table_rows_must_match_the_window():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match=r"max_distance=\(64, 8\) needs left \+ right \+ 1 = 73"):
        relpos.relative_attention(q, q, q, max_distance=(64, 8), rel_keys=torch.randn(129, 4))


def test_window_compiles_at_most_twice_for_twelve_lengths():
    torch._dynamo.reset()
    table = torch.randn(12, 8, dtype=F64)

    def attend(q):
        return relpos.relative_attention(q, q, q, max_distance=(8, 3), rel_keys=table,
                                         implementation="flash_regions")

    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(attend, fullgraph=True, backend=counter)
    for n in (12, 15, 19, 23, 28, 31, 36, 40, 47, 52, 60, 70):
        q = torch.randn(1, 2, n, 8, dtype=F64)
        torch.testing.assert_close(compiled(q), attend(q), rtol=0, atol=1e-12)
    assert counter.frame_count <= 2, counter.frame_count
    torch._dynamo.reset()
