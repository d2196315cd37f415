"""``relpos generate`` on a ``relpos train --text`` run and on a saved module; its failures
as one line on stderr with exit status 2."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from relpos.cli import main
from relpos.export import load_module, save_module
from relpos.models import ModelConfig, RelativeTransformerEncoderModel, RelativeTransformerLM

TEXT = "\n".join(f"def f{i}(x):\n    return (x + {i}) * [x, {i}]" for i in range(60))
RUN = ["--length", "16", "--steps", "3", "--batch-size", "4", "--d-model", "16", "--heads",
       "2", "--layers", "1", "-k", "3", "--no-progress"]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("generate")
    corpus = root / "code.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    before = torch.get_num_threads()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--text", str(corpus), *RUN, "--out", str(root / "run")]) == 0
    torch.set_num_threads(before)
    return root / "run"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_text_prompt_prints_the_greedy_continuation(text_run, capsys):
    code, out, err = _run(capsys, "generate", str(text_run), "--text", "def f1(", "-n", "12",
                          "--greedy")
    assert code == 0 and err == ""
    chars = sorted(set(TEXT))
    model = load_module(text_run / "checkpoints")
    prompt = torch.tensor([[chars.index(c) for c in "def f1("]])
    expected = model.generate(prompt, 12, temperature=0, new_tokens_only=True)[0]
    assert out == "".join(chars[i] for i in expected) + "\n"
    # the checkpoints/ directory itself works too
    assert _run(capsys, "generate", str(text_run / "checkpoints"), "--text", "def f1(", "-n",
                "12", "--temperature", "0")[1] == out


def test_sampling_is_seeded_and_stop_ends_early(text_run, capsys):
    a = _run(capsys, "generate", str(text_run), "--text", "x", "-n", "30", "--top-p", "0.9",
             "--top-k", "5", "--seed", "3")
    b = _run(capsys, "generate", str(text_run), "--text", "x", "-n", "30", "--top-p", "0.9",
             "--top-k", "5", "--seed", "3")
    assert a == b and a[0] == 0
    code, out, _ = _run(capsys, "generate", str(text_run), "--text", "x", "-n", "30",
                        "--stop", " ", "--stop", "\n", "--seed", "1")
    text = out[:-1]  # the printed newline
    assert code == 0 and len(text) <= 30
    if len(text) < 30:  # stopped: the stop character ends the continuation, only there
        assert text[-1] in " \n" and not any(c in " \n" for c in text[:-1])


def test_prompt_ids_with_a_saved_module(tmp_path, capsys):
    torch.manual_seed(0)
    model = RelativeTransformerLM(ModelConfig(vocab_size=11, d_model=16, num_heads=2,
                                              max_distance=2))
    path = save_module(model, tmp_path / "lm.pt")
    code, out, err = _run(capsys, "generate", str(path), "--prompt-ids", "1,2,3", "-n", "6",
                          "--greedy")
    expected = model.eval().generate(torch.tensor([[1, 2, 3]]), 6, temperature=0,
                                     new_tokens_only=True)[0].tolist()
    assert code == 0 and out.split() == [str(i) for i in expected]
    code, _, err = _run(capsys, "generate", str(path), "--text", "abc")
    assert code == 2 and "no text vocabulary" in err and err.count("\n") == 1
    code, _, err = _run(capsys, "generate", str(path), "--prompt-ids", "1,11")
    assert code == 2 and "outside [0, vocab_size=11)" in err
    code, _, err = _run(capsys, "generate", str(path), "--prompt-ids", "1", "--stop", "x")
    assert code == 2 and "token id" in err
    enc = RelativeTransformerEncoderModel(ModelConfig(vocab_size=11, d_model=16, num_heads=2,
                                                      max_distance=2, causal=False))
    enc_path = save_module(enc, tmp_path / "enc.pt")
    code, _, err = _run(capsys, "generate", str(enc_path), "--prompt-ids", "1")
    assert code == 2 and "language model" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--text", "\u00e9"], "not trained on"),
        (["--text", ""], "empty"),
        (["--text", "x", "--top-p", "0"], "(0, 1]"),
        (["--text", "x", "--top-p", "1.5"], "(0, 1]"),
        (["--text", "x", "--stop", "ab"], "one character"),
        (["--text", "x", "-n", "0"], "-n"),
        ([], "one of the arguments"),
    ],
)
def test_bad_input_is_one_line(text_run, capsys, argv, message):
    code, out, err = _run(capsys, "generate", str(text_run), *argv)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_missing_model(tmp_path, capsys):
    code, _, err = _run(capsys, "generate", str(tmp_path / "none"), "--text", "x")
    assert code == 2 and "no such file" in err
    code, _, err = _run(capsys, "generate", str(tmp_path), "--text", "x")
    assert code == 2 and "without a training checkpoint" in err


def test_load_module_takes_a_run_directory_like_the_commands(text_run, tmp_path):
    from relpos.export import ModuleFormatError

    a, b = load_module(text_run), load_module(text_run / "checkpoints")
    assert isinstance(a, RelativeTransformerLM)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    with pytest.raises(ModuleFormatError, match=r"neither latest\.json nor checkpoints/latest"):
        load_module(tmp_path)


@pytest.mark.parametrize("sampling", [["--temperature", "1e-40"], ["--temperature", "1e-300"],
                                      ["--top-p", "1e-320"]], ids=" ".join)
def test_a_tiny_temperature_or_top_p_is_greedy_on_the_command_line(text_run, capsys, sampling):
    greedy = _run(capsys, "generate", str(text_run), "--text", "def f1(", "-n", "8", "--greedy")
    got = _run(capsys, "generate", str(text_run), "--text", "def f1(", "-n", "8", *sampling)
    assert got == greedy and got[0] == 0
