"""The sweep's configuration (relpos.training.experiment.config): what it refuses, the
command that reproduces a preset, and the ``relpos experiment`` options that change it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from relpos.cli import main
from relpos.training.experiment import ExperimentConfig, plan
from relpos.training.experiment.config import default_command


@pytest.mark.parametrize("change, match", [
    ({"curve_steps": (500, 2000)}, "other than the sweep's budget 2000"),
    ({"code_curve_steps": (0, 1000)}, "distinct ints >= 1"),
    ({"curve_steps": (500, 500)}, "distinct"),
    ({"curve_ks": (4, 5)}, "curve_ks must be distinct values of ks"),
    ({"curve_seeds": (50,)}, "curve_seeds must be distinct values of seeds"),
    ({"jobs": 0}, "jobs must be an int >= 1"),
    ({"code_extra_seeds": (19, 20)}, r"must not repeat the seeds of pysrc, got \[19\]"),
    ({"code_extra_models": ("K=128", "K=5")},
     r"distinct models of the pysrc sweep \(K=4, K=8, .*, K=128, unclipped\), got"),
    ({"code_extra_models": ("learned",)}, "distinct models of the pysrc sweep"),
    ({"code_extra_models": ()}, "code_extra_seeds and code_extra_models go together"),
    ({"code_extra_seeds": (70, 70)}, "code_extra_seeds must be distinct"),
])
def test_bad_curve_settings_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        replace(ExperimentConfig.long(), **change)


def test_cli_long_overrides_keep_the_curves_that_fit(monkeypatch, tmp_path, capsys):
    import relpos.training.experiment as experiment

    seen = {}

    def fake_run(config, out, **kwargs):
        seen["config"] = config
        return {}

    monkeypatch.setattr(experiment, "run_experiment", fake_run)
    assert main(["experiment", "--long", "--seeds", "1,2", "--steps", "1000", "--ks", "4,8",
                 "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    cfg = seen["config"]
    assert cfg.preset == "custom" and cfg.curve_seeds == (1,) and cfg.curve_ks == (4,)
    # The budget that became the sweep's own is dropped; one above it is kept (a probe).
    assert cfg.curve_steps == (500,) and cfg.code_curve_steps == (500, 1000, 4000, 8000)
    assert main(["experiment", "--long", "--code-steps", "1000", "--out", str(tmp_path / "q"),
                 "--no-progress"]) == 0
    assert seen["config"].code_curve_steps == (500, 4000, 8000)
    assert main(["experiment", "--long", "--jobs", "1", "--out", str(tmp_path / "p"),
                 "--no-progress"]) == 0
    assert seen["config"].preset == "long" and seen["config"].jobs == 1
    # The extra seeds keep to the models and seeds the changed sweep has.
    long = ExperimentConfig.long()
    for argv, seeds, models in (
            (["--code-ks", "4,16"], long.code_extra_seeds, ("unclipped",)),
            (["--code-ks", "4,128"], long.code_extra_seeds, ("K=128", "unclipped")),
            (["--code-seeds", ",".join(map(str, range(30)))], tuple(range(30, 61)),
             ("K=128", "unclipped")),
            (["--code-extra-models", "none"], (), ()),
            (["--code-extra-models", "unclipped"], long.code_extra_seeds, ("unclipped",)),
            (["--code-extra-seeds", "90,91"], (90, 91), ("K=128", "unclipped"))):
        assert main(["experiment", "--long", *argv, "--out", str(tmp_path / "x"),
                     "--no-progress"]) == 0, argv
        assert (seen["config"].code_extra_seeds, seen["config"].code_extra_models) == (
            seeds, models), argv
    for argv, said in ((["--code-extra-models", "K=5"], "distinct models of the pysrc sweep"),
                       (["--code-extra-models", "K=x"], "must be comma-separated models"),
                       (["--code-extra-seeds", "3"], "must not repeat the seeds of pysrc")):
        capsys.readouterr()
        assert main(["experiment", "--long", *argv, "--out", str(tmp_path / "y")]) == 2
        err = capsys.readouterr().err
        assert said in err and err.strip().count("\n") == 0, err


def test_cli_rejects_unknown_experiment_task(capsys):
    assert main(["experiment", "--tasks", "recall,nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown task" in err


@pytest.mark.parametrize("bad", [["--ks", "4,-1"], ["--depths", "0"], ["--seeds", "1,1"],
                                 ["--quick", "--full"], ["--corpus-root", "/nonexistent/x"]])
def test_cli_rejects_bad_sweep_values(capsys, bad, tmp_path):
    assert main(["experiment", "--out", str(tmp_path / "o"), *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("relpos: error:") or err.startswith("usage:")
    assert err.strip().count("\n") <= 1 or err.startswith("usage:")


def test_pysrc_can_have_seeds_of_its_own(monkeypatch, tmp_path):
    cfg = replace(ExperimentConfig(), seeds=(0, 1, 2, 3), code_seeds=(0, 5))
    runs = plan(cfg)
    assert {r.seed for r in runs if r.task == "pysrc"} == {0, 5}
    assert {r.seed for r in runs if r.task != "pysrc"} == {0, 1, 2, 3}
    assert cfg.all_seeds == (0, 1, 2, 3, 5) and runs[-1].seed == 5
    with pytest.raises(ValueError, match="code_seeds must be distinct"):
        replace(cfg, code_seeds=(1, 1))
    with pytest.raises(ValueError, match="curve_seeds must be distinct values of code_seeds"):
        replace(cfg, curve_seeds=(1,))
    assert default_command(cfg) == "relpos experiment --seeds 0,1,2,3 --code-seeds 0,5"
    assert default_command(ExperimentConfig.long()) == "relpos experiment --long"
    assert default_command(replace(ExperimentConfig.long(), code_extra_seeds=(),
                                   code_extra_models=())) == (
        "relpos experiment --long --code-extra-models none")
    assert default_command(replace(cfg, code_extra_seeds=(7,), code_extra_models=(
        "K=16",))) == ("relpos experiment --seeds 0,1,2,3 --code-seeds 0,5 "
                       "--code-extra-seeds 7 --code-extra-models K=16")
    import relpos.training.experiment as experiment

    seen = {}
    monkeypatch.setattr(experiment, "run_experiment",
                        lambda config, out, **kw: seen.setdefault("config", config))
    # --seeds alone sets every task's seeds, --code-seeds pysrc's.
    assert main(["experiment", "--long", "--seeds", "0,1", "--out", str(tmp_path / "a"),
                 "--no-progress"]) == 0
    assert seen.pop("config").seeds_of("pysrc") == (0, 1)
    assert main(["experiment", "--long", "--code-seeds", "0,1,2", "--out",
                 str(tmp_path / "b"), "--no-progress"]) == 0
    assert seen["config"].seeds_of("pysrc") == (0, 1, 2)
    assert seen["config"].seeds_of("agree") == ExperimentConfig.long().seeds
