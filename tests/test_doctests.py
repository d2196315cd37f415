"""Every docstring example (``>>>``) in the package runs, and prints what it says.

The modules are found by reading the sources, so an example cannot go unrun. Examples whose
output depends on the machine (which backend auto-selection picks, the CPU) are written so
that they hold everywhere; the backend examples also run without the native kernels.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest
import torch

import relpos

SRC = Path(__file__).resolve().parents[1] / "src"
MODULES = tuple(sorted(
    ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
    for p in (SRC / "relpos").rglob("*.py") if ">>>" in p.read_text(encoding="utf-8")
))


def test_the_core_has_examples() -> None:
    core = {"relpos.functional", "relpos.positions", "relpos.tables", "relpos.cache",
            "relpos.modules.attention", "relpos.modules.transformer_layers"}
    assert core <= set(MODULES), sorted(core - set(MODULES))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    _run_examples(name)


@pytest.mark.usefixtures("no_native")
def test_the_backend_examples_hold_without_the_native_kernels() -> None:
    _run_examples("relpos.functional")


def _run_examples(name: str) -> None:
    module = importlib.import_module(name)
    # The examples read as a user's session after ``import torch, relpos``.
    extra = {"relpos": relpos, "torch": torch, "nn": torch.nn, "F": torch.nn.functional}
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name, extraglobs=extra)
    examples = sum(len(t.examples) for t in tests)
    assert examples > 0, f"{name} has no docstring examples"
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    torch.manual_seed(0)
    for test in tests:
        runner.run(test, out=report.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(report)
    assert result.attempted == examples
