"""The native kernels with their GEMMs on libtorch's own matrix multiply (at::addmm): the route
where libtorch exports no BLAS ``sgemm_``/``dgemm_`` (a wheel without MKL, as non-x86 ones
are), which ``RELPOS_NATIVE_BLAS=aten`` asks for here. Each check runs in a process of its own, as
the kernels read the switch once per process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# float32 GEMMs on the BLAS too (not the kernels' own vectors): every GEMM takes the route.
ATEN = {"RELPOS_NATIVE_BLAS": "aten", "RELPOS_NATIVE_SGEMM": "blas"}

# The reference comparisons of the padded and packed kernels (float64 forward and all five
# gradients at awkward sizes, masks, windows, non-contiguous float32 views, gradcheck, dropout,
# seqused_k, half precision, bitwise equality at one and two threads), run on that route.
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


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=ROOT, timeout=600)


def test_native_kernels_on_libtorchs_matrix_multiply_say_so_and_match_the_reference() -> None:
    said = _run(["-c", textwrap.dedent("""
        from relpos.ops.native import build
        print(build.load().build_info())
        print(build.status().blas)
    """)], **ATEN)
    assert said.returncode == 0, said.stderr[-3000:]
    info, line = said.stdout.splitlines()[-2:]
    assert info.startswith("blas=aten ") and " sgemm=blas " in info, info
    assert line.startswith("float32 libtorch's matrix multiply"), line
    assert "float64 libtorch's matrix multiply" in line, line
    done = _run(["-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                 *AGAINST_THE_REFERENCE], **ATEN)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def test_native_blas_switch_ignores_a_name_it_does_not_know_with_one_warning() -> None:
    """A route that is neither aten nor blas: every call ran into the kernels' refusal; now
    the switch is ignored with one warning (the allowed names, the fallback) and the calls run
    on the default route, the switch gone from the environment the kernels read."""
    code = textwrap.dedent("""
        import os, torch, relpos
        from relpos.ops.native import build
        q = torch.randn(1, 1, 4, 8)
        for _ in range(3):
            relpos.relative_attention(q, q, q, max_distance=1, rel_keys=torch.randn(3, 8),
                                      implementation="native")
        print(build.load().build_info())
        print(os.environ.get("RELPOS_NATIVE_BLAS"))
    """)
    done = _run(["-c", code], RELPOS_NATIVE_BLAS="openblas", RELPOS_NATIVE_SGEMM="blas")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("RELPOS_NATIVE_BLAS='openblas' is none of aten, blas") == 1, \
        done.stderr[-2000:]
    info, seen = done.stdout.splitlines()[-2:]
    from relpos.ops.native import build

    assert info.startswith("blas=mkl " if build.have_blas() else "blas=aten "), info
    assert seen == "None", seen
    spaced = _run(["-c", code], RELPOS_NATIVE_BLAS=" ATEN ", RELPOS_NATIVE_SGEMM="blas")
    assert spaced.returncode == 0 and "RuntimeWarning" not in spaced.stderr, spaced.stderr
    info, seen = spaced.stdout.splitlines()[-2:]
    assert info.startswith("blas=aten ") and seen == "aten", (info, seen)


def test_native_baseline_variant_on_libtorchs_matrix_multiply_matches_the_reference(
        tmp_path: Path) -> None:
    """What a CPU other than x86-64's runs, as near as this machine gets: kernels without
    vector code (the baseline variant, ``vectors=none``) with every GEMM on libtorch's matrix
    multiply; the same reference comparisons (auto-selection's own check left out where the
    call has more than 512 keys, which such kernels leave to the PyTorch backends)."""
    from relpos.cli import main
    from relpos.ops.native import build

    assert main(["kernels", "--build", "--into", str(PREBUILT), "--variants", "baseline"]) == 0
    (entry,) = [p for p in build.prebuilt(PREBUILT) if p.variant == "baseline"]
    shutil.copytree(entry.library.parent, tmp_path / entry.library.parent.name)
    env = {**ATEN, "RELPOS_KERNELS_DIR": str(tmp_path)}
    said = _run(["-c", "from relpos.ops.native import build; m = build.load(); "
                       "print(m.__file__); print(m.build_info())"], **env)
    assert said.returncode == 0, said.stderr[-3000:]
    library, info = said.stdout.splitlines()[-2:]
    assert "-baseline-" in library and info.startswith("blas=aten "), (library, info)
    assert " vectors=none " in info, info
    done = _run(["-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                 "-k", "not (test_matches_reference and 600)", *AGAINST_THE_REFERENCE], **env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]
    assert "deselected" in done.stdout, done.stdout[-2000:]
