"""Fixtures of the training tests: one torch thread for every test, a fake standard library
for the K sweep and a text file of lines of many lengths (nothing outside tmp_path is
read)."""
from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

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


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Every training test runs on one torch thread: training is reproducible per thread count
    (a test compares runs), and one thread is also fastest on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_lines(path: Path, count: int = 300, seed: int = 0) -> str:
    """A text file of ``count`` lines of 0..30 characters (empty and 1-character lines
    among them, many longer than 13); returns its text."""
    rng = random.Random(seed)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]
    lines = []
    for n in range(count):
        if n % 7 == 0:
            lines.append("")  # a 1-character line ("\n"): skipped
        elif n % 11 == 0:
            lines.append(rng.choice("xyz"))  # 2 characters with its newline: kept
        else:
            line = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 7)))
            lines.append(line[: rng.randrange(1, 31)])
    text = "\n".join(lines) + "\n"
    path.write_text(text, encoding="utf-8")
    return text


@pytest.fixture
def lines_file(tmp_path: Path) -> tuple[Path, str]:
    """``(path, text)`` of a :func:`write_lines` file in ``tmp_path``."""
    path = tmp_path / "lines.txt"
    return path, write_lines(path)
