"""The flash_regions backend against the reference: forward, all five gradients, masks, dtypes."""

from __future__ import annotations

import pytest
import torch

import relpos
from helpers import F64, assert_same_as_reference, forward_backward, make_problem, run
from relpos.functional import AttentionCall, validate_call
from relpos.ops import _flash, flash_regions
from relpos.ops.flash_regions import band, far

# ----------------------------------------------------------------------------------------------
# Internal torch ops: fail loudly when a torch release changes them.


@pytest.mark.parametrize("name", sorted(_flash.EXPECTED_SCHEMAS))
def test_internal_op_schema_unchanged(name: str) -> None:
    op = getattr(torch.ops.aten, name, None)
    assert op is not None, (
        f"torch {torch.__version__} has no aten::{name}; the flash_regions and decode backends "
        "(relpos/ops/_flash.py) need porting to this torch version"
    )
    got = str(op.default._schema)
    want = _flash.EXPECTED_SCHEMAS[name]
    assert got == want, (
        f"the schema of aten::{name} changed in torch {torch.__version__}; relpos/ops/_flash.py "
        f"was written against\n  {want}\nbut this torch has\n  {got}\n"
        "check relpos/ops/_flash.py before updating EXPECTED_SCHEMAS"
    )


# ----------------------------------------------------------------------------------------------
# Exactness (float64, forward and every gradient)


CASES = [
    # (B, H, L, S, K, extra) -- odd sizes, n < K, n = K, n = K + 1, L != S, L = 1, K = 0
    dict(L=7, K=2),
    dict(L=7, K=0),
    dict(L=7, K=1),
    dict(L=3, K=5),  # n < K
    dict(L=5, K=5),  # n = K
    dict(L=6, K=5),  # n = K + 1
    dict(L=9, K=8),  # K = n - 1
    dict(L=3, S=11, K=2),  # KV-cache step: L < S, bottom-right aligned
    dict(L=1, S=13, K=3),
    dict(L=1, S=13, K=0),
    dict(L=4, S=11, K=2, query_start=3),
    dict(L=4, S=11, K=3, query_start=0),
    dict(L=70, K=6, B=1, H=2),  # several tiles (last one partial)
    dict(L=67, S=140, K=9, B=1, H=2),
]


def _split(case: dict) -> tuple[dict, dict]:
    case = dict(case)
    extra = {k: case.pop(k) for k in ("query_start",) if k in case}
    return case, extra


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_matches_reference(case: dict, causal: bool) -> None:
    shape, extra = _split(case)
    problem = make_problem(**shape)
    assert_same_as_reference(problem, "flash_regions", is_causal=causal, **extra)


