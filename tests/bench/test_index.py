"""benchmarks/README.md indexes every committed report, and names only reports that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _indexed() -> set[str]:
    names: set[str] = set()
    for line in (BENCH / "README.md").read_text().splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names.update(re.findall(r"`([\w.-]+\.md)`", first))
    return names


def test_every_report_is_indexed():
    reports = {p.name for p in BENCH.glob("*.md")} - {"README.md"}
    missing = sorted(reports - _indexed())
    assert not missing, f"reports benchmarks/README.md does not list: {missing}"


def test_the_index_names_only_reports_that_exist():
    absent = sorted(name for name in _indexed() if not (BENCH / name).is_file())
    assert not absent, f"benchmarks/README.md lists reports that do not exist: {absent}"
