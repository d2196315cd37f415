"""The triton backend's kernels under Triton's interpreter (CPU tensors), against the reference.

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before anything imports the kernels, in the
main process and in every pytest-xdist worker. The interpreter runs each program in Python, so
the sizes are small and most tests force 16 x 16 blocks (:data:`launch.FORCED`) so that a call
crosses many tiles: band and far tiles, partial blocks at both ends, causal limits.

Targets: float64 within 1e-10 of the float64 reference (the kernels keep float64 under the
interpreter); float32 (IEEE products, as on the GPU) within 1e-5; bfloat16 / float16 error at
most twice the reference backend's error in the same precision (+ 1e-5).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import relpos
from helpers import F64, forward_backward, make_problem

if importlib.util.find_spec("triton") is None and not os.environ.get("CI"):
    pytest.skip("triton is not installed (the dev extra has it on Linux; CI fails without it)",
                allow_module_level=True)

from relpos.ops.triton import configs, launch  # (imports triton)

NAMES = ("query", "key", "value", "rel_keys", "rel_values")


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(launch, "FORCED", launch.Blocks(16, 16))


def test_kernels_run_under_the_interpreter():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert launch.interpreted()


def _errors(problem, implementation, **kwargs) -> dict[str, float]:
    """Max abs error of the output and each gradient against the float64 reference."""
    truth = make_problem_like(problem, F64)
    out_ref, grads_ref = forward_backward(truth, "reference", **kwargs)
    out, grads = forward_backward(problem, implementation, **kwargs)
    names = [n for n, t in zip(NAMES, (problem.query, problem.key, problem.value,
                                       problem.rel_keys, problem.rel_values), strict=True)
             if t is not None]
    errors = {"out": (out.to(F64) - out_ref).abs().max().item()}
    for name, g, g_ref in zip(names, grads, grads_ref, strict=True):
        assert torch.isfinite(g).all(), name
        errors[name] = (g.to(F64) - g_ref).abs().max().item()
    return errors


def make_problem_like(problem, dtype):
    """The same values in another dtype, as fresh leaves."""
    copy = type(problem)(*(None if t is None else t.detach().to(dtype).requires_grad_(True)
                           for t in (problem.query, problem.key, problem.value,
                                     problem.rel_keys, problem.rel_values)),
                         problem.max_distance)
    return copy


CASES = {
    # name: (make_problem kwargs, relative_attention kwargs)
    "causal L<S": (dict(B=1, H=2, L=29, S=35, D=20, K=5, per_head=True), dict(is_causal=True)),
    "non-causal": (dict(B=1, H=2, L=41, S=41, D=8, K=4), dict()),
    "K=0": (dict(B=1, H=2, L=33, S=33, D=8, K=0), dict(is_causal=True)),
    "K=1": (dict(B=1, H=2, L=30, S=33, D=8, K=1), dict(query_start=0)),
    "K beyond n": (dict(B=1, H=1, L=20, S=20, D=8, K=30), dict()),
    "keys only": (dict(B=1, H=2, L=35, S=35, D=8, K=3, values_term=False), dict()),
    "values only": (dict(B=1, H=2, L=35, S=35, D=8, K=3, keys_term=False), dict(is_causal=True)),
    "no tables": (dict(B=1, H=2, L=35, S=35, D=8, K=3, keys_term=False, values_term=False),
                  dict(is_causal=True)),
    "decode t=1": (dict(B=2, H=2, L=1, S=50, D=8, K=6), dict(is_causal=True)),
    "decode t=5": (dict(B=2, H=2, L=5, S=50, D=8, K=6), dict(is_causal=True)),
    "query_start": (dict(B=1, H=2, L=20, S=48, D=8, K=4), dict(query_start=11, is_causal=True)),
    "Dv != D": (dict(B=1, H=2, L=30, S=30, D=8, Dv=24, K=3), dict()),
}


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("case", list(CASES))
def test_float64_matches_the_reference(case):
    shape, kwargs = CASES[case]
    errors = _errors(make_problem(**shape), "triton", **kwargs)
    assert max(errors.values()) < 1e-10, errors


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_key_mask_padding_and_empty_rows(causal):
    problem = make_problem(B=3, H=2, L=29, S=29, D=8, K=3, per_head=True, seed=3)
    key_mask = torch.ones(3, 29, dtype=torch.bool)
    key_mask[0, 21:] = False  # right padding (a shorter sequence)
    key_mask[1, :9] = False  # left padding: with causal, its first rows see no key
    key_mask[2, ::3] = False  # any pattern
    errors = _errors(problem, "triton", key_mask=key_mask, is_causal=causal)
    assert max(errors.values()) < 1e-10, errors
    out, grads = forward_backward(problem, "triton", key_mask=key_mask, is_causal=causal)
    if causal:  # batch 1, rows 0..8 see no key: zeros, and no gradient through them
        assert torch.equal(out[1, :, :9], torch.zeros_like(out[1, :, :9]))
        assert torch.equal(grads[0][1, :, :9], torch.zeros_like(grads[0][1, :, :9]))


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("window", [(5, 1), (0, 3), (2, 0),
                                    pytest.param((9, 4), marks=pytest.mark.slow)])
def test_windows(window):
    left, right = window
    g = torch.Generator().manual_seed(left * 10 + right)
    q, k, v = (torch.randn(1, 2, 34, 8, generator=g, dtype=F64, requires_grad=True)
               for _ in range(3))
    ak, av = (torch.randn(left + right + 1, 8, generator=g, dtype=F64, requires_grad=True)
              for _ in range(2))
    leaves = (q, k, v, ak, av)
    kw = dict(max_distance=window, rel_keys=ak, rel_values=av, is_causal=left > right)
    upstream = torch.randn(1, 2, 34, 8, generator=g, dtype=F64)
    results = []
    for impl in ("reference", "triton"):
        out = relpos.relative_attention(q, k, v, implementation=impl, **kw)
        results.append((out, torch.autograd.grad(out, leaves, upstream)))
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    for name, gr, want in zip(NAMES, grads, ref_grads, strict=True):
        torch.testing.assert_close(gr, want, rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_float32_within_1e5_of_the_float64_reference():
    """The table's own block sizes (64 x 32 forward tiles for float32), D = 64."""
    problem = make_problem(B=1, H=2, L=100, S=100, D=64, K=8, dtype=torch.float32, seed=7)
    key_mask = torch.ones(1, 100, dtype=torch.bool)
    key_mask[0, 90:] = False
    errors = _errors(problem, "triton", is_causal=True, key_mask=key_mask)
    assert max(errors.values()) < 1e-5, errors


