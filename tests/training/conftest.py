"""Fixtures of the training tests: a fake standard library for the K sweep (nothing outside
tmp_path is read)."""
from __future__ import annotations

from pathlib import Path

import pytest

FUNCTION = '''def f{n}(a, b=[1, 2], *args):
    """Doc with a ( bracket."""
    total = {{"k": (a + b[0]) * {n}}}  # comment ]
    for x in range(len(args)):
        total["k"] += (x * (x + 1))
    return [total, (a, b), "s)"]

'''


def fake_lib(root: Path, files: int = 30) -> Path:
    """``root`` with ``files`` small modules, a package, and files the corpus skips."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        sub = root / ("pkg" if i % 3 == 0 else "")
        sub.mkdir(exist_ok=True)
        text = "".join(FUNCTION.format(n=i * 10 + j) for j in range(6))
        (sub / f"mod{i:02d}.py").write_text(f"# module {i}\nimport os\n\n{text}")
    for skipped in ("test", "site-packages", "tests"):
        (root / skipped).mkdir(exist_ok=True)
        (root / skipped / "skipme.py").write_text("x = 1\n")
    (root / "notes.txt").write_text("not python\n")
    return root


@pytest.fixture
def fake_stdlib(tmp_path: Path) -> Path:
    """A small ``Lib`` tree of .py files under ``tmp_path`` (see :func:`fake_lib`)."""
    return fake_lib(tmp_path / "Lib")
