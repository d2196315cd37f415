"""Every backend gives the reference's numbers whatever the memory layout of its inputs:
transposed (last dimension strided), expanded (stride 0) and sliced tensors, forward with and
without autograd (the decode backend's inference path calls the flash kernel) and backward."""

from __future__ import annotations

import pytest
import torch

import relpos
from helpers import F64

LAYOUTS = ("transposed", "expanded", "sliced")


def _laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` (B, H, N, X) with the same values in another memory layout."""
    if layout == "transposed":  # last dimension strided
        return x.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_(True)
    if layout == "expanded":  # one head's rows shared by all heads (stride 0)
        return x.detach()[:, :1].requires_grad_(True).expand_as(x)
    # every other row of a twice-as-long tensor
    big = torch.zeros(*x.shape[:2], 2 * x.shape[2], x.shape[3], dtype=x.dtype)
    big[:, :, ::2] = x.detach()
    return big.requires_grad_(True)[:, :, ::2]


def _problem(L: int, S: int, layout: str, K: int = 3) -> dict[str, torch.Tensor | int]:
    g = torch.Generator().manual_seed(L * 100 + S)
    D = 8

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=F64)

    q, k, v = rnd(2, 3, L, D), rnd(2, 3, S, D), rnd(2, 3, S, D)
    table = rnd(2 * K + 1, 2 * D)
    return dict(
        query=_laid_out(q, layout), key=_laid_out(k, layout), value=_laid_out(v, layout),
        rel_keys=table[:, ::2], rel_values=table[:, 1::2].t().contiguous().t(), max_distance=K,
    )


def _plain(p: dict) -> dict:
    """The same problem with contiguous leaves of their own."""
    return {n: (t.detach().contiguous().requires_grad_(True) if isinstance(t, torch.Tensor)
                else t) for n, t in p.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("implementation", relpos.available_backends())
@pytest.mark.parametrize(("L", "S"), [(1, 20), (4, 20), (13, 13)])
def test_every_backend_is_exact_on_strided_inputs(implementation, layout, L, S):
    p = _problem(L, S, layout)
    assert relpos.select_backend(**p, is_causal=True, implementation=implementation)
    ref = _plain(p)
    truth = relpos.relative_attention(**ref, is_causal=True, implementation="reference")
    with torch.no_grad():
        inference = relpos.relative_attention(**p, is_causal=True, implementation=implementation)
    torch.testing.assert_close(inference, truth.detach(), rtol=0, atol=1e-12)
    out = relpos.relative_attention(**p, is_causal=True, implementation=implementation)
    torch.testing.assert_close(out, truth, rtol=0, atol=1e-12)
    upstream = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    leaves = ["query", "key", "value"]  # views in the graph: gradients w.r.t. them
    grads = torch.autograd.grad(out, [p[n] for n in leaves], upstream)
    want = torch.autograd.grad(truth, [ref[n] for n in leaves], upstream)
    for name, g, w in zip(leaves, grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
