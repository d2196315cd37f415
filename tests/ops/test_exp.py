"""``relpos.ops._numerics.exp_``: the exponential the fused and decode backends use."""

import math

import pytest
import torch

from relpos.ops._numerics import exp_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_matches_torch_exp_over_the_whole_range(dtype):
    finfo = torch.finfo(dtype)
    x = torch.cat([
        torch.linspace(-120.0, 80.0, 20001, dtype=dtype),
        torch.tensor([0.0, -0.0, finfo.min, -1e4, -745.2, -88.8, math.inf, -math.inf],
                     dtype=dtype),
    ])
    got, want = exp_(x.clone()), torch.exp(x)
    assert got.dtype == dtype
    # relative error of one rounded product: |x| * log2(e) * eps / 2 in the exponent
    fin = x.isfinite() & want.isfinite()
    rel = (x.abs() * 1.5 + 2) * finfo.eps
    bound = torch.where(want > 0, rel * want, 0) + finfo.tiny
    assert torch.all((got - want)[fin].abs() <= bound[fin])
    assert got[x == 0].eq(1).all()
    assert got[x == -math.inf].eq(0).all() and got[x == math.inf].eq(math.inf).all()
    # as probabilities (x <= 0): absolute error below one ulp of 1
    neg = x <= 0
    assert (got[neg] - want[neg]).abs().max() <= finfo.eps


def test_exp_propagates_nan_and_works_in_place():
    x = torch.tensor([math.nan, 1.0, -math.inf])
    out = exp_(x)
    assert out.data_ptr() == x.data_ptr()
    assert math.isnan(out[0]) and out[1] == pytest.approx(math.e, rel=1e-6) and out[2] == 0
