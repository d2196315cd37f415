"""The plan of the sweep (relpos.training.experiment.sweep): which runs, in what order, with
which budget."""

from __future__ import annotations

import pytest

from relpos.training.experiment import ExperimentConfig, plan
from relpos.training.experiment.sweep import budget, train_config


def test_plan_covers_the_presets():
    default = plan(ExperimentConfig())
    assert {r.seed for r in default} == {0, 1, 2}
    code = [r for r in default if r.task == "pysrc"]
    assert {r.model for r in code} == {"K=4", "K=16", "K=32", "K=64", "K=128",
                                       "unclipped", "learned"}
    assert next(r.k for r in code if r.unclipped) == 8 * 128 - 1
    full = plan(ExperimentConfig.full())
    assert {r.k for r in full if r.task == "pysrc" and not r.unclipped
            and r.positions == "relative"} == {0, 1, 2, 4, 8, 16, 32, 64, 128}
    assert {r.positions for r in full} == {"relative", "learned", "sinusoidal"}
    assert len({r.name for r in full}) == len(full)
    with pytest.raises(ValueError, match="unknown task"):
        ExperimentConfig(tasks=("nope",))
    with pytest.raises(ValueError, match="distinct"):
        ExperimentConfig(seeds=(1, 1))


def test_the_long_preset_trains_curves_around_its_budget():
    long = ExperimentConfig.long()
    runs = plan(long)
    assert len({r.name for r in runs}) == len(runs)
    assert {r.task for r in runs} == {"agree", "pysrc"} and long.jobs == 2
    sweep = [r for r in runs if not r.steps]
    assert {r.seed for r in sweep if r.task == "agree"} == set(range(20))
    assert {r.seed for r in sweep if r.task == "pysrc" and r.model not in (
        "K=128", "unclipped")} == set(range(20))
    curve = [r for r in runs if r.steps]
    # The curve points below the budget (and pysrc's above it), for the curve K and seeds,
    # both agree depths.
    assert {(r.task, r.depth, r.k, r.seed, r.steps) for r in curve} == {
        *(("agree", d, k, s, b) for d in (1, 2) for k in (4, 16, 64) for s in (0, 1)
          for b in (500, 1000)),
        *(("pysrc", 2, k, s, b) for k in (4, 16, 128) for s in (0, 1)
          for b in (500, 1000, 4000, 8000))}
    # The budget's own point of each curve is a run of the sweep itself.
    assert {(r.task, r.depth, r.k, r.seed) for r in curve} <= {
        (r.task, r.depth, r.k, r.seed) for r in sweep}
    assert curve[0].name.endswith("-steps500")
    assert budget(curve[0], long) == 500 == train_config(curve[0], long).steps
    assert budget(sweep[0], long) == 2000
    # Sweep runs first, seed by seed (an interrupted sweep has whole seeds), then the
    # extra seeds of K=128 and unclipped.
    assert runs.index(curve[0]) == len(sweep)
    extra = [r for r in sweep if r.seed >= 20]
    assert {(r.model, r.seed) for r in extra} == {
        (m, s) for m in ("K=128", "unclipped") for s in range(20, 61)}
    assert sweep[-len(extra):] == extra and long.all_seeds == tuple(range(61))
