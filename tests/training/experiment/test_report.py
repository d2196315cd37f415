"""The report (relpos.training.experiment.report): the committed studies render byte for
byte from their results documents, the learning-curve section, the deprecated LARGE_PP."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from relpos.training.experiment import claims, load_results, make_report

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("study", ["experiment", "experiment-long"])
def test_the_committed_reports_render_from_their_results(study):
    out = ROOT / "benchmarks" / study
    committed = (out / "report.md").read_text()
    # The figures in the order the committed report lists them (write_figures' order).
    figures = re.findall(r"^!\[([^\]]+)\]\(\1\)$", committed, re.M)
    assert figures and all((out / f).is_file() for f in figures)
    assert make_report(load_results(out), figures=figures) == committed


@pytest.mark.parametrize("module", ["relpos.training.experiment",
                                    "relpos.training.experiment.report"])
def test_large_pp_is_deprecated(module):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(module)}\.LARGE_PP is "
                                                r"deprecated; use the value 5\.0"):
        assert mod.LARGE_PP == 5.0
    assert "LARGE_PP" not in mod.__all__ and "LARGE_PP" not in vars(mod)
    with pytest.raises(AttributeError, match="no attribute 'SMALLEST_PP'"):
        mod.SMALLEST_PP  # noqa: B018


def test_learning_curves_say_whether_the_budget_plateaued(synthetic):
    results = synthetic({4: (1.0, 0.2), 16: (1.0, 0.9), 64: (1.0, 0.9)})
    earlier = {4: (0.2, 0.2, 0.2), 16: (0.895, 0.9, 0.905), 64: (0.5, 0.88, 0.9)}
    for run in list(results["runs"]):
        k, seed = run["spec"]["k"], run["spec"]["seed"]
        ev = json.loads(json.dumps(run["eval"][0]))
        far = earlier[k][seed]
        for d, cell in ev["by"]["distance"].items():
            if int(d) > 4:
                cell["accuracy"] = far
        ev["accuracy"] = (1.0 + 3 * far) / 4
        results["runs"].append({**run, "spec": {**run["spec"], "steps": 60},
                                "eval": [ev], "train": {"steps": 60}})
    report = make_report(results)
    section = report.split("## Step budget: learning curves")[1].split("\n## ")[0]
    rows = {line.split(" | ")[0][2:] + "/" + line.split(" | ")[1]: line
            for line in section.splitlines() if line.startswith("| K=")}
    far = "accuracy, d>=5 (subset)"
    assert rows[f"K=4/{far}"].endswith("| plateaued |")  # 0.2 at both budgets
    assert rows[f"K=16/{far}"].endswith("| plateaued |")  # seeds moved 0.5 pp
    assert rows[f"K=64/{far}"].endswith("| mixed |")  # one seed still rose 40 pp
    assert "| 60 steps | 120 steps |" in section
    # The sweep's own tables and claims ignore the curve runs.
    assert claims(results) == claims({**results, "runs": results["runs"][:9]})
