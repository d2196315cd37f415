"""Training loop, checkpoints (round trip, crash safety), exact resume and CLI errors."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from relpos.cli import main
from relpos.models import ModelConfig, build_model
from relpos.training import TrainConfig, load_checkpoint, lr_at, save_checkpoint, train
from relpos.training import checkpoint as ckpt_mod
from relpos.training.checkpoint import CheckpointError, rng_state
from relpos.training.tasks import OffsetRecall

TASK = OffsetRecall((1, 2, 4), num_symbols=8)


def _tiny(k: int = 4, **kw) -> ModelConfig:
    return ModelConfig(
        vocab_size=TASK.vocab_size, d_model=16, num_layers=1, num_heads=2, max_distance=k, **kw
    )


def _cfg(**kw) -> TrainConfig:
    base = {
        "steps": 8,
        "batch_size": 4,
        "length": 16,
        "warmup": 2,
        "eval_lengths": (16,),
        "eval_tokens": 64,
    }
    base.update(kw)
    return TrainConfig(**base)


def test_lr_schedule():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))


def test_tiny_model_learns_offset_recall_within_k():
    torch.set_num_threads(1)
    cfg = ModelConfig(
        vocab_size=TASK.vocab_size, d_model=32, num_layers=1, num_heads=2, max_distance=6
    )
    _, metrics = train(
        cfg,
        TASK,
        TrainConfig(
            steps=120,
            batch_size=16,
            length=32,
            lr=1e-2,
            warmup=10,
            eval_lengths=(32,),
            eval_tokens=2048,
        ),
        progress=False,
    )
    by = metrics["eval"][0]["by"]["distance"]
    assert set(by) == {"1", "2", "4"}
    for d, v in by.items():
        assert v["accuracy"] > 0.9, (d, v)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _save(tmp_path, model, opt, step):
    return save_checkpoint(
        tmp_path,
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        rng_state=rng_state(),
        state={"step": step, "model": {}, "history": {}},
    )


def _model_and_optimizer():
    torch.manual_seed(0)
    model = build_model(_tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, TASK.vocab_size, (2, 16))
    model(ids).sum().backward()
    opt.step()
    return model, opt


def test_checkpoint_round_trip_is_exact(tmp_path):
    model, opt = _model_and_optimizer()
    torch.manual_seed(123)
    _save(tmp_path, model, opt, step=5)
    expected_rng = torch.rand(3)
    ck = load_checkpoint(tmp_path)
    assert ck.step == 5
    fresh = build_model(_tiny())
    fresh.load_state_dict(ck.model_state)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    opt2.load_state_dict(ck.optimizer_state)
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for i, st in a["state"].items():
        for name, value in st.items():
            assert torch.equal(value, b["state"][i][name]), (i, name)
    torch.set_rng_state(ck.rng_state["torch"])
    assert torch.equal(torch.rand(3), expected_rng)


@pytest.mark.parametrize("fail_at", ["replace", "write"])
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, fail_at):
    model, opt = _model_and_optimizer()
    _save(tmp_path, model, opt, step=1)
    before = _state(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if fail_at == "replace":

        def boom(*args, **kwargs):
            raise OSError("simulated crash in os.replace")

        monkeypatch.setattr(ckpt_mod.os, "replace", boom)
    else:
        real = ckpt_mod._write_synced

        def half(path, data):
            if path.name == ckpt_mod.OPTIMIZER_FILE:  # the model file is already written
                path.write_bytes(data[: len(data) // 2])
                raise OSError("simulated crash while writing")
            real(path, data)

        monkeypatch.setattr(ckpt_mod, "_write_synced", half)
    with pytest.raises(OSError, match="simulated crash"):
        _save(tmp_path, model, opt, step=2)
    monkeypatch.undo()
    ck = load_checkpoint(tmp_path)
    assert ck.step == 1
    for k, v in before.items():
        assert torch.equal(ck.model_state[k], v), k
    # The next save works and leaves no temporary directories behind.
    _save(tmp_path, model, opt, step=3)
    assert load_checkpoint(tmp_path).step == 3
    assert not list(tmp_path.glob(".tmp-*"))


def test_damaged_checkpoint_is_detected(tmp_path):
    model, opt = _model_and_optimizer()
    step_dir = _save(tmp_path, model, opt, step=1)
    data = bytearray((step_dir / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (step_dir / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its hash"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nothing")


class _Crash(Exception):
    pass


def test_resume_equals_uninterrupted(tmp_path):
    cfg = _cfg(steps=10, checkpoint_every=4, eval_every=3)
    full, full_metrics = train(_tiny(), TASK, cfg, out_dir=tmp_path / "a", progress=False)

    def crash(step, stats):
        if step == 6:  # after the checkpoint of step 4, before the one of step 8
            raise _Crash

    with pytest.raises(_Crash):
        train(_tiny(), TASK, cfg, out_dir=tmp_path / "b", progress=False, on_step=crash)
    assert load_checkpoint(tmp_path / "b" / "checkpoints").step == 4
    resumed, metrics = train(
        _tiny(), TASK, cfg, out_dir=tmp_path / "b", resume=True, progress=False
    )
    assert metrics["resumed_from"] == 4
    for k, v in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    assert metrics["history"]["train"] == full_metrics["history"]["train"]
    assert metrics["eval"] == full_metrics["eval"]
    on_disk = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert on_disk["history"]["train"] == full_metrics["history"]["train"]


def test_resume_rejects_an_incompatible_config(tmp_path):
    train(_tiny(), TASK, _cfg(steps=2), out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"max_distance 4 \(checkpoint\) vs 8"):
        train(_tiny(k=8), TASK, _cfg(steps=2), out_dir=tmp_path, resume=True, progress=False)


def _one_error_line(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("relpos: error:"), err
    assert match in err, err


def test_cli_bad_input(capsys, tmp_path):
    _one_error_line(capsys, ["train", "--task", "nope"], "unknown task 'nope'")
    _one_error_line(capsys, ["train", "-k", "-1"], "must be an int >= 0")
    _one_error_line(capsys, ["train", "--text", str(tmp_path / "missing.txt")], "does not exist")
    _one_error_line(
        capsys,
        [
            "train",
            "--task",
            "sort",
            "--bidirectional",
            "--steps",
            "1",
            "--out",
            str(tmp_path / "s"),
        ],
        "bidirectional",
    )
    _one_error_line(capsys, ["train", "--resume", "--out", str(tmp_path / "none")], "no checkpoint")
    out = str(tmp_path / "run")
    small = [
        "train",
        "--task",
        "recall",
        "--distances",
        "1,2",
        "--length",
        "8",
        "--steps",
        "2",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--no-progress",
        "--out",
        out,
    ]
    assert main([*small, "-k", "2"]) == 0
    capsys.readouterr()
    _one_error_line(capsys, [*small, "-k", "3", "--resume"], "different configuration")


def test_cli_train_writes_metrics_and_text_task(capsys, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "run"
    argv = [
        "train",
        "--text",
        str(text),
        "--length",
        "16",
        "--steps",
        "3",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"]["name"] == "text" and len(metrics["history"]["train"]) == 3
    assert load_checkpoint(out / "checkpoints").step == 3


def test_cli_error_in_a_subprocess():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "relpos", "train", "--task", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "relpos: error: unknown task 'nope'; allowed: recall, agree, sort, text"
    ]


# --- settings that train NaN models are refused -------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("lr", float("inf"), "lr must be finite and > 0, got inf"),
        ("weight_decay", float("nan"), "weight_decay must be finite and >= 0, got nan"),
        ("weight_decay", -1.0, "weight_decay must be finite and >= 0, got -1.0"),
        ("weight_decay", float("inf"), "weight_decay must be finite and >= 0, got inf"),
        ("grad_clip", float("nan"), "grad_clip must be finite and >= 0, got nan"),
        ("grad_clip", -1.0, "grad_clip must be finite and >= 0"),
        ("schedule_steps", 0, "schedule_steps must be an int >= 1 or None, got 0"),
    ],
)
def test_train_config_rejects_values_that_train_nan(field, value, fragment):
    with pytest.raises(ValueError) as info:
        TrainConfig(**{field: value})
    assert fragment in str(info.value)


def test_weight_decay_type_is_checked():
    with pytest.raises(TypeError, match=r"weight_decay must be a float, got '0\.1'"):
        TrainConfig(weight_decay="0.1")  # type: ignore[arg-type]


# --- resuming for longer: the schedule of the run stays -----------------------------------


def test_lr_holds_the_floor_after_the_schedule():
    cfg = TrainConfig(steps=200, schedule_steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert cfg.schedule == 100
    short = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(100)] == [lr_at(s, short) for s in range(100)]
    assert all(lr_at(s, cfg) == pytest.approx(0.1) for s in range(100, 200))
    assert TrainConfig(steps=5, schedule_steps=5).schedule_steps is None
    assert "schedule_steps" not in TrainConfig().to_dict()  # as written before the field


def test_resume_with_more_steps_equals_an_uninterrupted_run_of_that_schedule(tmp_path):
    short = _cfg(steps=4, checkpoint_every=2)
    train(_tiny(), TASK, short, out_dir=tmp_path / "a", progress=False)
    longer = _cfg(steps=7, checkpoint_every=2, schedule_steps=4)
    resumed, metrics = train(_tiny(), TASK, longer, out_dir=tmp_path / "a", resume=True,
                             progress=False)
    full, full_metrics = train(_tiny(), TASK, longer, out_dir=tmp_path / "b", progress=False)
    assert metrics["resumed_from"] == 4 and len(metrics["history"]["train"]) == 7
    for k, v in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k
    assert metrics["history"]["train"] == full_metrics["history"]["train"]
    assert load_checkpoint(tmp_path / "a" / "checkpoints").state["train"]["schedule_steps"] == 4


def test_resume_with_more_steps_and_another_schedule_is_refused(tmp_path):
    train(_tiny(), TASK, _cfg(steps=2), out_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"schedule over 2 steps \(checkpoint\) vs 5.*"
                                         r"TrainConfig\(steps=5, schedule_steps=2\)"):
        train(_tiny(), TASK, _cfg(steps=5), out_dir=tmp_path, resume=True, progress=False)
    with pytest.raises(ValueError, match="the checkpoint is at step 2, beyond the 1 steps"):
        train(_tiny(), TASK, _cfg(steps=1, schedule_steps=2), out_dir=tmp_path, resume=True,
              progress=False)


# --- an output directory holds one run ----------------------------------------------------


def test_train_refuses_a_used_out_dir_and_overwrite_replaces_it(tmp_path):
    train(_tiny(), TASK, _cfg(steps=4, checkpoint_every=2), out_dir=tmp_path, progress=False)
    old = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoints, metrics.json\); "
                                         "resume=True continues it, overwrite=True replaces it"):
        train(_tiny(), TASK, _cfg(steps=2), out_dir=tmp_path, progress=False)
    _, metrics = train(_tiny(k=2), TASK, _cfg(steps=2), out_dir=tmp_path, progress=False,
                       overwrite=True)
    new = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert not set(old) & set(new) - {"latest.json"}  # no step directory of the old run
    assert [p for p in new if p.startswith("step-")] and len(new) == 2
    assert load_checkpoint(tmp_path / "checkpoints").state["model"]["max_distance"] == 2
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 2 == metrics["steps"]


# --- relpos train --resume reads the saved configuration ------------------------------------

SMALL = ["--task", "recall", "--distances", "1,2", "--length", "8", "--steps", "3",
         "--batch-size", "4", "--d-model", "16", "--heads", "2", "--layers", "1", "-k", "2",
         "--per-head", "--lr", "0.005", "--warmup", "1", "--checkpoint-every", "2",
         "--no-progress"]


def test_cli_resume_needs_no_options_and_extends_with_steps(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--out", str(out)]) == 0
    assert main(["train", "--resume", "--no-progress", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"{out} already finished 3 steps; pass --steps N > 3 to train longer" in said
    # Agreeing options are fine; a larger --steps trains on, on the run's schedule.
    assert main(["train", "--resume", "-k", "2", "--per-head", "--steps", "5",
                 "--no-progress", "--out", str(out)]) == 0
    assert (f"resuming {out} at step 3 of 5: its learning-rate schedule ended at step 3, so "
            "steps 4-5 train at its floor rate, 0.0005") in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from"] == 3 and len(metrics["history"]["train"]) == 5
    saved = load_checkpoint(out / "checkpoints").state
    assert saved["step"] == 5 and saved["train"]["schedule_steps"] == 3
    assert saved["model"]["max_distance"] == 2 and saved["model"]["share_heads"] is False
    assert saved["train"]["lr"] == 0.005 and saved["train"]["warmup"] == 1
    # The same as training 5 steps on a 3-step schedule in one go.
    full = tmp_path / "full"
    model_cfg = ModelConfig.from_dict(saved["model"])
    cfg = TrainConfig.from_dict({**saved["train"], "eval_every": 0})
    _, want = train(model_cfg, OffsetRecall((1, 2)), cfg, out_dir=full, progress=False)
    assert metrics["history"]["train"] == want["history"]["train"]


def test_cli_overwrite_replaces_the_run_and_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["train", *SMALL, "-k", "1", "--overwrite", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"--overwrite: removed the previous run's checkpoints, metrics.json from {out}" in said
    assert load_checkpoint(out / "checkpoints").state["model"]["max_distance"] == 1
    assert len([p for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")]) == 2


def test_resume_from_an_earlier_parameter_layout_is_refused_clearly(tmp_path):
    """relpos <= 0.1 saved q_proj/k_proj/v_proj linears: the weights convert on load, the
    optimizer state (one entry per old parameter) cannot."""
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    train(_tiny(), TASK, _cfg(steps=4, checkpoint_every=2), out_dir=tmp_path, progress=False)
    step = load_checkpoint(tmp_path / "checkpoints").path
    weights = st_load((step / "model.safetensors").read_bytes())
    for key in [k for k in weights if k.endswith(("in_proj_weight", "in_proj_bias"))]:
        prefix, kind = key.rsplit(".", 1)
        for name, part in zip(("q_proj", "k_proj", "v_proj"), weights.pop(key).chunk(3),
                              strict=True):
            weights[f"{prefix}.{name}.{'weight' if kind.endswith('weight') else 'bias'}"] = part
    data = st_save(weights)
    (step / "model.safetensors").write_bytes(data)
    state = json.loads((step / "state.json").read_text())
    state["files"]["model.safetensors"] = hashlib.sha256(data).hexdigest()
    (step / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="its weights use an earlier parameter layout"):
        train(_tiny(), TASK, _cfg(steps=6, schedule_steps=4), out_dir=tmp_path, resume=True,
              progress=False)