def _half_errors(dtype, implementation):
    shape = dict(B=1, H=2, L=80, S=80, D=32, K=6, seed=9)
    return _errors(make_problem(**shape, dtype=dtype), implementation, is_causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_error_at_most_twice_the_reference(dtype):
    """Flash-attention's criterion, with the GPU's block sizes (128 x 64 forward tiles)."""
    ours, reference = _half_errors(dtype, "triton"), _half_errors(dtype, "reference")
    for name, err in ours.items():
        assert err <= 2 * reference[name] + 1e-5, (name, ours, reference)


@pytest.mark.usefixtures("small_blocks")
def test_table_gradients_are_deterministic():
    problem = make_problem(B=1, H=2, L=33, S=33, D=8, K=3, seed=4)
    runs = [forward_backward(problem, "triton", is_causal=True)[1] for _ in range(2)]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("small_blocks")
def test_nan_in_an_attended_key_or_value_gives_nan():
    g = torch.Generator().manual_seed(0)
    for what, j in (("key", 0), ("value", 20), ("key", 33)):
        q, k, v = (torch.randn(1, 2, 34, 8, generator=g, dtype=F64) for _ in range(3))
        (k if what == "key" else v)[:, :, j, 0] = float("nan")
        table = torch.randn(7, 8, dtype=F64, generator=g)
        out = relpos.relative_attention(q, k, v, max_distance=3, rel_keys=table,
                                        rel_values=table, is_causal=True, implementation="triton")
        nan_rows = out.isnan().any(-1)  # (B, H, L)
        assert nan_rows[:, :, j:].all(), (what, j)  # causal: rows j.. see key j


def test_opcheck():
    problem = make_problem(B=1, H=2, L=9, S=11, D=4, K=2)
    q, k, v, ak, av = problem.leaves()
    key_mask = torch.tensor([[True] * 9 + [False] * 2])
    args = (q, k, v, ak[None], av[None], key_mask)
    options = dict(left=2, right=2, is_causal=True, scale=0.5, query_start=2)
    torch.library.opcheck(torch.ops.relpos.triton_attention.default, args, options)


def test_auto_selection_never_picks_triton_for_cpu_tensors():
    q = torch.randn(1, 2, 600, 8)
    table = torch.randn(5, 8)
    assert relpos.select_backend(q, q, q, max_distance=2, rel_keys=table) != "triton"
    assert relpos.select_backend(q, q, q, max_distance=2, rel_keys=table,
                                 implementation="triton") == "triton"


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(dropout_p=0.1), "dropout_p=0.1"),
    (dict(attn_mask=torch.ones(5, 5, dtype=torch.bool)), "dense attn_mask of shape (5, 5)"),
])
def test_refusals_name_what_was_received(kwargs, message):
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match=r"implementation 'triton' cannot serve") as info:
        relpos.relative_attention(q, q, q, max_distance=2, implementation="triton", **kwargs)
    assert message in str(info.value)


def test_head_dims_above_128_are_refused():
    q = torch.randn(1, 1, 3, 160)
    with pytest.raises(RuntimeError, match=r"D=160, Dv=160.*D, Dv <= 128"):
        relpos.relative_attention(q, q, q, max_distance=1, implementation="triton")


def test_every_head_dim_up_to_128_has_a_configuration():
    for d in range(1, 129):
        for kernel in configs.KERNELS:
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                assert configs.config(kernel, d, dtype).block_m >= 16


def test_cpu_without_the_interpreter_is_refused_with_the_reason():
    code = (
        "import os, torch, relpos\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "q = torch.randn(1, 1, 3, 8)\n"
        "try:\n"
        "    relpos.relative_attention(q, q, q, max_distance=1, implementation='triton')\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
        "import sys; print('triton' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, check=True)
    lines = result.stdout.splitlines()
    assert "only under Triton's interpreter" in lines[0]
    assert lines[1] == "False"  # refusing a call does not import triton
