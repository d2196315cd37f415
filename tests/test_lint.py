"""The code base stays ruff- and mypy-clean (both come with the dev extra)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
