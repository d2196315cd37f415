"""``torch.use_deterministic_algorithms(True)``: every backend and module runs, and repeated
runs give bitwise identical outputs and gradients."""

from __future__ import annotations

import pytest
import torch

import relpos

IMPLEMENTATIONS = ("reference", "bucketed", "flash_regions", "native")


@pytest.fixture(autouse=True)
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn_only)


def _fwd_bwd(implementation: str, dtype: torch.dtype, causal: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    B, H, L, S, D, K = 2, 3, 150, 203, 16, 5

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)

    q, k, v = leaf(B, H, L, D), leaf(B, H, S, D), leaf(B, H, S, D)
    rk, rv = leaf(H, 2 * K + 1, D), leaf(2 * K + 1, D)
    key_mask = torch.rand(B, S, generator=g) > 0.2
    out = relpos.relative_attention(
        q, k, v, max_distance=K, rel_keys=rk, rel_values=rv, key_mask=key_mask,
        is_causal=causal, implementation=implementation,
    )
    out.backward(torch.randn(out.shape, generator=g).to(dtype))
    return [out.detach()] + [t.grad for t in (q, k, v, rk, rv)]  # type: ignore[misc]


CASES = [
    (impl, dtype, causal)
    for impl in IMPLEMENTATIONS
    for dtype in (torch.float32, torch.bfloat16)
    for causal in (False, True)
    if not (impl == "reference" and dtype == torch.bfloat16)  # slow, and only the definition
]


@pytest.mark.parametrize(
    ("implementation", "dtype", "causal"), CASES,
    ids=[f"{i}-{str(d).split('.')[-1]}-{'causal' if c else 'full'}" for i, d, c in CASES],
)
def test_backend_bitwise_reproducible(implementation, dtype, causal):
    first = _fwd_bwd(implementation, dtype, causal)
    second = _fwd_bwd(implementation, dtype, causal)
    names = ("out", "dq", "dk", "dv", "drel_keys", "drel_values")
    for name, a, b in zip(names, first, second, strict=True):
        assert torch.equal(a, b), f"{implementation} {name} differs between two runs"


@pytest.mark.parametrize("implementation", [None, *IMPLEMENTATIONS])
def test_layers_train_step_reproducible(implementation):
    def step() -> list[torch.Tensor]:
        torch.manual_seed(0)
        # flash_regions has no attention dropout
        dropout = 0.0 if implementation == "flash_regions" else 0.1
        enc = relpos.RelativeTransformerEncoderLayer(
            16, 2, 32, dropout=dropout, batch_first=True, max_distance=3,
            implementation=implementation,
        )
        dec = relpos.RelativeTransformerDecoderLayer(
            16, 2, 32, dropout=dropout, batch_first=True, max_distance=3,
            implementation=implementation,
        )
        src, tgt = torch.randn(3, 17, 16), torch.randn(3, 9, 16)
        pad = torch.zeros(3, 17, dtype=torch.bool)
        pad[0, -4:] = True
        memory = enc(src, src_key_padding_mask=pad)
        out = dec(tgt, memory, tgt_is_causal=True, memory_key_padding_mask=pad)
        out.square().mean().backward()
        params = [*enc.parameters(), *dec.parameters()]
        return [out.detach()] + [p.grad for p in params if p.grad is not None]

    first, second = step(), step()
    assert len(first) == len(second) > 10
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
