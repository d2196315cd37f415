"""Property test: a random valid call (shapes, windows, scales, masks, dtypes, layouts, which
terms) gives the reference's output in every backend that serves it, and in float64 its
gradients too. Backends come from :func:`relpos.available_backends`, so a backend added later
is covered as soon as it serves a call; one that refuses a call is skipped for that call."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relpos
from helpers import serving_backends

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
SCALES = [None, 0.3, 1.0, -0.7, 0.0, -0.0, 1e-12, 25.0]


def _layout(draw: st.DrawFn, x: torch.Tensor) -> torch.Tensor:
    """``x`` (B, H, N, X) as a contiguous tensor, a transposed view or a strided slice."""
    kind = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    if kind == "transposed":  # stored (B, N, H, X)
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "sliced":  # every other element of a wider last dim
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x


@st.composite
def valid_calls(draw: st.DrawFn) -> dict:
    dtype = draw(st.sampled_from([torch.float64, torch.float64, torch.float32]))
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    S = draw(st.integers(1, 24))
    L = draw(st.sampled_from([S, draw(st.integers(1, S))]))
    D = draw(st.integers(1, 6))
    Dv = draw(st.sampled_from([D, D, draw(st.integers(1, 6))]))
    if draw(st.booleans()):
        window: int | tuple[int, int] = draw(st.integers(0, 8))
        R = 2 * window + 1
    else:
        window = (draw(st.integers(0, 8)), draw(st.integers(0, 8)))
        R = window[0] + window[1] + 1
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    def table(width: int) -> torch.Tensor | None:
        kind = draw(st.sampled_from(["none", "shared", "per_head"]))
        return None if kind == "none" else rnd(H, R, width) if kind == "per_head" else rnd(R, width)

    rel_keys, rel_values = table(D), table(Dv)
    is_causal = draw(st.booleans())
    query_start = None
    if draw(st.integers(0, 3)) == 0:
        query_start = draw(st.integers(0, S - L))
    key_mask = None
    if draw(st.booleans()):
        key_mask = torch.rand(B, S, generator=g) > draw(st.sampled_from([0.2, 0.6]))
    attn_mask = None
    mask_kind = draw(st.sampled_from(["none", "none", "bool", "float"]))
    if mask_kind == "bool":
        attn_mask = torch.rand(L, S, generator=g) > 0.3
    elif mask_kind == "float":
        attn_mask = rnd(L, S).masked_fill(torch.rand(L, S, generator=g) < 0.3, -math.inf)
    return dict(
        query=_layout(draw, rnd(B, H, L, D)), key=_layout(draw, rnd(B, H, S, D)),
        value=_layout(draw, rnd(B, H, S, Dv)), max_distance=window, rel_keys=rel_keys,
        rel_values=rel_values, attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal,
        scale=draw(st.sampled_from(SCALES)), query_start=query_start,
    )


def _leaves(call: dict) -> list[str]:
    return [n for n in ("query", "key", "value", "rel_keys", "rel_values")
            if call[n] is not None]


def _prepared(call: dict, grad: bool) -> dict:
    """``call`` with query, key, value and the tables requiring grad (or not)."""
    return {k: v.detach().requires_grad_(grad) if k in _leaves(call) else v
            for k, v in call.items()}


def _run(call: dict, implementation: str, grad: bool) -> list[torch.Tensor]:
    """Output (and, with ``grad``, the gradients of query, key, value and the tables for a
    fixed upstream gradient), in float64."""
    call = _prepared(call, grad)
    out = relpos.relative_attention(**call, implementation=implementation)
    results = [out.detach().double()]
    if grad:
        upstream = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
        grads = torch.autograd.grad(out, [call[n] for n in _leaves(call)], upstream,
                                    allow_unused=True)
        results += [torch.zeros(call[n].shape, dtype=torch.float64) if g is None
                    else g.double() for n, g in zip(_leaves(call), grads, strict=True)]
    return results


@settings(max_examples=70, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(call=valid_calls())
def test_every_serving_backend_equals_the_reference(call):
    grad = call["query"].dtype == torch.float64
    want = _run(call, "reference", grad)
    tol = TOLERANCE[call["query"].dtype] * max(1.0, abs(call["scale"] or 1.0))
    for name in serving_backends(**_prepared(call, grad)):  # as the call will run
        if name == "reference":
            continue
        got = _run(call, name, grad)
        for what, a, b in zip(["out", *_leaves(call)], got, want, strict=False):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True,
                                       msg=lambda m, n=name, w=what: f"{n}, {w}: {m}")


def test_the_strategy_reaches_every_backend():
    """Not vacuous: the calls drawn are served by every backend that exists now."""
    served: set[str] = set()

    @settings(max_examples=40, deadline=None, derandomize=True, database=None)
    @given(call=valid_calls())
    def probe(call):
        served.update(serving_backends(**call))

    probe()
    assert served >= {"reference", "bucketed", "flash_regions", "decode"}, served
