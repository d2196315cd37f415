"""Every repository path that a comment, docstring or doc cites exists in the repository.

A reader who clones relpos alone has only what is in it: a comment pointing at a report, a
design section or a source file that is not there sends them nowhere. The design document is
``docs/design.md``; it is cited as "docs/design.md §N".
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Text files whose words a reader follows.
SUFFIXES = (".py", ".md", ".cpp", ".h", ".toml", ".yml", ".cfg", ".txt", ".sh")
#: A repository path: a top-level folder of the repository, then a path.
PATH = re.compile(r"(?<![\w/.~$-])((?:src|docs|benchmarks|tests)/[\w./-]*\w)")
#: A design document cited by any name but its path in the repository.
OTHER_DESIGN = re.compile(r"DESIGN(?:\.md)?\s*(?:§|section)|(?<![\w/])DESIGN\.md")
#: Paths that are written, not read: the files a command creates where it runs.
WRITTEN = {
    "benchmarks/triton_cuda.md": "python -m relpos.bench.cuda_check writes it on a machine with a "
                                 "GPU",
}


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True, timeout=60).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):  # an export without .git
        return [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts
                and ".venv" not in p.parts and "build" not in p.parts]
    return [ROOT / name for name in out if name]


def _texts() -> list[tuple[str, str]]:
    texts = []
    for path in _tracked():
        if path.suffix in SUFFIXES and path.is_file() and path.name != Path(__file__).name:
            # (this file's examples cite paths on purpose)
            texts.append((path.relative_to(ROOT).as_posix(), path.read_text(errors="replace")))
    return texts


def _is_placeholder(cited: str) -> bool:
    """``benchmarks/NAME.py``, ``tests/FILE.py``: a pattern a sentence explains, not a path."""
    return any(part.isupper() for part in re.split(r"[/.]", cited) if len(part) > 1)


def cited_paths(text: str) -> list[str]:
    """The repository paths ``text`` cites, placeholders left out."""
    return [m.group(1) for m in PATH.finditer(text) if not _is_placeholder(m.group(1))]


def test_cited_paths_exist():
    missing = []
    for name, text in _texts():
        for cited in cited_paths(text):
            if cited in WRITTEN or (ROOT / cited).exists():
                continue
            missing.append(f"{name}: {cited}")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_design_is_cited_by_its_path():
    wrong = [f"{name}: {m.group(0)!r}" for name, text in _texts()
             for m in OTHER_DESIGN.finditer(text)]
    assert not wrong, "cite the design document as docs/design.md:\n" + "\n".join(wrong)


def test_design_sections_cited_exist():
    sections = set(re.findall(r"^## (\d+)\.", (ROOT / "docs" / "design.md").read_text(), re.M))
    assert {"1", "3", "6", "7", "8"} <= sections
    cited = {(name, n) for name, text in _texts()
             for n in re.findall(r"docs/design\.md\s*§(\d+)", text)}
    wrong = sorted(f"{name}: §{n}" for name, n in cited if n not in sections)
    assert not wrong, "sections of docs/design.md that do not exist:\n" + "\n".join(wrong)


@pytest.mark.parametrize("text, expected", [
    ("see benchmarks/kernel_blocks.md for the blocks", ["benchmarks/kernel_blocks.md"]),
    ("``python benchmarks/NAME.py``", []),
    ("(docs/design.md §3)", ["docs/design.md"]),
    ("/tmp/src/x.py", []),
])
def test_cited_paths_finds_what_a_reader_would_follow(text, expected):
    assert cited_paths(text) == expected
