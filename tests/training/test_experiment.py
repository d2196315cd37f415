"""The K sweep: plan, files, reproducibility, and a report computed from the numbers."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from relpos.cli import main
from relpos.training.experiment import ExperimentConfig, claims, make_report, plan, run_experiment


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


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


def test_sweep_writes_everything_and_reproduces(tmp_path, tiny):
    a = run_experiment(tiny, tmp_path / "a", progress=False, log=_quiet)
    b = run_experiment(tiny, tmp_path / "b", progress=False, log=_quiet)
    assert [r["eval"] for r in a["runs"]] == [r["eval"] for r in b["runs"]]
    assert [r.get("signal") for r in a["runs"]] == [r.get("signal") for r in b["runs"]]
    names = {p.name for p in (tmp_path / "a").iterdir()}
    assert {"results.json", "report.md", "heatmap_recall.png", "extrapolation_recall.png",
            "heatmap_pysrc.png", "bpc_pysrc.png", "extrapolation_pysrc.png",
            "signal_pysrc.png", "runs"} <= names
    saved = json.loads((tmp_path / "a" / "results.json").read_text())
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
    assert env["cpu"] in report and "## The seed's claims, measured" in report
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
                         "model_label": f"K={k}", "eval": [ev]})
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
    with pytest.raises(ValueError, match=r"already holds an experiment \(results.json, "
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
    assert said[0].startswith(f"replaced the experiment in {out}: removed results.json, "
                              "report.md")
    assert [r["eval"] for r in again["runs"]] == [r["eval"] for r in first["runs"]]
    with pytest.raises(ValueError, match="exclude each other"):
        run_experiment(config, out, progress=False, overwrite=True, reuse=True)
