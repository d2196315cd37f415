"""The native kernels with their float32 GEMMs on libtorch's brgemm (oneDNN's micro-kernels):
what ``RELPOS_NATIVE_FLOAT_GEMM=brgemm`` selects, and the only float32 engine of kernels built
without vector code (the x86-64 ``baseline`` variant; builds for CPUs other than x86-64's).
Each check runs the reference comparisons in a process of its own with the environment set
(float64's GEMMs stay on the BLAS: they have no switch)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import relpos

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BRGEMM = {"RELPOS_NATIVE_FLOAT_GEMM": "brgemm"}

# The reference comparisons of the padded and packed kernels (float64 forward and all five
# gradients at awkward sizes, masks, windows, non-contiguous float32 views, gradcheck, dropout,
# seqused_k, half precision on widened tiles, bitwise equality at one and two threads), run with
# float32's GEMMs on brgemm (test_float32_rows sets the switch per case: its vec cases are left
# out).
AGAINST_THE_REFERENCE = [
    "tests/ops/test_native.py::test_matches_reference",
    "tests/ops/test_native.py::test_every_query_block_size_matches_reference",
    "tests/ops/test_native.py::test_float32_rows_match_the_float64_reference",
    "tests/ops/test_native.py::test_gradcheck",
    "tests/ops/test_native.py::test_dropout_gradcheck",
    "tests/ops/test_native_offsets.py",
    "tests/ops/test_native_varlen.py::test_each_sequence_matches_the_reference",
    "tests/ops/test_native_varlen.py::test_gradcheck",
    "tests/ops/test_native_varlen.py::test_seqused_k_matches_the_reference_on_the_used_rows",
    "tests/ops/test_native_varlen.py::test_bitwise_the_same_at_one_and_two_threads",
    "tests/ops/test_native_varlen.py::test_half_precision_is_close_to_float64",
]

# The suite's kernels directory (tests/ops/test_native_build.py builds the same, under its lock).
PREBUILT = Path(ROOT) / "build" / "relpos-prebuilt"

_SAY = textwrap.dedent("""
    from relpos.ops.native import build
    m = build.load()
    print(m.__file__)
    print(m.build_info())
    print(build.gemm_engines(m))
""")


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=ROOT, timeout=600)


def test_native_kernels_on_brgemm_say_so_and_match_the_reference() -> None:
    said = _run(["-c", _SAY], **BRGEMM)
    assert said.returncode == 0, said.stderr[-3000:]
    engines = said.stdout.splitlines()[-1]
    assert "'float32': 'brgemm'" in engines, engines
    done = _run(["-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                 "-k", "not (test_float32_rows and vec)", *AGAINST_THE_REFERENCE], **BRGEMM)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def test_native_baseline_variant_runs_float32_on_brgemm_and_matches_the_reference(
        tmp_path: Path) -> None:
    """What a CPU other than x86-64's runs, as near as this machine gets: kernels without
    vector code (the baseline variant, ``vectors=none``), every float32 GEMM on brgemm
    (``vec`` asked for gives way to it); the same reference comparisons (auto-selection's own
    check left out where the call has more than 512 keys, which such kernels leave to the
    PyTorch backends)."""
    from relpos.cli import main
    from relpos.ops.native import build

    assert main(["kernels", "--build", "--into", str(PREBUILT), "--variants", "baseline"]) == 0
    (entry,) = [p for p in build.prebuilt(PREBUILT) if p.variant == "baseline"]
    shutil.copytree(entry.library.parent, tmp_path / entry.library.parent.name)
    env = {"RELPOS_KERNELS_DIR": str(tmp_path)}
    said = _run(["-c", _SAY], **env, RELPOS_NATIVE_FLOAT_GEMM="vec")
    assert said.returncode == 0, said.stderr[-3000:]
    library, info, engines = said.stdout.splitlines()[-3:]
    assert "-baseline-" in library and " vectors=none" in info, (library, info)
    assert "'float32': 'brgemm'" in engines, engines
    done = _run(["-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                 "-k", "not (test_matches_reference and 600) and not (test_float32_rows and vec)",
                 *AGAINST_THE_REFERENCE], **env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]
    assert "deselected" in done.stdout, done.stdout[-2000:]


# ----------------------------------------------------------------------------- in process
# The switch is read at each call: the same kernels serve both engines in one process.
SHAPES = [  # (L, S, D, Dv, K, causal): around the GEMM blocks' edges (8 rows for the BLAS's
    # decode-like products, 64/128/256 query rows, 512 keys), D and Dv apart
    (1, 900, 16, 16, 8, False), (5, 600, 16, 24, 8, True), (7, 7, 8, 8, 3, False),
    (63, 65, 32, 32, 4, True), (65, 130, 32, 16, 40, False), (129, 129, 64, 64, 16, True),
    (257, 300, 16, 16, 2, False), (300, 700, 32, 32, 16, True), (513, 513, 16, 8, 1, False),
]


@pytest.mark.parametrize(("L", "S", "D", "Dv", "K", "causal"), SHAPES,
                         ids=[f"L{s[0]}-S{s[1]}-D{s[2]}-Dv{s[3]}-K{s[4]}-{'c' if s[5] else 'n'}"
                              for s in SHAPES])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_float32_on_brgemm_matches_the_float64_reference(
        L: int, S: int, D: int, Dv: int, K: int, causal: bool, layout: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 on brgemm (every GEMM form: scores, values, the table terms, the five
    gradients; queries aligned to the end of the keys) against the reference in float64, on
    contiguous inputs and on strided views (every other head of a wider tensor)."""
    from relpos.ops.native import build

    monkeypatch.setenv("RELPOS_NATIVE_FLOAT_GEMM", "brgemm")
    module = build.load()
    assert module is not None and build.gemm_engines(module)["float32"] == "brgemm"
    gen = torch.Generator().manual_seed(L * 1000 + S)
    B, H = 2, 2
    heads = 2 * H if layout == "strided" else H

    def rand(n: int, d: int) -> torch.Tensor:  # (B, heads, n, d): the inputs' storage
        return torch.randn(B, heads, n, d, generator=gen, dtype=torch.float64)

    def view(t: torch.Tensor) -> torch.Tensor:  # what the call reads
        return t[:, ::2] if layout == "strided" else t

    q, k, v = rand(L, D), rand(S, D), rand(S, Dv)
    ak = torch.randn(2 * K + 1, D, generator=gen, dtype=torch.float64) * 0.5
    av = torch.randn(2 * K + 1, Dv, generator=gen, dtype=torch.float64) * 0.5
    grad = torch.randn(B, H, L, Dv, generator=gen, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, ak, av)]
    got_in = [t.float().requires_grad_() for t in (q, k, v, ak, av)]
    outs = []
    for xs, impl in ((ref_in, "reference"), (got_in, "native")):
        qv, kv, vv = (view(t) for t in xs[:3])
        assert qv.is_contiguous() == (layout == "contiguous")
        out = relpos.relative_attention(qv, kv, vv, rel_keys=xs[3], rel_values=xs[4],
                                        max_distance=K, is_causal=causal, implementation=impl)
        out.backward(grad.to(out.dtype))
        outs.append(out)
    torch.testing.assert_close(outs[1].double(), outs[0].detach(), rtol=1e-4, atol=2e-5)
    for got, ref in zip(got_in, ref_in, strict=True):
        assert ref.grad is not None and got.grad is not None
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-4, atol=1e-4)
