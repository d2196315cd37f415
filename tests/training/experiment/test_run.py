"""Whole sweeps (relpos.training.experiment.run, .workers): every file written, the same
numbers again, in one process or in parallel jobs, and extra seeds for some models."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from relpos.training.experiment import ExperimentConfig, load_results, plan, run_experiment
from relpos.training.experiment.claims import signal_claims
from relpos.training.experiment.results import configurations, runs_of


def _quiet(s: str) -> None:
    pass


def test_sweep_writes_everything_and_reproduces(tmp_path, tiny):
    a = run_experiment(tiny, tmp_path / "a", progress=False, log=_quiet)
    b = run_experiment(tiny, tmp_path / "b", progress=False, log=_quiet)
    assert [r["eval"] for r in a["runs"]] == [r["eval"] for r in b["runs"]]
    assert [r.get("signal") for r in a["runs"]] == [r.get("signal") for r in b["runs"]]
    names = {p.name for p in (tmp_path / "a").iterdir()}
    assert {"results.json.gz", "report.md", "heatmap_recall.png", "extrapolation_recall.png",
            "heatmap_pysrc.png", "bpc_pysrc.png", "extrapolation_pysrc.png",
            "signal_pysrc.png", "runs"} <= names
    saved = load_results(tmp_path / "a")
    assert saved["runs"] == json.loads(json.dumps(a["runs"]))
    env = saved["environment"]
    assert env["threads"] == 1 and env["cpu"] and env["isa"] and env["torch"]
    assert saved["corpus"]["files"]["train"] > 0
    code = [r for r in a["runs"] if r["spec"]["task"] == "pysrc"]
    assert {r["model_label"] for r in code} == {"K=2", "unclipped"}
    for r in code:
        assert [ev["length"] for ev in r["eval"]] == [16, 64]
        assert all(ev["bpc"] > 0 for ev in r["eval"])
        sig = r["signal"]
        assert len(sig["moved"]) == sig["k"] + 1
    unclipped = next(r for r in code if r["model_label"] == "unclipped")
    assert unclipped["signal"]["k"] == 63
    assert all(g == 0 for g in unclipped["signal"]["mean_grad_norm"][16:])
    report = (tmp_path / "a" / "report.md").read_text()
    assert env["cpu"] in report and "## The claims, answered" in report
    assert report.index("## The claims, answered") < report.index("Which K to choose")
    assert "seed's" not in report and "Shaw et al., 2018" in report
    assert "Which K to choose" in report and "overall" in report and "subset" in report


def _curved(tiny: ExperimentConfig, jobs: int) -> ExperimentConfig:
    return replace(tiny, ks=(4,), baselines=(), steps=6, code_steps=4, curve_steps=(3, 12),
                   code_curve_steps=(2,), curve_ks=(4,), code_curve_ks=(2,), curve_seeds=(1,),
                   jobs=jobs)


def test_parallel_jobs_give_the_same_runs_and_curves(tmp_path, tiny):
    one = run_experiment(_curved(tiny, 1), tmp_path / "one", progress=False, log=_quiet)
    two = run_experiment(_curved(tiny, 2), tmp_path / "two", progress=True, log=_quiet)

    def numbers(results):
        return [(r["spec"], r["eval"], r.get("signal")) for r in results["runs"]]

    assert numbers(one) == numbers(two)
    curve = [r for r in one["runs"] if r["spec"]["steps"]]
    assert {(r["spec"]["task"], r["train"]["steps"]) for r in curve} == {
        ("recall", 3), ("recall", 12), ("pysrc", 2)}
    report = (tmp_path / "two" / "report.md").read_text()
    assert "## Step budget: learning curves" in report
    # The probe above the sweep's budget is the curve's last point: its last doubling.
    assert "| 3 steps | 6 steps | 12 steps | last doubling, per seed | plateau |" in report
    assert "| 2 steps | 4 steps | last doubling, per seed | plateau |" in report
    assert (tmp_path / "two" / "curves_recall.png").is_file()
    assert (tmp_path / "two" / "curves_pysrc.png").is_file()
    # The sweep's tables count the sweep's runs only: one run per seed and model.
    for group in configurations(runs_of(one["runs"], "recall", 1)).values():
        assert [r["spec"]["seed"] for r in group] == [0, 1]
    # Reusing every run trains nothing and keeps the earlier invocation's wall time.
    again = run_experiment(_curved(tiny, 2), tmp_path / "two", progress=False, reuse=True,
                           log=_quiet)
    assert again["trained_runs"] == 0 and again["reused_runs"] == len(one["runs"])
    assert again["earlier_seconds"] == pytest.approx(two["sweep_seconds"])
    assert "reused" in (tmp_path / "two" / "report.md").read_text().split("\n")[2]


def test_extra_seeds_for_some_pysrc_models(tmp_path, tiny):
    config = replace(tiny, tasks=("pysrc",), code_seeds=(0, 1), code_extra_seeds=(2, 3),
                     code_extra_models=("K=2", "unclipped"))
    runs = plan(config)
    assert [(r.model, r.seed) for r in runs[-4:]] == [
        ("K=2", 2), ("unclipped", 2), ("K=2", 3), ("unclipped", 3)]
    said: list[str] = []
    results = run_experiment(config, tmp_path / "e", progress=True, log=said.append)
    assert "(2 seeds and 2 more for K=2 and unclipped of pysrc)" in said[0]
    assert sorted(r["spec"]["seed"] for r in results["runs"]
                  if r["model_label"] == "unclipped") == [0, 1, 2, 3]
    report = (tmp_path / "e" / "report.md").read_text()
    extra = ("(K=2 and unclipped of pysrc: 2 more seeds (2, 3); a comparison pairs the "
             "seeds both its models have)")
    assert f"Every number is a mean over 2 seed(s) (0, 1) {extra}" in report
    assert "K=2 and unclipped are trained with more seeds than the others (K=2 4, " \
           "unclipped 4 runs)" in report
    # The 8x comparison pairs all four seeds; without the extras, two.
    row = next(r for r in signal_claims(results)
               if r["claim"].startswith("clipping beats"))
    assert row["interval"].n == 4 and row["measured"].endswith(" over 4 seeds")
    fewer = {**results, "runs": [r for r in results["runs"] if r["spec"]["seed"] < 2],
             "config": {**results["config"], "code_extra_seeds": [],
                        "code_extra_models": []}}
    row = next(r for r in signal_claims(fewer)
               if r["claim"].startswith("clipping beats"))
    assert row["interval"].n == 2 and "over" not in row["measured"]
