"""The README's Python blocks run as written, and its commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks, "the README has no Python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = [line for line in ci.splitlines() if "pytest" in line]
    assert len(command) == 1
    assert f"```bash\n{command[0]}\n```" in README


def test_convention_matrix_matches_relative_position_index():
    import torch

    import relpos

    rows = re.findall(r"^query \d+\s+((?:[+-]\d+\s*)+)$", README, flags=re.M)
    drawn = torch.tensor([[int(x) for x in row.split()] for row in rows])
    assert drawn.shape == (6, 6)
    torch.testing.assert_close(drawn, relpos.relative_position_index(6, 6, 2) - 2)
