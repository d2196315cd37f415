"""The docstring examples (``>>>``) of the core and the models run, and print what they say.

Examples whose output depends on the machine (which backend auto-selection picks, the CPU)
are written so that they hold everywhere; a module listed here must have examples, so a
docstring cannot lose them silently.
"""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

MODULES = (
    "relpos.functional",
    "relpos.positions",
    "relpos.tables",
    "relpos.cache",
    "relpos.modules.attention",
    "relpos.modules.transformer",
    "relpos._sysinfo",
    "relpos.models.config",
    "relpos.models.transformer",
    "relpos.models.decoding",
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
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
