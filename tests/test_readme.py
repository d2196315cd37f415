"""The README's Python blocks run as written, and its commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


# A Python block right after this comment is compiled but not run (it downloads a model).
NOT_RUN = "<!-- README test: compiled, not run"


def _python_blocks() -> list[tuple[bool, str]]:
    """``(run, source)`` of every Python block of the README."""
    found = re.findall(r"(<!-- README test: [^\n]*-->\n)?```python\n(.*?)```", README, flags=re.S)
    return [(not marker.startswith(NOT_RUN), block) for marker, block in found]


def test_python_blocks_run():
    blocks = _python_blocks()
    assert blocks, "the README has no Python example"
    for run, block in blocks:
        code = compile(block, "README.md", "exec")
        if run:
            exec(code, {})


def test_only_the_hugging_face_and_eole_blocks_are_not_run():
    skipped = [block for run, block in _python_blocks() if not run]
    assert len(skipped) == 2
    assert "from relpos.integrations.transformers import patch" in skipped[0]
    assert "patch(model)" in skipped[0]
    assert "pip install 'relpos[transformers]'" in README
    assert "relpos.integrations.eole.patch_on_build()" in skipped[1]  # it starts eole
    assert "pip install 'relpos[eole]'" in README


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = [line for line in ci.splitlines() if "pytest" in line]
    assert len(command) == 1
    assert f"```bash\n{command[0]}\n```" in README


def test_convention_matrices_match_relative_position_index():
    import torch

    import relpos

    # The K = 2 matrix and, beside it, the window (2, 1): one or two "query i" rows a line.
    lines = [line for line in README.splitlines() if re.match(r"query \d+\s", line)]
    rows = [re.findall(r"query \d+\s+((?:[+-]\d+ *)+)", line) for line in lines]
    assert len(rows) == 6 and all(len(r) == 2 for r in rows), lines
    symmetric, window = (torch.tensor([[int(x) for x in r[side].split()] for r in rows])
                         for side in (0, 1))
    torch.testing.assert_close(symmetric, relpos.relative_position_index(6, 6, 2) - 2)
    torch.testing.assert_close(window, relpos.relative_position_index(6, 6, (2, 1)) - 2)
    assert "K = 2: [-2, +2], 5 rows" in README and "(2, 1): [-2, +1], 4 rows" in README
