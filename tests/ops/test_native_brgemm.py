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
