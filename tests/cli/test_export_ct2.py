"""``relpos export-ct2`` on a saved module file and on what ``relpos train --text`` wrote, its
``--check`` output, and its failures as one line (exit status 2)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("ctranslate2")

from relpos.cli import main
from relpos.export import save_module
from relpos.models import (
    ModelConfig,
    RelativeTransformerEncoderModel,
    RelativeTransformerLM,
)

TEXT = "the cat sat on the mat.\nthe dog ran to the sun;\ta bird sang in the tree.\n" * 4
RUN = ["--length", "8", "--steps", "2", "--batch-size", "4", "--d-model", "16", "--heads",
       "2", "--layers", "1", "-k", "2", "--eval-every", "0", "--no-progress"]


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ct2")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    before = torch.get_num_threads()
    code, _, err = _run(["train", "--text", str(root / "text.txt"), *RUN,
                         "--out", str(root / "run")])
    torch.set_num_threads(before)
    assert code == 0, err
    return root / "run"


def _module_file(tmp_path: Path, model=None) -> Path:
    torch.manual_seed(0)
    model = model or RelativeTransformerLM(ModelConfig(vocab_size=19, d_model=16, num_heads=2,
                                                       num_layers=1, max_distance=3))
    return save_module(model, tmp_path / "lm.pt")


def test_a_text_run_exports_with_its_characters(text_run, tmp_path):
    target = tmp_path / "lm-ct2"
    code, out, err = _run(["export-ct2", str(text_run), "-o", str(target), "--check"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"wrote {target}"
    assert lines[1].startswith("check: batch 1 (prompt lengths 7): max |log-prob diff| = ")
    assert lines[2].startswith("check: ragged batch (prompt lengths 7, 3, 1, 10): ")
    assert "greedy tokens identical (8 each)" in lines[2]
    assert lines[-1].startswith("check: CTranslate2 vs relpos: max |log-prob diff| = ")
    assert lines[-1].endswith("(atol 0.0001), greedy tokens identical ok")
    chars = sorted(set(TEXT))
    assert json.loads((target / "vocabulary.json").read_text()) == chars
    meta = json.loads((target / "relpos_ct2.json").read_text())
    assert meta["vocabulary"]["kind"] == "chars" and meta["vocabulary"]["size"] == len(chars)


def test_the_default_output_is_beside_the_model(tmp_path):
    module = _module_file(tmp_path)
    code, out, err = _run(["export-ct2", str(module)])
    assert code == 0, err
    assert out == f"wrote {tmp_path / 'lm.ct2'}\n"
    meta = json.loads((tmp_path / "lm.ct2" / "relpos_ct2.json").read_text())
    assert meta["vocabulary"]["kind"] == "ids"
    assert json.loads((tmp_path / "lm.ct2" / "vocabulary.json").read_text())[:3] == ["0", "1", "2"]


def test_a_module_file_quantized_and_checked(tmp_path):
    target = tmp_path / "q"
    code, out, err = _run(["export-ct2", str(_module_file(tmp_path)), "-o", str(target),
                           "--quantization", "int8", "--check", "--max-new-tokens", "3"])
    assert code == 0, err
    assert "(3 each)" in out
    assert out.splitlines()[-1].startswith("check: int8 weights: max |log-prob diff| = ")
    assert out.rstrip().endswith("(not judged; pass --atol to)")


def test_a_vocabulary_file_and_force(tmp_path):
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps([f"tok{i}" for i in range(19)]))
    target = tmp_path / "out"
    target.mkdir()
    argv = ["export-ct2", str(_module_file(tmp_path)), "-o", str(target), "--vocabulary",
            str(vocab)]
    code, _, err = _run(argv)
    assert code == 2 and err.count("\n") == 1
    assert "exists; allowed: a new directory, or --force to replace it" in err
    assert list(target.iterdir()) == []
    code, _, err = _run([*argv, "--force"])
    assert code == 0, err
    assert json.loads((target / "vocabulary.json").read_text())[18] == "tok18"


def test_a_failed_check_exits_1(tmp_path, monkeypatch):
    from relpos.export import ctranslate2 as ct2

    def bad_check(model, path, **kwargs):
        case = ct2.CTranslate2Case("batch 1", (7,), 0.5, ((1, 2),), ((1, 3),))
        return ct2.CTranslate2Check((case,), 2)

    monkeypatch.setattr(ct2, "check_ctranslate2", bad_check)
    code, out, _ = _run(["export-ct2", str(_module_file(tmp_path)), "-o",
                         str(tmp_path / "o"), "--check"])
    assert code == 1
    assert "greedy tokens DIFFER (2 each)" in out
    assert out.rstrip().endswith("FAILED")


def _encoder_file(tmp: Path) -> Path:
    model = RelativeTransformerEncoderModel(ModelConfig(vocab_size=9, d_model=16, num_heads=2,
                                                        num_layers=1, causal=False,
                                                        num_classes=3, max_distance=2))
    return save_module(model, tmp / "enc.pt")


def _per_head_file(tmp: Path) -> Path:
    model = RelativeTransformerLM(ModelConfig(vocab_size=9, d_model=16, num_heads=2,
                                              num_layers=1, share_heads=False, max_distance=2))
    return save_module(model, tmp / "per-head.pt")


def _write(tmp: Path, name: str, text: str) -> Path:
    (tmp / name).write_text(text)
    return tmp / name


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (lambda t: ["export-ct2", str(t / "missing.pt")], "no such file or directory"),
        (lambda t: ["export-ct2", str(t)], "is a directory without a training checkpoint"),
        (lambda t: ["export-ct2", str(_write(t, "x.pt", "junk")), "-o", str(t / "o")],
         "is not a saved relpos module"),
        (lambda t: ["export-ct2", str(_encoder_file(t)), "-o", str(t / "o")],
         "cannot export to CTranslate2: got a RelativeTransformerEncoderModel; allowed: a "
         "RelativeTransformerLM"),
        (lambda t: ["export-ct2", str(_per_head_file(t)), "-o", str(t / "o")],
         "got share_heads=False (one relative table per head); allowed: share_heads=True"),
        (lambda t: ["export-ct2", str(_module_file(t)), "-o", str(_write(t, "f", "x"))],
         "is a file; allowed: a directory to write"),
        (lambda t: ["export-ct2", str(_module_file(t)), "-o", str(t / "no" / "o")],
         "does not exist"),
        (lambda t: ["export-ct2", str(_module_file(t)), "-o", str(t / "o"), "--quantization",
                    "int4"], "invalid choice: 'int4'"),
        (lambda t: ["export-ct2", str(_module_file(t)), "-o", str(t / "o"), "--vocabulary",
                    str(_write(t, "v.json", "[1, 2]"))], "allowed: a JSON list of token strings"),
        (lambda t: ["export-ct2", str(_module_file(t)), "-o", str(t / "o"), "--vocabulary",
                    str(_write(t, "v.json", '"abc"'))],
         "the vocabulary has 3 tokens, the model's vocab_size is 19"),
    ],
    ids=["missing", "empty-dir", "junk-file", "encoder", "per-head", "output-file",
         "output-parent", "quantization", "vocabulary-type", "vocabulary-size"],
)
def test_bad_input_is_one_line_exit_2(tmp_path, argv, message):
    code, _, err = _run(argv(tmp_path))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("relpos: error: "), err
    assert message in err, err
    assert not (tmp_path / "o").exists()


def test_the_output_may_not_hold_the_model(text_run):
    code, _, err = _run(["export-ct2", str(text_run / "checkpoints"), "-o", str(text_run),
                         "--force"])
    assert code == 2 and "would overwrite the model" in err
    assert (text_run / "checkpoints" / "latest.json").is_file()


def test_missing_ctranslate2_is_one_line(tmp_path, monkeypatch):
    module = _module_file(tmp_path)
    monkeypatch.setitem(sys.modules, "ctranslate2", None)
    code, _, err = _run(["export-ct2", str(module), "-o", str(tmp_path / "o")])
    assert code == 2 and err.count("\n") == 1
    assert "pip install 'relpos[ct2]'" in err
