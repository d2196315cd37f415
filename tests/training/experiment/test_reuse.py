"""An output directory that holds an experiment (relpos.training.experiment.reuse): refused,
reused or replaced, and a sweep extended from its results document alone."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from relpos.training.experiment import load_results, run_experiment
from relpos.training.experiment.results import results_path
from relpos.training.experiment.reuse import earlier_document, earlier_invocations


def _quiet(s: str) -> None:
    pass


def test_a_cloned_sweep_is_extended_from_its_results_json(tmp_path, tiny):
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
    legacy = load_results(out)
    del legacy["invocations"]
    legacy.update(sweep_seconds=60.0, earlier_seconds=120.0, trained_runs=3)
    (out / "results.json.gz").unlink()
    (out / "results.json").write_text(json.dumps(legacy))  # as sweeps wrote it before
    assert earlier_invocations(earlier_document(results_path(out))) == [
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
