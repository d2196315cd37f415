"""The K sweep: plan, files, reproducibility, and a report computed from the numbers."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from relpos.cli import main
from relpos.training.experiment import (
    ExperimentConfig,
    claims,
    load_results,
    make_report,
    plan,
    run_experiment,
)


def _tiny(root) -> ExperimentConfig:
    return ExperimentConfig(
        tasks=("recall", "pysrc"),
        ks=(0, 4),
        depths=(1,),
        baselines=("learned",),
        seeds=(0, 1),
        train_length=40,
        eval_lengths=(40, 80),
        steps=3,
        batch_size=4,
        d_model=16,
        num_heads=2,
        eval_tokens=400,
        code_ks=(2,),
        code_baselines=(),
        code_depth=1,
        code_train_length=16,
        code_eval_factors=(1, 4),
        code_steps=3,
        code_batch_size=4,
        code_eval_tokens=256,
        corpus_root=str(root),
        preset="custom",
    )


@pytest.fixture
def tiny(fake_stdlib):
    return _tiny(fake_stdlib)


def _quiet(s: str) -> None:
    pass


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
    from relpos.training.experiment.run import _train_config, budget

    assert budget(curve[0], long) == 500 == _train_config(curve[0], long).steps
    assert budget(sweep[0], long) == 2000
    # Sweep runs first, seed by seed (an interrupted sweep has whole seeds), then the
    # extra seeds of K=128 and unclipped.
    assert runs.index(curve[0]) == len(sweep)
    extra = [r for r in sweep if r.seed >= 20]
    assert {(r.model, r.seed) for r in extra} == {
        (m, s) for m in ("K=128", "unclipped") for s in range(20, 61)}
    assert sweep[-len(extra):] == extra and long.all_seeds == tuple(range(61))


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
    from relpos.training.experiment.results import configurations, runs_of

    for group in configurations(runs_of(one["runs"], "recall", 1)).values():
        assert [r["spec"]["seed"] for r in group] == [0, 1]
    # Reusing every run trains nothing and keeps the earlier invocation's wall time.
    again = run_experiment(_curved(tiny, 2), tmp_path / "two", progress=False, reuse=True,
                           log=_quiet)
    assert again["trained_runs"] == 0 and again["reused_runs"] == len(one["runs"])
    assert again["earlier_seconds"] == pytest.approx(two["sweep_seconds"])
    assert "reused" in (tmp_path / "two" / "report.md").read_text().split("\n")[2]


def test_a_cloned_sweep_is_extended_from_its_results_json(tmp_path, tiny):
    import shutil

    config = replace(tiny, tasks=("recall",), seeds=(0,))
    out = tmp_path / "e"
    first = run_experiment(config, out, progress=False, log=_quiet)
    n = len(first["runs"])
    shutil.rmtree(out / "runs")  # runs/ is not committed; results.json.gz is
    said: list[str] = []
    more = run_experiment(replace(config, seeds=(0, 1)), out, progress=True, reuse=True,
                          log=said.append)
    assert more["reused_runs"] == n and more["trained_runs"] == n
    assert [r["eval"] for r in more["runs"][:n]] == [r["eval"] for r in first["runs"]]
    assert [r["spec"]["seed"] for r in more["runs"][n:]] == [1] * n
    assert f"{2 * n} runs (2 seeds), {n} of them reused; {n} to train, estimated " in said[0]
    assert len(list((out / "runs").glob("*-seed0.json"))) == n
    assert len(list((out / "runs").glob("*-seed1.json"))) == n
    assert more["earlier_seconds"] == pytest.approx(first["sweep_seconds"])
    total = (more["sweep_seconds"] + more["earlier_seconds"]) / 60
    header = (out / "report.md").read_text().split("\n")[2]
    assert f"Wall time of the sweep: {total:.1f} min in all. This invocation trained {n} " \
           in header and f"reused {n} finished one(s)" in header
    # Each invocation's CPU, wall time and runs trained, in order.
    cpu = more["environment"]["cpu"]
    assert [(i["cpu"], i["trained_runs"]) for i in more["invocations"]] == [(cpu, n), (cpu, n)]
    assert more["invocations"][0]["seconds"] == pytest.approx(first["sweep_seconds"])
    assert (f"The invocations that trained runs, in order: {cpu} ({n} run(s), "
            f"{first['sweep_seconds'] / 60:.1f} min); {cpu} ({n} run(s), ") in header
    # Nothing left: no calibration, a zero estimate, every run reused.
    said.clear()
    same = run_experiment(replace(config, seeds=(0, 1)), out, progress=True, reuse=True,
                          log=said.append)
    assert same["trained_runs"] == 0 and same["estimated_seconds"] == 0.0
    assert f"{2 * n} of them reused; 0 to train" in said[0]
    assert [i["trained_runs"] for i in same["invocations"]] == [n, n, 0]
    # A document from before invocations were recorded: its last invocation's CPU, and
    # the earlier ones as one entry without a CPU.
    from relpos.training.experiment.results import results_path
    from relpos.training.experiment.run import _earlier_document, _earlier_invocations

    legacy = load_results(out)
    del legacy["invocations"]
    legacy.update(sweep_seconds=60.0, earlier_seconds=120.0, trained_runs=3)
    (out / "results.json.gz").unlink()
    (out / "results.json").write_text(json.dumps(legacy))  # as sweeps wrote it before
    assert _earlier_invocations(_earlier_document(results_path(out))) == [
        {"cpu": None, "seconds": 120.0, "trained_runs": None},
        {"cpu": legacy["environment"]["cpu"], "seconds": 60.0, "trained_runs": 3}]
    # A plain results.json of an earlier sweep is extended and replaced by results.json.gz.
    shutil.rmtree(out / "runs")
    said.clear()
    kept = run_experiment(replace(config, seeds=(0, 1)), out, progress=False, reuse=True,
                          log=said.append)
    assert kept["trained_runs"] == 0 and kept["reused_runs"] == 2 * n
    assert not (out / "results.json").exists() and load_results(out) == json.loads(
        json.dumps(kept))
    assert f"replaced {out / 'results.json'} of an earlier sweep by " \
           f"{out / 'results.json.gz'}" in said
    # Beside a results.json.gz, a plain results.json is not read, so it is not removed.
    (out / "results.json").write_text(json.dumps(legacy))
    run_experiment(replace(config, seeds=(0, 1)), out, progress=False, reuse=True, log=_quiet)
    assert json.loads((out / "results.json").read_text()) == legacy
    (out / "results.json").unlink()
    # A saved record trained with other settings is retrained, not reused.
    shutil.rmtree(out / "runs")
    other = run_experiment(replace(config, steps=config.steps + 1), out, progress=False,
                           reuse=True, log=_quiet)
    assert other["trained_runs"] == n and other["reused_runs"] == 0


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
    assert env["cpu"] in report and "## The seed's claims, answered" in report
    assert report.index("## The seed's claims, answered") < report.index("Which K to choose")
    assert "Which K to choose" in report and "overall" in report and "subset" in report


def _synthetic(accs: dict[int, tuple[float, float]], count: int = 400) -> dict:
    """A results document of recall runs: K -> (accuracy at d <= 4, at d > 4), 3 seeds,
    the seeds a little apart."""
    runs = []
    for k, (near, far) in accs.items():
        for seed, jitter in enumerate((-0.005, 0.0, 0.005)):
            by = {}
            for d in (2, 12, 16, 24):
                acc = min(1.0, max(0.0, (near if d <= 4 else far) + jitter))
                by[str(d)] = {"accuracy": round(acc * count) / count, "count": count}
            total = sum(v["accuracy"] * v["count"] for v in by.values())
            ev = {"length": 64, "loss": 0.0, "accuracy": total / (4 * count),
                  "count": 4 * count, "by": {"distance": by}}
            runs.append({"spec": {"task": "recall", "positions": "relative", "k": k,
                                  "depth": 1, "seed": seed},
                         "model_label": f"K={k}", "eval": [ev], "train": {"steps": 120}})
    cfg = ExperimentConfig(tasks=("recall",), ks=tuple(accs), depths=(1,), baselines=(),
                           eval_lengths=(64,)).to_dict()
    return {"config": cfg, "chance": {"recall": 0.0625}, "sweep_seconds": 1.0, "runs": runs,
            "environment": {"cpu": "Test CPU", "isa": "AVX2", "threads": 1}}


def _verdict(results: dict, claim: str) -> str:
    return next(r["verdict"] for r in claims(results) if r["claim"].startswith(claim))


def test_verdicts_follow_the_intervals():
    clear = _synthetic({4: (1.0, 0.2), 8: (1.0, 0.5), 16: (1.0, 0.9), 32: (1.0, 0.9),
                        64: (1.0, 0.9)})
    assert _verdict(clear, "K=4 vs K=16") == "yes"
    assert _verdict(clear, "K=16 suffices") == "yes"
    assert _verdict(clear, "K=32 vs K=64") == "yes"
    assert _verdict(clear, "typical K") == "yes"  # K=8 shown short, K=16 shown enough
    flat = _synthetic({4: (1.0, 0.9), 16: (1.0, 0.9), 32: (1.0, 0.6), 64: (1.0, 0.9)})
    assert _verdict(flat, "K=4 vs K=16") == "no"
    assert _verdict(flat, "K=32 vs K=64") == "no"
    assert _verdict(flat, "typical K") == "no"  # K=4 is already enough
    # A 2-point gap with 3 seeds and 400 positions cannot be told from 2 pp: inconclusive.
    close = _synthetic({4: (1.0, 0.88), 16: (1.0, 0.90), 32: (1.0, 0.89), 64: (1.0, 0.90)})
    assert _verdict(close, "K=4 vs K=16") == "inconclusive"
    report = make_report(clear)
    assert "Test CPU" in report and "| inconclusive |" not in report.split("## Synthetic")[0]


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


def test_a_used_out_is_refused_reused_or_replaced(tmp_path, tiny):
    out = tmp_path / "e"
    config = replace(tiny, tasks=("recall",), seeds=(0,))
    said: list[str] = []
    first = run_experiment(config, out, progress=False, log=said.append)
    with pytest.raises(ValueError, match=r"already holds an experiment \(results.json.gz, "
                                         r"report.md, .*3 run files\); reuse=True keeps"):
        run_experiment(config, out, progress=False, log=said.append)
    smaller = replace(config, ks=(4,))
    said.clear()
    kept = run_experiment(smaller, out, progress=False, reuse=True, log=said.append)
    assert [r["eval"] for r in kept["runs"]] == [r["eval"] for r in first["runs"][1:]]
    assert sorted(p.name for p in (out / "runs").iterdir()) == [
        "recall-K4-depth1-seed0.json", "recall-learned-depth1-seed0.json"]
    assert "reused 2 finished run(s)" in said[-2] and "retrained 0" in said[-2]
    assert said[-1].startswith("removed 1 run file")
    said.clear()
    again = run_experiment(config, out, progress=False, overwrite=True, log=said.append)
    assert said[0].startswith(f"replaced the experiment in {out}: removed results.json.gz, "
                              "report.md")
    assert [r["eval"] for r in again["runs"]] == [r["eval"] for r in first["runs"]]
    with pytest.raises(ValueError, match="exclude each other"):
        run_experiment(config, out, progress=False, overwrite=True, reuse=True)


def test_what_would_settle_an_inconclusive_claim():
    from relpos.training.experiment.report import NOT_LEARNED, _to_settle
    from relpos.training.experiment.stats import Interval, t_quantile

    def row(iv, kind="above", unit="pp", thr=0.02, verdict="inconclusive"):
        return {"verdict": verdict, "interval": iv, "kind": kind, "unit": unit,
                "threshold": thr}

    # Seeds set the interval: sd = half * sqrt(n) / t(n - 1); the advice is the fewest
    # seeds whose interval at that sd no longer reaches the threshold.
    n, half = 6, 0.04
    sd = half * n ** 0.5 / t_quantile(n - 1)
    said = _to_settle(row(Interval(0.05, 0.05 - half, 0.05 + half, n, "seeds")))
    need = next(m for m in range(2, 200) if t_quantile(m - 1) * sd / m ** 0.5 < 0.03)
    assert f"about {need} seeds" in said and "within ±5.0 pp" in said
    wide = _to_settle(row(Interval(0.05, -0.05, 0.15, n, "seeds")))
    assert "wider than ±5.0 pp" in wide
    # Positions set it: (half / distance to the threshold)^2 as many.
    said = _to_settle(row(Interval(0.04, 0.0, 0.08, n, "positions")))
    assert "about 4.0x as many" in said
    # A mean on the threshold cannot be decided; "within" measures |mean| against it.
    assert "no number of runs" in _to_settle(row(Interval(0.02, 0.0, 0.04, n)))
    assert "no number of runs" in _to_settle(
        row(Interval(-0.02, -0.04, 0.0, n), kind="within"))
    bits = _to_settle(row(Interval(0.01, -0.02, 0.04, n), kind="within", unit="bits"))
    assert "half-width 0.030 (wider than ±0.020)" in bits
    assert "until the subset is learned" in _to_settle(row(None, verdict=NOT_LEARNED))
    assert "K=8 or a larger K" in _to_settle(
        {"verdict": "inconclusive", "reference": "K=64", "enough": 16, "short": 4})
    # The range claim names what each undecided K between the two would take.
    gap = Interval(0.017, 0.017 - half / 5, 0.017 + half / 5, n, "seeds")
    said = _to_settle({"verdict": "inconclusive", "reference": "K=128", "enough": 16,
                       "short": 4, "undecided": [("K=8", gap)], "threshold": 0.02,
                       "unit": "bits"})
    sd = half / 5 * n ** 0.5 / t_quantile(n - 1)
    need = next(m for m in range(2, 200) if t_quantile(m - 1) * sd / m ** 0.5 < 0.003)
    assert "K=8 shown either way: half-width 0.008 (within ±0.020)" in said
    assert f"about {need} seeds" in said


def test_the_range_claim_names_the_k_it_waits_on():
    from relpos.training.experiment.report import _undecided
    from relpos.training.experiment.stats import Interval

    def iv(mean, half):
        return Interval(mean, mean - half, mean + half, 5, "seeds")

    gaps = {4: ("K=4", iv(0.05, 0.01)), 8: ("K=8", iv(0.02, 0.01)),
            16: ("K=16", iv(0.01, 0.02)), 32: ("K=32", iv(0.0, 0.01)),
            64: ("K=64", iv(0.0, 0.0))}
    # K=8 decides the claim either way: only it is named.
    assert [lab for lab, _ in _undecided(gaps, 32, 4, 0.02)] == ["K=8"]
    # Without an open K=8, every open K between the largest short and the smallest enough.
    assert [lab for lab, _ in _undecided(gaps, 32, 8, 0.02)] == ["K=16"]
    assert [lab for lab, _ in _undecided(gaps, None, None, 0.02)] == ["K=8"]
    gaps[8] = ("K=8", iv(0.05, 0.01))
    assert [lab for lab, _ in _undecided(gaps, None, 8, 0.02)] == ["K=16"]
    assert _undecided(gaps, 16, 8, 0.02) == []


def test_learning_curves_say_whether_the_budget_plateaued():
    results = _synthetic({4: (1.0, 0.2), 16: (1.0, 0.9), 64: (1.0, 0.9)})
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
    from relpos.training.experiment.report import _seed_text
    from relpos.training.experiment.run import default_command

    assert _seed_text(cfg.to_dict()) == "4 seeds (0-3) for recall, agree and 2 (0, 5) for pysrc"
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


def test_results_documents_are_read_compressed_or_plain(tmp_path):
    import gzip

    from relpos.training.experiment.results import results_bytes

    doc = {"format_version": 2, "runs": [{"eval": [{"bpc": 1.5}]}]}
    data = results_bytes(doc)
    assert data == results_bytes(dict(doc)) and data[:2] == b"\x1f\x8b"  # no time stamp
    assert json.loads(gzip.decompress(data)) == doc
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "results.json.gz").write_bytes(data)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text(json.dumps(doc))
    for where in ("new", "new/results.json.gz", "old", "old/results.json"):
        assert load_results(tmp_path / where) == doc
    # Told apart by content: a plain document under the new name is read too.
    (tmp_path / "plain.gz").write_text(json.dumps(doc))
    assert load_results(tmp_path / "plain.gz") == doc
    with pytest.raises(FileNotFoundError, match=r"holds no results document \(results"
                       r".json.gz or results.json\)"):
        load_results(tmp_path)
    (tmp_path / "bad.gz").write_bytes(data[:20])
    with pytest.raises(ValueError, match=r"bad\.gz' is not a results document"):
        load_results(tmp_path / "bad.gz")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        load_results(tmp_path / "list.json")


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
    from relpos.training.experiment.report import _signal_summary

    row = next(r for r in _signal_summary(results)[1]
               if r["claim"].startswith("clipping beats"))
    assert row["interval"].n == 4 and row["measured"].endswith(" over 4 seeds")
    fewer = {**results, "runs": [r for r in results["runs"] if r["spec"]["seed"] < 2],
             "config": {**results["config"], "code_extra_seeds": [],
                        "code_extra_models": []}}
    row = next(r for r in _signal_summary(fewer)[1]
               if r["claim"].startswith("clipping beats"))
    assert row["interval"].n == 2 and "over" not in row["measured"]
