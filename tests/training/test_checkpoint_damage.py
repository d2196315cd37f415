"""Damaged but hash-consistent checkpoints: every one is refused with a CheckpointError that
names the file and what is wrong, and on the command line (``train --resume``,
``export-onnx``) with one line on stderr and exit status 2, never a traceback.

Each damage is applied to a copy of a checkpoint of a tiny real training run (step 2 of 4),
after which the hashes in ``state.json`` are recomputed, so only the structure is wrong.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from relpos.cli import main
from relpos.models import ModelConfig
from relpos.training import CheckpointError, TrainConfig, load_checkpoint, train
from relpos.training.tasks import OffsetRecall

# The run, as command-line options and as the API's configs (the same run).
RUN = ["--task", "recall", "--distances", "1,2", "--length", "8", "--steps", "4",
       "--batch-size", "4", "--d-model", "16", "--heads", "2", "--layers", "1",
       "--checkpoint-every", "2", "--eval-every", "0", "--no-progress"]
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.safetensors", "optimizer.safetensors", "state.json"


def _quiet_main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """``relpos train --out RUN`` of 4 steps with checkpoints at steps 2 and 4, its manifest
    pointed back at step 2 (as if killed after step 3)."""
    out = tmp_path_factory.mktemp("run") / "run"
    torch.set_num_threads(1)
    code, err = _quiet_main(["train", *RUN, "--out", str(out)])
    assert code == 0, err
    root = out / "checkpoints"
    step2 = next(root.glob("step-00000002-*")).name
    (root / "latest.json").write_text(json.dumps({"format_version": 1, "checkpoint": step2}))
    return out


def _api_configs(out: Path) -> tuple[ModelConfig, OffsetRecall, TrainConfig]:
    state = json.loads(next((out / "checkpoints").glob("step-00000002-*/state.json")).read_text())
    return (ModelConfig.from_dict(state["model"]), OffsetRecall((1, 2)),
            TrainConfig.from_dict(state["train"]))


# --- damages: each edits the step directory (then the hashes are recomputed) --------------

Doc = dict


def _edit_state(change: Callable[[Doc], object]) -> Callable[[Path], None]:
    def damage(step: Path) -> None:
        document = json.loads((step / STATE_FILE).read_text())
        result = change(document)
        (step / STATE_FILE).write_text(json.dumps(document if result is None else result))

    return damage


def _edit_tensors(name: str, change: Callable[[dict[str, torch.Tensor]], None]):
    def damage(step: Path) -> None:
        tensors = st_load((step / name).read_bytes())
        change(tensors)
        (step / name).write_bytes(st_save(tensors))

    return damage


def _truncate(name: str) -> Callable[[Path], None]:
    def damage(step: Path) -> None:
        data = (step / name).read_bytes()
        (step / name).write_bytes(data[: len(data) // 2])

    return damage


def _first(tensors: dict[str, torch.Tensor], suffix: str) -> str:
    return next(k for k in tensors if k.endswith(suffix))


def _rename_weight(t: dict[str, torch.Tensor]) -> None:
    t["bogus.weight"] = t.pop(next(iter(t)))


def _drop_weight(t: dict[str, torch.Tensor]) -> None:
    del t[next(iter(t))]


def _misshape_weight(t: dict[str, torch.Tensor]) -> None:
    t[next(k for k, v in t.items() if v.dim() == 2)] = torch.zeros(3)


def _misshape_exp_avg(t: dict[str, torch.Tensor]) -> None:
    t[_first(t, ".exp_avg")] = torch.zeros(5, 5)


def _float_rng(t: dict[str, torch.Tensor]) -> None:
    t["rng.torch"] = torch.zeros(3)


def _short_rng(t: dict[str, torch.Tensor]) -> None:
    t["rng.torch"] = torch.zeros(10, dtype=torch.uint8)


def _drop_rng(t: dict[str, torch.Tensor]) -> None:
    del t["rng.torch"]


def _drop_param_id(d: Doc) -> None:
    d["optimizer"]["param_groups"][0]["params"].pop()


def _rehash(step: Path) -> None:
    document = json.loads((step / STATE_FILE).read_text())
    files = document.get("files") if isinstance(document, dict) else None
    if isinstance(files, dict) and set(files) == {MODEL_FILE, OPTIMIZER_FILE}:
        files.update({n: hashlib.sha256((step / n).read_bytes()).hexdigest() for n in files})
        (step / STATE_FILE).write_text(json.dumps(document))


# (name, damage, fragment of the error, fragment of export-onnx's error or None where it
# exports: it reads the weights only). Every one of them ended in a traceback (or a run that
# went on with bad state) before.
DAMAGES: list[tuple[str, Callable[[Path], None], str, str | None]] = [
    ("model file truncated", _truncate(MODEL_FILE), "not a readable safetensors file", ""),
    ("optimizer file truncated", _truncate(OPTIMIZER_FILE), "not a readable safetensors file",
     ""),
    ("state.json a list", _edit_state(lambda d: [d]), "expected a JSON object, got a list", ""),
    ("state.json without optimizer", _edit_state(lambda d: d.pop("optimizer") and None),
     "missing 'optimizer'", ""),
    ("files an empty list", _edit_state(lambda d: d.update(files=[])),
     "'files' must map model.safetensors and optimizer.safetensors", ""),
    ("optimizer a list", _edit_state(lambda d: d.update(optimizer=[])),
     "'optimizer' must hold 'param_groups'", ""),
    ("optimizer tensor of no parameter", _edit_state(_drop_param_id), "unexpected tensor 'state.",
     ""),
    ("optimizer state misshapen", _edit_tensors(OPTIMIZER_FILE, _misshape_exp_avg),
     "optimizer state 'exp_avg' of parameter", None),
    ("RNG state float", _edit_tensors(OPTIMIZER_FILE, _float_rng),
     "RNG state 'rng.torch' must be a 1-D uint8 tensor", ""),
    ("RNG state short", _edit_tensors(OPTIMIZER_FILE, _short_rng),
     "RNG state 'rng.torch' has 10 bytes", ""),
    ("RNG state missing", _edit_tensors(OPTIMIZER_FILE, _drop_rng), "no torch RNG state", None),
    ("weight renamed", _edit_tensors(MODEL_FILE, _rename_weight), "unexpected 'bogus.weight'",
     'Unexpected key(s) in state_dict: "bogus.weight"'),
    ("weight missing", _edit_tensors(MODEL_FILE, _drop_weight),
     "its weights do not fit the model: missing", "Missing key(s) in state_dict"),
    ("weight misshapen", _edit_tensors(MODEL_FILE, _misshape_weight), "of shape (3,)",
     "copying a param with shape torch.Size([3])"),
    ("history a list", _edit_state(lambda d: d.update(history=[])),
     "'history' must hold 'train' and 'eval' lists", None),
]
# export-onnx says what load_checkpoint says ("" = the same fragment) or what PyTorch's
# load_state_dict says, on one line.
EXPORT = [(d[1], d[3] or d[2]) for d in DAMAGES if d[3] is not None]
EXPORT_IDS = [d[0] for d in DAMAGES if d[3] is not None]
IDS = [d[0] for d in DAMAGES]


def _damaged(finished_run: Path, tmp_path: Path, damage: Callable[[Path], None]) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    step = out / "checkpoints" / json.loads((out / "checkpoints" / "latest.json").read_text())[
        "checkpoint"]
    damage(step)
    _rehash(step)
    return out


def test_the_run_resumes_when_undamaged(finished_run, tmp_path):
    out = _damaged(finished_run, tmp_path, lambda step: None)
    code, err = _quiet_main(["train", *RUN, "--resume", "--out", str(out)])
    assert code == 0, err
    assert load_checkpoint(out / "checkpoints").step == 4


@pytest.mark.parametrize(("damage", "fragment"), [d[1:3] for d in DAMAGES], ids=IDS)
def test_api_resume_raises_checkpoint_error(finished_run, tmp_path, damage, fragment):
    out = _damaged(finished_run, tmp_path, damage)
    model, task, config = _api_configs(finished_run)
    with pytest.raises(CheckpointError) as info:
        train(model, task, config, out_dir=out, resume=True, progress=False)
    assert fragment in str(info.value) and "damaged checkpoint" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("damage", "fragment"), [d[1:3] for d in DAMAGES], ids=IDS)
def test_cli_resume_is_one_line(finished_run, tmp_path, damage, fragment):
    out = _damaged(finished_run, tmp_path, damage)
    code, err = _quiet_main(["train", *RUN, "--resume", "--out", str(out)])
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("relpos: error: damaged checkpoint"), err
    assert fragment in err, err


@pytest.mark.parametrize(("damage", "fragment"), EXPORT, ids=EXPORT_IDS)
def test_cli_export_is_one_line(finished_run, tmp_path, damage, fragment):
    if any(importlib.util.find_spec(m) is None for m in ("onnx", "onnxscript", "onnxruntime")):
        pytest.skip("needs the onnx extra")
    out = _damaged(finished_run, tmp_path, damage)
    target = tmp_path / "m.onnx"
    code, err = _quiet_main(["export-onnx", str(out / "checkpoints"), "-o", str(target)])
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("relpos: error: "), err
    assert fragment in err, err
    assert not target.exists()


@pytest.mark.parametrize(
    ("manifest", "fragment"),
    [
        ({"format_version": 1, "checkpoint": "../../elsewhere"}, "damaged checkpoint manifest"),
        ({"format_version": 1, "checkpoint": 7}, "damaged checkpoint manifest"),
    ],
    ids=["a path outside", "not a name"],
)
def test_damaged_manifest(finished_run, tmp_path, manifest, fragment):
    out = _damaged(finished_run, tmp_path, lambda step: None)
    (out / "checkpoints" / "latest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=fragment):
        load_checkpoint(out / "checkpoints")
