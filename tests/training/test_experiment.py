"""The K sweep: files, reproducibility, and a report computed from the numbers."""

from __future__ import annotations

import json

import pytest
import torch

from relpos.cli import main
from relpos.training.experiment import ExperimentConfig, make_report, plan, run_experiment

TINY = ExperimentConfig(
    tasks=("recall",),
    ks=(0, 4),
    depths=(1,),
    baselines=("learned",),
    train_length=40,
    eval_lengths=(40, 80),
    steps=3,
    batch_size=4,
    d_model=16,
    num_heads=2,
    eval_tokens=400,
    preset="custom",
)


@pytest.fixture(autouse=True)
def _one_thread():
    # Training is reproducible per thread count; one thread is also fastest on a busy machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_plan_covers_the_default_grid():
    runs = plan(ExperimentConfig())
    assert len(runs) == 2 * 2 * (8 + 2)
    assert {r.k for r in runs if r.positions == "relative"} == {0, 1, 2, 4, 8, 16, 32, 64}
    assert {r.positions for r in runs} == {"relative", "learned", "sinusoidal"}


def test_sweep_writes_everything_and_reproduces(tmp_path):
    a = run_experiment(TINY, tmp_path / "a", progress=False, log=lambda s: None)
    b = run_experiment(TINY, tmp_path / "b", progress=False, log=lambda s: None)
    assert [r["eval"] for r in a["runs"]] == [r["eval"] for r in b["runs"]]
    names = {p.name for p in (tmp_path / "a").iterdir()}
    assert {
        "results.json",
        "report.md",
        "heatmap_recall.png",
        "extrapolation_recall.png",
        "runs",
    } <= names
    report = (tmp_path / "a" / "report.md").read_text()
    # The overall accuracy of each run at each length appears in the report.
    for run in a["runs"]:
        for ev in run["eval"]:
            assert f"{100 * ev['accuracy']:.1f}%" in report
    saved = json.loads((tmp_path / "a" / "results.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(a["runs"]))


def _fake(acc_k4: float, acc_k16: float, acc_k32: float, acc_k64: float) -> dict:
    def run(k, acc):
        by = {str(d): {"accuracy": acc if d > 4 else 1.0, "count": 100} for d in (2, 12, 16)}
        ev = {"length": 64, "loss": 0.0, "accuracy": acc, "count": 300, "by": {"distance": by}}
        return {
            "spec": {"task": "recall", "positions": "relative", "k": k, "depth": 1},
            "model_label": f"K={k}",
            "eval": [ev],
        }

    cfg = ExperimentConfig(
        tasks=("recall",), ks=(4, 16, 32, 64), depths=(1,), baselines=(), eval_lengths=(64,)
    ).to_dict()
    return {
        "config": cfg,
        "chance": {"recall": 0.0625},
        "sweep_seconds": 1.0,
        "runs": [run(4, acc_k4), run(16, acc_k16), run(32, acc_k32), run(64, acc_k64)],
    }


def _claim_row(report: str, claim: str) -> str:
    return next(line for line in report.splitlines() if line.startswith(f"| {claim}"))


def test_report_verdicts_follow_the_numbers():
    report = make_report(_fake(0.2, 0.9, 0.9, 0.905))
    assert _claim_row(report, "K=4 vs K=16").endswith("| yes |")
    assert "+70.0 pp" in _claim_row(report, "K=4 vs K=16")
    assert _claim_row(report, "K=32 vs K=64").endswith("| yes |")
    report = make_report(_fake(0.9, 0.9, 0.5, 0.9))
    assert _claim_row(report, "K=4 vs K=16").endswith("| no |")
    assert _claim_row(report, "K=32 vs K=64").endswith("| no |")
    assert "K=4 vs K=16 on all distances: 90.0% vs 90.0% (+0.0 pp)" in report


def test_cli_rejects_unknown_experiment_task(capsys):
    assert main(["experiment", "--tasks", "recall,nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown task" in err


@pytest.mark.parametrize("bad", [["--ks", "4,-1"], ["--depths", "0"]])
def test_cli_rejects_bad_sweep_values(capsys, bad):
    assert main(["experiment", *bad]) == 2
    assert capsys.readouterr().err.startswith("relpos: error:")


def test_a_used_out_is_refused_reused_or_replaced(tmp_path):
    from dataclasses import replace

    said: list[str] = []
    first = run_experiment(TINY, tmp_path, progress=False, log=said.append)
    with pytest.raises(ValueError, match=r"already holds an experiment \(results.json, "
                                         r"report.md, .*3 run files\); reuse=True keeps"):
        run_experiment(TINY, tmp_path, progress=False, log=said.append)
    # --reuse with a smaller sweep: the finished runs are kept, the one left out is removed.
    smaller = replace(TINY, ks=(4,))
    said.clear()
    kept = run_experiment(smaller, tmp_path, progress=False, reuse=True, log=said.append)
    assert [r["eval"] for r in kept["runs"]] == [r["eval"] for r in first["runs"][1:]]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
        "recall-K4-depth1.json", "recall-learned-depth1.json"]
    assert "reused 2 finished run(s)" in said[-2] and "retrained 0" in said[-2]
    assert said[-1].startswith("removed 1 run file") and "runs/recall-K0-depth1.json" in said[-1]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["spec"]["k"] for r in saved["runs"]] == [4, 0]
    # --overwrite: everything of the old sweep goes first, and that is said.
    said.clear()
    again = run_experiment(TINY, tmp_path, progress=False, overwrite=True, log=said.append)
    assert said[0].startswith(f"replaced the experiment in {tmp_path}: removed results.json, "
                              "report.md")
    assert [r["eval"] for r in again["runs"]] == [r["eval"] for r in first["runs"]]
    with pytest.raises(ValueError, match="exclude each other"):
        run_experiment(TINY, tmp_path, progress=False, overwrite=True, reuse=True)
