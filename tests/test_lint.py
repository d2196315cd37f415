"""The code base stays ruff- and mypy-clean, and the C++ kernels clang-format-clean (all three
come with the dev extra; without clang-format the C++ check skips locally and fails in CI,
``CI=true``)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "src" / "relpos" / "ops" / "native" / "csrc"


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "ruff", "check", "src", "tests"],
    [sys.executable, "-m", "mypy"],
])
def test_clean(command):
    tool = command[2]
    if shutil.which(tool) is None and subprocess.run(
        [sys.executable, "-m", tool, "--version"], capture_output=True
    ).returncode != 0:
        pytest.fail(f"{tool} is not installed: pip install -e '.[dev]'")
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _clang_format() -> str | None:
    """The clang-format of the dev extra's wheel (the version pinned there), else one on PATH."""
    spec = importlib.util.find_spec("clang_format")
    if spec is not None and spec.origin is not None:
        wheel = Path(spec.origin).parent / "data" / "bin" / "clang-format"
        if wheel.is_file():
            return str(wheel)
    return shutil.which("clang-format")


def test_cpp_is_clang_formatted():
    exe = _clang_format()
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("clang-format is missing in CI (install the dev extra)")
        pytest.skip("needs clang-format (the dev extra: pip install -e '.[dev]')")
    sources = sorted(p for p in CSRC.iterdir() if p.suffix in (".h", ".cpp"))
    assert len(sources) > 10, sources
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
    result = subprocess.run([exe, "--dry-run", "--Werror", "--style=file", *map(str, sources)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (
        f"{version}: the C++ sources are not formatted as .clang-format says; run\n"
        f"  clang-format -i src/relpos/ops/native/csrc/*.h src/relpos/ops/native/csrc/*.cpp\n"
        + result.stderr[-3000:])
