"""The README's commands are the ones CI runs, its convention matrices are relpos's, and only
two of its Python blocks are not run (tests/test_doc_blocks.py runs its blocks)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_only_the_hugging_face_and_eole_blocks_are_not_run():
    # Every other Python block runs (tests/test_doc_blocks.py runs the README's blocks).
    from test_doc_blocks import parse

    blocks, problems = parse("README.md")
    assert not problems, problems
    python = [b for b in blocks if b.lang == "python"]
    skipped = [b for b in python if not b.runs]
    assert len(python) >= 6 and len(skipped) == 2
    assert skipped[0].directive("network") is not None
    assert "from relpos.integrations.transformers import patch" in skipped[0].text
    assert "patch(model)" in skipped[0].text
    assert "pip install 'relpos[transformers]'" in README
    assert skipped[1].directive("skip") is not None
    assert "relpos.integrations.eole.patch_on_build()" in skipped[1].text  # it patches eole
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
