"""Every backend, every legal scale: positive, negative, zero, -0.0, tiny and huge, against the
reference in float64, forward and backward (the flash kernels apply their causal mask before
the scale, so a scale <= 0 needs care)."""

from __future__ import annotations

import pytest
import torch

import relpos
from helpers import F64, serving_backends

SCALES = [0.5, -0.5, 0.0, -0.0, 1e-300, -1e-300, 1e-12, -1e-12, 1e3, -1e3, 1e8, -1e8]
"""With a huge scale the gradients are ill-conditioned (an error of one ulp of a score, about
``eps * |scale|``, moves a probability by as much), so they are compared up to ``|scale|``
once and only up to 1e3; the outputs are compared at every scale."""


def _grads(fn, leaves, upstream):
    out = fn()
    return [out.detach(), *torch.autograd.grad(out, leaves, upstream)]


@pytest.mark.parametrize("scale", SCALES, ids=repr)
@pytest.mark.parametrize(("L", "S", "causal", "padded"), [
    (24, 24, False, False), (24, 24, True, True), (9, 24, False, True), (1, 24, True, False),
])
def test_every_backend_matches_the_reference_at_every_scale(scale, L, S, causal, padded):
    g = torch.Generator().manual_seed(0)
    K = 3
    q, k, v = (torch.randn(2, 2, n, 4, generator=g, dtype=F64, requires_grad=True)
               for n in (L, S, S))
    ak, av = (torch.randn(2 * K + 1, 4, generator=g, dtype=F64, requires_grad=True)
              for _ in range(2))
    key_mask = None
    if padded:
        key_mask = torch.ones(2, S, dtype=torch.bool)
        key_mask[1, S // 2 :] = False
    call = dict(query=q, key=k, value=v, max_distance=K, rel_keys=ak, rel_values=av,
                key_mask=key_mask, is_causal=causal, scale=scale)
    leaves = [q, k, v, ak, av]
    upstream = torch.randn(2, 2, L, 4, generator=g, dtype=F64)

    want = _grads(lambda: relpos.relative_attention(**call, implementation="reference"),
                  leaves, upstream)
    assert all(t.isfinite().all() for t in want)
    backends = serving_backends(**call)
    assert "flash_regions" in backends and "bucketed" in backends
    compared = 6 if abs(scale) <= 1e3 else 1
    for name in backends:
        got = _grads(lambda n=name: relpos.relative_attention(**call, implementation=n),
                     leaves, upstream)
        for what, a, b in list(zip(["out", "dq", "dk", "dv", "d rel_keys", "d rel_values"], got,
                                   want, strict=True))[:compared]:
            tol = 1e-9 * max(1.0, abs(scale)) if what != "out" else 1e-9
            torch.testing.assert_close(a, b, atol=tol, rtol=1e-9,
                                       msg=lambda m, n=name, w=what: f"{n} {w}: {m}")


@pytest.mark.parametrize("scale", [1e-50, -1e-50, 0.0, -2.0])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_scale_that_rounds_to_zero_or_is_negative(scale, causal):
    """A float32 kernel sees the scale in float32: 1e-50 is zero there."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    table = torch.randn(7, 8, generator=g)
    call = dict(query=q, key=k, value=v, max_distance=3, rel_keys=table, rel_values=table,
                is_causal=causal, scale=scale)
    want = relpos.relative_attention(**call, implementation="reference")
    for name in serving_backends(**call):
        out = relpos.relative_attention(**call, implementation=name)
        assert out.isfinite().all(), name
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
