"""Property test: any call either raises a clear error or returns a finite result that equals
the float64 reference."""

from __future__ import annotations

import contextlib
import importlib

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relpos

TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 6e-2}


@st.composite
def calls(draw: st.DrawFn) -> dict:
    implementation = draw(
        st.sampled_from([None, "reference", "bucketed", "flash_regions", "native"]))
    # Mostly calls the flash_regions backend serves (no dense mask, Dv == D), so it gets exercised.
    regions_friendly = implementation == "flash_regions" and draw(st.integers(0, 3)) > 0
    dtype = draw(st.sampled_from(list(TOLERANCE)))
    B, H = draw(st.integers(0, 2)), draw(st.integers(1, 3))
    S = draw(st.integers(0, 10))
    L = draw(st.integers(0, 10)) if draw(st.booleans()) else draw(st.integers(0, S))
    D = draw(st.integers(1, 5))
    Dv = D if regions_friendly else draw(st.sampled_from([D, D, D, draw(st.integers(1, 5))]))
    K = draw(st.integers(0, 6))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    def table(width: int) -> torch.Tensor | None:
        kind = draw(st.sampled_from(["none", "shared", "shared", "per_head", "wrong_rows"]))
        if kind == "none":
            return None
        rows = 2 * K + 1 if kind != "wrong_rows" else 2 * K + 2
        return rnd(H, rows, width) if kind == "per_head" else rnd(rows, width)

    attn_mask = None
    mask_kind = "none" if regions_friendly else draw(
        st.sampled_from(["none", "none", "none", "bool", "float", "bool_heads"])
    )
    if mask_kind == "bool":
        attn_mask = torch.rand(L, S, generator=g) > 0.3
    elif mask_kind == "bool_heads":
        attn_mask = torch.rand(B, H, 1, S, generator=g) > 0.3
    elif mask_kind == "float":
        attn_mask = rnd(L, S).masked_fill(torch.rand(L, S, generator=g) < 0.3, float("-inf"))
    key_mask = torch.rand(B, S, generator=g) > 0.25 if draw(st.booleans()) else None
    query_start = None
    if draw(st.integers(0, 3)) == 0:  # mostly valid, sometimes one off either end
        query_start = draw(st.integers(-1, max(0, S - L) + 1))
    return dict(
        query=rnd(B, H, L, D), key=rnd(B, H, S, D), value=rnd(B, H, S, Dv), max_distance=K,
        rel_keys=table(D), rel_values=table(Dv), attn_mask=attn_mask, key_mask=key_mask,
        is_causal=draw(st.booleans()), scale=draw(st.sampled_from([None, 0.3, 1.0])),
        query_start=query_start,
        implementation=implementation,
    )


def _as_f64(t: object) -> object:
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


@settings(
    max_examples=150, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(call=calls())
def test_clear_error_or_finite_reference_equal_result(call):
    try:
        out = relpos.relative_attention(**call)
    except (TypeError, ValueError) as err:
        assert str(err), "an error must say what is wrong"
        return
    except RuntimeError as err:  # only a named backend that cannot serve the call
        assert call["implementation"] is not None and "cannot serve this call" in str(err)
        return
    B, H, L, _ = call["query"].shape
    assert out.shape == (B, H, L, call["value"].shape[-1])
    assert out.dtype == call["query"].dtype
    assert out.isfinite().all()
    truth_args = {k: _as_f64(v) for k, v in call.items() if k != "implementation"}
    truth = relpos.relative_attention(**truth_args, implementation="reference")
    tol = TOLERANCE[call["query"].dtype]
    torch.testing.assert_close(out.double(), truth, rtol=tol, atol=tol)


def test_fuzz_reaches_every_backend(monkeypatch):
    """The strategy is not vacuous: every backend serves some drawn calls."""
    served: set[str] = set()
    for name in ("reference", "bucketed", "flash_regions", "native"):
        backend = importlib.import_module(f"relpos.ops.{name}")
        original = backend.attention

        def spy(*args, _name=name, _original=original, **kwargs):
            served.add(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(backend, "attention", spy)

    @settings(max_examples=80, deadline=None, derandomize=True)
    @given(call=calls())
    def probe(call):
        with contextlib.suppress(TypeError, ValueError, RuntimeError):
            relpos.relative_attention(**call)

    probe()
    assert served == {"reference", "bucketed", "flash_regions", "native"}, served
