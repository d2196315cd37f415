"""``relpos.explain_backends``: every backend's reason, in auto-selection order, agreeing with
``select_backend``; ``why_not_fused`` is its deprecated alias."""

from __future__ import annotations

import pytest
import torch

import relpos
from helpers import make_problem
from relpos.ops import BACKENDS, flash_regions


def _calls() -> dict[str, dict[str, object]]:
    """Calls that different backends serve (keyword arguments of relative_attention)."""
    p = make_problem(B=2, H=2, L=6, S=6, D=4, K=2)
    base = dict(query=p.query, key=p.key, value=p.value, max_distance=2, rel_keys=p.rel_keys,
                rel_values=p.rel_values)
    step = make_problem(B=1, H=2, L=2, S=40, D=4, K=3)
    long = make_problem(B=1, H=1, L=flash_regions.CROSSOVER_KEYS, D=2, K=2, dtype=torch.float32)
    key_mask = torch.ones(2, 6, dtype=torch.bool)
    key_mask[0, :2] = False
    float_mask = torch.zeros(6, 6, dtype=torch.float64)
    float_mask[1, 3] = float("-inf")
    return {
        "plain": base,
        "causal": {**base, "is_causal": True},
        "key_mask": {**base, "key_mask": key_mask},
        "bool_mask": {**base, "attn_mask": torch.rand(6, 6) > 0.3},
        "float_mask": {**base, "attn_mask": float_mask},
        "dropout": {**base, "dropout_p": 0.1},
        "float32": {**base, **{k: base[k].detach().float() for k in  # type: ignore[union-attr]
                               ("query", "key", "value", "rel_keys", "rel_values")}},
        "values_only": {**base, "rel_keys": None},
        "cache_step": dict(query=step.query, key=step.key, value=step.value, max_distance=3,
                           rel_keys=step.rel_keys, rel_values=step.rel_values, is_causal=True),
        "long": dict(query=long.query.detach(), key=long.key.detach(),
                     value=long.value.detach(), max_distance=2, rel_keys=long.rel_keys.detach(),
                     is_causal=True),
    }


CALLS = _calls()


@pytest.mark.parametrize("native", [True, False], ids=["native", "no_native"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_first_backend_without_a_reason_is_the_one_selected(
    name: str, native: bool, request: pytest.FixtureRequest
) -> None:
    if not native:
        request.getfixturevalue("no_native")
    call = CALLS[name]
    reasons = relpos.explain_backends(**call)  # type: ignore[arg-type]
    assert list(reasons) == list(BACKENDS)
    for backend, reason in reasons.items():
        assert reason is None or (isinstance(reason, str) and reason), (backend, reason)
    first = next(backend for backend, reason in reasons.items() if reason is None)
    assert relpos.select_backend(**call) == first  # type: ignore[arg-type]
    if not native:
        assert reasons["native"] is not None and "RELPOS_NATIVE=0" in reasons["native"]


def test_reasons_name_what_a_backend_lacks(no_native: None) -> None:
    reasons = relpos.explain_backends(**CALLS["dropout"])  # type: ignore[arg-type]
    assert "dropout" in str(reasons["flash_regions"])
    assert "CUDA tensors only" in str(reasons["triton"])
    assert reasons["bucketed"] is None and reasons["reference"] is None
    reasons = relpos.explain_backends(**CALLS["long"])  # type: ignore[arg-type]
    assert reasons["flash_regions"] is None
    assert "not a cache step" in str(reasons["decode"])
    assert relpos.select_backend(**CALLS["long"]) == "flash_regions"  # type: ignore[arg-type]


def test_a_named_implementation_is_the_only_candidate() -> None:
    call = CALLS["plain"]
    reasons = relpos.explain_backends(**call, implementation="bucketed")  # type: ignore[arg-type]
    assert reasons["bucketed"] is None
    assert all(reason == "implementation='bucketed' was asked for"
               for backend, reason in reasons.items() if backend != "bucketed")
    refused = relpos.explain_backends(**CALLS["dropout"], implementation="flash_regions")  # type: ignore[arg-type]
    assert all(reason is not None for reason in refused.values())
    with pytest.raises(RuntimeError, match="no attention dropout"):
        relpos.select_backend(**CALLS["dropout"], implementation="flash_regions")  # type: ignore[arg-type]
    assert "no attention dropout" in str(refused["flash_regions"])


def test_bad_arguments_are_refused_as_by_relative_attention() -> None:
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="max_distance"):
        relpos.explain_backends(q, q, q, max_distance=-1)


def test_why_not_fused_is_a_deprecated_alias(no_native: None) -> None:
    for name in ("plain", "dropout", "long", "cache_step"):
        call = CALLS[name]
        with pytest.warns(DeprecationWarning, match="why_not_fused is deprecated; use "
                          "relpos.explain_backends"):
            reason = relpos.why_not_fused(**call)  # type: ignore[arg-type]
        selected = relpos.select_backend(**call)  # type: ignore[arg-type]
        assert (reason is None) == (selected == "flash_regions"), (name, reason, selected)
        if reason is not None and BACKENDS.index(selected) > BACKENDS.index("flash_regions"):
            assert reason == relpos.explain_backends(**call)["flash_regions"]  # type: ignore[arg-type]
    with pytest.warns(DeprecationWarning):
        asked = relpos.why_not_fused(**CALLS["plain"], implementation="bucketed")  # type: ignore[arg-type]
    assert asked == "implementation='bucketed' was asked for"


def test_the_facade_exports_it() -> None:
    assert "explain_backends" in relpos.__all__
    assert relpos.explain_backends is relpos.functional.explain_backends
