"""``relpos export-onnx`` on what ``relpos train --out DIR`` wrote, and its failures as one
line. Needs the ``onnx`` extra (skipped without it)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from relpos.cli import main

RUN = ["--task", "recall", "--distances", "1,2", "--length", "8", "--steps", "2",
       "--batch-size", "4", "--d-model", "16", "--heads", "2", "--layers", "1", "-k", "2",
       "--no-progress"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    for name in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(name)
    out = tmp_path_factory.mktemp("export") / "run"
    before = torch.get_num_threads()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", *RUN, "--out", str(out)]) == 0
    torch.set_num_threads(before)
    return out


def test_the_train_out_directory_is_found(run_dir, capsys):
    assert main(["export-onnx", str(run_dir), "--check"]) == 0
    out = capsys.readouterr().out
    target = run_dir.with_suffix(".onnx")
    assert f"wrote {target}" in out and out.rstrip().endswith("ok")
    assert target.is_file()


def test_a_failing_check_is_one_line(run_dir, tmp_path, monkeypatch, capsys):
    import relpos.export

    def fake_export(module, path, **kwargs):
        Path(path).write_bytes(b"not onnx")
        return Path(path)

    def failing_check(*args, **kwargs):
        # onnxruntime's errors derive from Exception only, and span lines.
        raise Exception("[ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model failed:\nmore")

    monkeypatch.setattr(relpos.export, "export_onnx", fake_export)
    monkeypatch.setattr(relpos.export, "check_onnx", failing_check)
    target = tmp_path / "m.onnx"
    assert main(["export-onnx", str(run_dir), "-o", str(target), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"relpos: error: --check: onnxruntime could not run '{target}': "
                          "[ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model failed: more")