@pytest.mark.parametrize("keys_term,values_term", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("causal", [False, True])
def test_each_term_off(keys_term: bool, values_term: bool, causal: bool) -> None:
    problem = make_problem(L=9, K=3, keys_term=keys_term, values_term=values_term)
    assert_same_as_reference(problem, "flash_regions", is_causal=causal)


@pytest.mark.parametrize("K", [0, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_per_head_tables(K: int, causal: bool) -> None:
    problem = make_problem(L=10, S=13, K=K, per_head=True)
    assert_same_as_reference(problem, "flash_regions", is_causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("K", [0, 1, 3])
def test_key_mask(causal: bool, K: int) -> None:
    # Per-row key lengths (prefix masks) and an irregular pattern, one row fully masked.
    key_mask = torch.tensor([
        [True] * 11,
        [True] * 6 + [False] * 5,
        [True, False, True, True, False, False, True, True, False, True, True],
        [False] * 11,
    ])
    problem = make_problem(B=4, H=2, L=8, S=11, K=K)
    assert_same_as_reference(problem, "flash_regions", key_mask=key_mask, is_causal=causal)


def test_fully_masked_rows_give_zeros_and_finite_grads() -> None:
    problem = make_problem(B=2, H=2, L=6, K=2)
    key_mask = torch.tensor([[True] * 6, [False] * 6])
    out, grads = forward_backward(problem, "flash_regions", key_mask=key_mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for g in grads:
        assert torch.isfinite(g).all()
    dq = grads[0]
    assert torch.equal(dq[1], torch.zeros_like(dq[1]))


@pytest.mark.parametrize("per_head", [False, True])
def test_band_chunking_paths(monkeypatch: pytest.MonkeyPatch, per_head: bool) -> None:
    # Small tiles and chunks: several heads per chunk, and a single head split into tile ranges.
    monkeypatch.setattr(band, "TILE", 8)
    monkeypatch.setattr(far, "FAR_BLOCK", 7)  # several far blocks
    monkeypatch.setattr(far, "FAR_KEY_ELEMS", 1)  # key ranges of one block
    for chunk in (8 * 16, 8 * 40, 8 * 12 * 3):  # forward chunks are 4x these
        monkeypatch.setattr(band, "CHUNK_ELEMS", chunk)
        problem = make_problem(B=2, H=3, L=45, S=50, K=3, per_head=per_head)
        key_mask = torch.ones(2, 50, dtype=torch.bool)
        key_mask[1, 37:] = False
        assert_same_as_reference(problem, "flash_regions", key_mask=key_mask)
        assert_same_as_reference(problem, "flash_regions", is_causal=True)


@pytest.mark.parametrize("block", [1, 3, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_far_region_blocks(monkeypatch: pytest.MonkeyPatch, block: int, causal: bool) -> None:
    # Far regions block by block (non-causal prefixes cut into key ranges of one block, causal
    # pieces of far-right on reversed copies), with padding that empties whole far rows.
    monkeypatch.setattr(far, "FAR_BLOCK", block)
    monkeypatch.setattr(far, "FAR_KEY_ELEMS", 1)
    key_mask = torch.ones(3, 23, dtype=torch.bool)
    key_mask[1, 15:] = False
    key_mask[2, :9] = False
    for case in (dict(L=23, K=2), dict(L=23, K=0), dict(L=9, S=23, K=3, query_start=5),
                 dict(L=5, S=23, K=4)):
        shape, extra = _split(case)
        problem = make_problem(B=3, H=2, per_head=True, **shape)
        assert_same_as_reference(problem, "flash_regions", key_mask=key_mask, is_causal=causal,
                                 **extra)
        assert_same_as_reference(problem, "flash_regions", is_causal=causal, **extra)


def test_matches_plain_sdpa_with_zero_tables() -> None:
    problem = make_problem(L=20, K=3)
    with torch.no_grad():
        problem.rel_keys.zero_()  # type: ignore[union-attr]
        problem.rel_values.zero_()  # type: ignore[union-attr]
    out = run(problem, "flash_regions")
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        problem.query, problem.key, problem.value
    )
    torch.testing.assert_close(out, sdpa, atol=1e-12, rtol=0)


def test_gradcheck() -> None:
    for causal, S in ((False, 5), (True, 6)):
        problem = make_problem(B=1, H=1, L=4, S=S, D=2, K=1, seed=3)
        key_mask = torch.tensor([[True] * (S - 1) + [False]])

        def f(q, k, v, ak, av, causal=causal, key_mask=key_mask):  # type: ignore[no-untyped-def]
            return relpos.relative_attention(
                q, k, v, max_distance=1, rel_keys=ak, rel_values=av, is_causal=causal,
                key_mask=key_mask, implementation="flash_regions",
            )

        assert torch.autograd.gradcheck(f, tuple(problem.leaves()), fast_mode=True)


def test_backward_is_deterministic() -> None:
    problem = make_problem(B=2, H=3, L=150, K=9, D=8, dtype=torch.float32, per_head=True)
    _, first = forward_backward(problem, "flash_regions")
    _, second = forward_backward(problem, "flash_regions")
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_opcheck() -> None:
    problem = make_problem(B=1, H=2, L=9, S=11, D=4, K=2)
    q, k, v, ak, av = problem.leaves()
    key_mask = torch.tensor([[True] * 9 + [False] * 2])
    args = (q, k, v, ak[None], av[None], key_mask)
    options = dict(left=2, right=2, is_causal=False, scale=0.5, query_start=2)
    torch.library.opcheck(torch.ops.relpos.fused_attention.default, args, options)


# ----------------------------------------------------------------------------------------------
# Low precision: error at most 2x that of the reference in the same precision (+ epsilon).


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision(dtype: torch.dtype) -> None:
    shape = dict(B=1, H=2, L=140, K=6, D=16, seed=5)
    truth_out, truth_grads = forward_backward(make_problem(**shape), "reference")
    errors = {}
    for impl in ("reference", "flash_regions"):
        out, grads = forward_backward(make_problem(**shape, dtype=dtype), impl)
        errors[impl] = [(out.to(F64) - truth_out).abs().max().item()] + [
            (g.to(F64) - t).abs().max().item() for g, t in zip(grads, truth_grads, strict=True)
        ]
    for name, e_regions, e_ref in zip(
        ["out", "dq", "dk", "dv", "drel_keys", "drel_values"], errors["flash_regions"],
        errors["reference"], strict=True,
    ):
        assert e_regions <= 2 * e_ref + 1e-5, (
            f"{dtype} {name}: flash_regions {e_regions} vs reference {e_ref}")


# ----------------------------------------------------------------------------------------------
# Dispatch


def _args(problem: object, **kw: object) -> dict:
    p = problem
    return dict(query=p.query, key=p.key, value=p.value, max_distance=p.max_distance,  # type: ignore[attr-defined]
                rel_keys=p.rel_keys, rel_values=p.rel_values, **kw)  # type: ignore[attr-defined]


def _why_not_fused(**kw: object) -> str | None:
    return relpos.explain_backends(**kw)["flash_regions"]  # type: ignore[arg-type]


def test_why_not_fused_reasons(no_native: None) -> None:
    short = make_problem(B=1, H=1, L=8, K=2)
    reason = _why_not_fused(**_args(short))
    assert reason is not None and "below the flash_regions crossover" in reason and "S=8" in reason
    long = make_problem(B=1, H=1, L=flash_regions.CROSSOVER_KEYS, D=2, K=2)
    assert _why_not_fused(**_args(long)) is None
    assert "dropout" in str(_why_not_fused(**_args(long, dropout_p=0.1)))
    mask = torch.ones(flash_regions.CROSSOVER_KEYS, flash_regions.CROSSOVER_KEYS, dtype=torch.bool)
    assert "attn_mask" in str(_why_not_fused(**_args(long, attn_mask=mask)))
    other_dv = make_problem(B=1, H=1, L=flash_regions.CROSSOVER_KEYS, D=2, Dv=3, K=2)
    assert "Dv=3" in str(_why_not_fused(**_args(other_dv)))
    with pytest.warns(DeprecationWarning, match="use relpos.explain_backends"):
        assert relpos.why_not_fused(**_args(other_dv)) == _why_not_fused(**_args(other_dv))


def test_the_crossover_follows_the_table_for_each_pass_and_causality(no_native: None) -> None:
    for n in (200, 300, 600):
        p = make_problem(B=1, H=1, L=n, D=2, K=2)
        grad = {k: v.detach().requires_grad_() if isinstance(v, torch.Tensor) else v
                for k, v in _args(p).items()}
        for causal in (False, True):
            for backward in (False, True):
                crossover = flash_regions.CROSSOVER[(backward, causal)]
                with torch.set_grad_enabled(backward):
                    got = relpos.select_backend(**(grad if backward else _args(p)),
                                                is_causal=causal)
                assert (got == "flash_regions") == (n >= crossover), (n, causal, backward, got)
                if n < crossover:
                    reason = _why_not_fused(**(grad if backward else _args(p)),
                                            is_causal=causal)
                    assert reason is not None and f"S >= {crossover}" in reason
    assert max(flash_regions.CROSSOVER.values()) == flash_regions.CROSSOVER_KEYS


def test_explicit_fused_ignores_the_speed_threshold_but_not_hard_limits() -> None:
    short = make_problem(B=1, H=1, L=8, K=2)
    assert flash_regions.unsupported_reason(_validated(short)) is None
    run(short, "flash_regions")  # does not raise
    with pytest.raises(RuntimeError, match="dropout"):
        run(short, "flash_regions", dropout_p=0.5)


def _validated(problem: object) -> AttentionCall:
    return validate_call(**_args(problem))


def test_auto_picks_what_explain_backends_says(
    monkeypatch: pytest.MonkeyPatch, no_native: None
) -> None:
    import importlib

    calls: list[str] = []
    for name in relpos.available_backends():
        module = importlib.import_module(f"relpos.ops.{name}")
        real = module.attention

        def spy(*a: object, _real=real, _name=name, **kw: object) -> object:  # type: ignore[no-untyped-def]
            calls.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(module, "attention", spy)
    long = make_problem(B=1, H=1, L=flash_regions.CROSSOVER_KEYS, D=2, K=2)
    assert _why_not_fused(**_args(long)) is None
    run(long, None)
    assert calls == ["flash_regions"]
    calls.clear()
    short = make_problem(B=1, H=1, L=8, K=2)
    assert _why_not_fused(**_args(short)) is not None
    run(short, None)
    assert calls and calls[0] != "flash_regions"


# ----------------------------------------------------------------------------------------------
# The old name: implementation="fused" (a deprecated alias of "flash_regions")

_OLD = r"implementation='fused' is deprecated; use implementation='flash_regions'"


@pytest.mark.parametrize("causal", [False, True])
def test_the_old_name_warns_and_gives_the_same_numbers(causal: bool) -> None:
    problem = make_problem(B=2, H=2, L=9, S=11, D=4, K=3)
    out, grads = forward_backward(problem, "flash_regions", is_causal=causal)
    with pytest.warns(DeprecationWarning, match=_OLD):
        old_out, old_grads = forward_backward(problem, "fused", is_causal=causal)
    assert torch.equal(old_out, out)
    for old, new in zip(old_grads, grads, strict=True):
        assert torch.equal(old, new)


def test_the_old_name_warns_at_the_callers_line_and_selects_the_new_one() -> None:
    p = make_problem(B=1, H=1, L=5, D=4, K=2)
    with pytest.warns(DeprecationWarning, match=_OLD) as caught:
        name = relpos.select_backend(p.query, p.key, p.value, max_distance=2,
                                     implementation="fused")  # type: ignore[arg-type]
    assert name == "flash_regions"
    assert [w.filename for w in caught] == [__file__]  # this line, not relpos's


def test_listings_give_the_new_name_and_the_old_one_still_reads_its_reason(
        no_native: None) -> None:
    assert "flash_regions" in relpos.available_backends()
    assert "fused" not in relpos.available_backends()
    p = make_problem(B=1, H=1, L=5, D=4, K=2)
    reasons = relpos.explain_backends(p.query, p.key, p.value, max_distance=2, dropout_p=0.1)
    assert "fused" not in reasons and "flash_regions" in reasons
    with pytest.warns(DeprecationWarning, match="the backend name 'fused' is deprecated; use "
                                                "the backend name 'flash_regions'"):
        assert reasons["fused"] == reasons["flash_regions"] is not None
    with pytest.warns(DeprecationWarning):
        assert reasons.get("fused") == reasons["flash_regions"]
    assert reasons.get("nope", "default") == "default"
    with pytest.raises(KeyError):
        reasons["nope"]


def test_the_old_name_in_modules_and_packed_calls() -> None:
    with pytest.warns(DeprecationWarning, match=_OLD):
        mha = relpos.RelativeMultiheadAttention(8, 2, max_distance=2, implementation="fused")
    assert mha.implementation == "flash_regions"  # and so get_config() saves the new name
    q = torch.randn(7, 2, 4, dtype=F64)
    cu = torch.tensor([0, 3, 7])
    new = relpos.relative_attention_varlen(q, q, q, cu, cu, max_distance=2,
                                           implementation="flash_regions")
    with pytest.warns(DeprecationWarning, match=_OLD):
        old = relpos.relative_attention_varlen(q, q, q, cu, cu, max_distance=2,
                                               implementation="fused")  # type: ignore[arg-type]
    assert torch.equal(old, new)
    with pytest.raises(ValueError, match="unknown implementation 'Fused'"):
        relpos.relative_attention(q[None], q[None], q[None], max_distance=2,
                                  implementation="Fused")  # type: ignore[arg-type]


def test_the_old_package_path_serves_the_backend_and_its_modules() -> None:
    import importlib
    import sys

    for name in [n for n in sys.modules if n.startswith("relpos.ops.fused")]:
        del sys.modules[name]
    with pytest.warns(DeprecationWarning, match=r"relpos\.ops\.fused is deprecated; use "
                                                r"relpos\.ops\.flash_regions$"):
        old = importlib.import_module("relpos.ops.fused")
    assert old.CROSSOVER is flash_regions.CROSSOVER and old.attention is flash_regions.attention
    with pytest.warns(DeprecationWarning, match=r"relpos\.ops\.fused\.band is deprecated"):
        from relpos.ops.fused.band import BandLayout  # type: ignore[import-not-found]
    assert BandLayout is band.BandLayout


# ----------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU; python -m relpos.bench.cuda_check is the fuller check)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_matches_reference(causal: bool) -> None:
    problem = make_problem(B=2, H=2, L=70, S=75, D=16, K=5, dtype=torch.float32)
    for t in problem.leaves():
        t.data = t.data.cuda()
    out_ref, grads_ref = forward_backward(problem, "reference", is_causal=causal)
    out, grads = forward_backward(problem, "flash_regions", is_causal=causal)
    torch.testing.assert_close(out, out_ref, atol=2e-5, rtol=1e-4)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-3)


# ----------------------------------------------------------------------------------------------
# relpos bench (smoke test at tiny sizes)






