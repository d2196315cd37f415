"""What a call keeps for its backward: the flash-style backends save their inputs, ``out`` and
the logsumexp and nothing of size L x R or L x S (``torch.autograd.graph.saved_tensors_hooks``
sees every tensor autograd keeps).

Shape legend: B batch, H heads, L queries, S keys, D head dim, R = 2K + 1 table rows.
"""

from __future__ import annotations

import pytest
import torch

import relpos
from relpos.ops.native import build

B, H, L, D, K = 2, 2, 40, 8, 8  # R = 17 > D: an (L, R) tensor is larger than out
R = 2 * K + 1


def _saved(fn):
    """The tensors autograd saves while ``fn()`` runs, and ``fn()``'s result."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


def _inputs(dtype=torch.float32, **shape):
    g = torch.Generator().manual_seed(0)
    b, h, n = shape.get("B", B), shape.get("H", H), shape.get("L", L)
    q, k, v = (torch.randn(b, h, n, D, generator=g, dtype=dtype, requires_grad=True)
               for _ in range(3))
    tables = (torch.randn(R, D, generator=g, dtype=dtype, requires_grad=True),
              torch.randn(R, D, generator=g, dtype=dtype, requires_grad=True))
    return q, k, v, tables


def _nbytes(ts) -> int:
    """Bytes of the distinct storages behind ``ts`` (a view of an input costs nothing more)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}
    return sum(storages.values())


def _check_flash_style(saved, inputs, out):
    lse_bytes = out.shape[0] * out.shape[1] * out.shape[2] * 4  # float32 logsumexp
    limit = _nbytes(inputs) + out.numel() * out.element_size() + lse_bytes
    assert _nbytes(saved) <= limit, [tuple(t.shape) for t in saved]
    big = [tuple(t.shape) for t in saved if t.numel() >= B * H * L * R
           and not any(t.data_ptr() == i.data_ptr() for i in inputs)]
    assert not big, f"saved tensors of size L x R or larger: {big}"


@pytest.mark.parametrize("is_causal", [False, True])
def test_native_saves_inputs_out_and_lse_only(is_causal):
    if build.load() is None:
        pytest.skip("the native kernels are not available here")
    q, k, v, (rk, rv) = _inputs()
    saved, out = _saved(lambda: relpos.relative_attention(
        q, k, v, max_distance=K, rel_keys=rk, rel_values=rv, is_causal=is_causal,
        implementation="native"))
    _check_flash_style(saved, (q, k, v, rk, rv), out)
    out.sum().backward()  # the saved tensors serve the backward


def test_native_packed_saves_inputs_out_and_lse_only():
    if build.load() is None:
        pytest.skip("the native kernels are not available here")
    q, k, v, (rk, rv) = _inputs(B=1, H=H, L=3 * L)
    qp, kp, vp = (t[0].transpose(0, 1) for t in (q, k, v))  # (T, H, D) views
    cu = relpos.cu_seqlens_from_lengths([L, L // 2, L + L // 2])
    saved, out = _saved(lambda: relpos.relative_attention_varlen(
        qp, kp, vp, cu, cu, max_distance=K, rel_keys=rk, rel_values=rv,
        implementation="native"))
    lse_bytes = out.shape[0] * out.shape[1] * 4
    limit = _nbytes((q, k, v, rk, rv)) + out.numel() * out.element_size() + lse_bytes
    floating = [t for t in saved if t.is_floating_point()]  # and the (N + 1,) boundaries
    assert _nbytes(floating) <= limit, [tuple(t.shape) for t in saved]
    assert all(t.numel() <= 4 for t in saved if not t.is_floating_point())
    assert not [t for t in saved if t.numel() >= 3 * L * H * R and t.data_ptr() not in
                {i.data_ptr() for i in (q, k, v)}]


def test_the_check_catches_a_backend_that_keeps_its_scores():
    """The bucketed backend keeps the (L, S) probabilities (it does not claim flash-style
    memory): the check above must see that."""
    q, k, v, (rk, rv) = _inputs()
    saved, out = _saved(lambda: relpos.relative_attention(
        q, k, v, max_distance=K, rel_keys=rk, rel_values=rv, implementation="bucketed"))
    with pytest.raises(AssertionError):
        _check_flash_style(saved, (q, k, v, rk, rv), out)
