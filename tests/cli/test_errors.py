"""Bad command lines, table-driven: each ends with one line on stderr starting
``relpos: error:`` and exit status 2, before any long work (training, benchmarking,
exporting: those are replaced here by functions that fail the test if called).

Every entry builds what it needs in ``tmp_path`` (``{tmp}`` in an argument is that
directory) and names a fragment of the message.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from relpos.cli import main

ONNX = ("onnx", "onnxscript", "onnxruntime")

# A tiny run (K = 2, 2 steps), trained for real once per module for the --resume entries.
RUN = ["--task", "recall", "--distances", "1,2", "--length", "8", "--steps", "2",
       "--batch-size", "4", "--d-model", "16", "--heads", "2", "--layers", "1", "-k", "2",
       "--no-progress"]


class LongWork(AssertionError):
    """A bad command line reached the training, benchmark or export it should have
    been refused before."""


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "run"
    before = torch.get_num_threads()
    code, err = _run(["train", *RUN, "--out", str(out)])
    torch.set_num_threads(before)
    assert code == 0, err
    return out


@pytest.fixture
def no_long_work(monkeypatch):
    import relpos.bench.attention
    import relpos.bench.decode
    import relpos.export
    import relpos.training
    import relpos.training.experiment

    def refuse(*args, **kwargs):
        raise LongWork("reached the long work")

    for module, name in [
        (relpos.training, "train"),
        (relpos.training.experiment, "run_experiment"),
        (relpos.bench.attention, "run_attention"),
        (relpos.bench.decode, "run_decode"),
        (relpos.export, "export_onnx"),
    ]:
        monkeypatch.setattr(module, name, refuse)


# --- what the entries build -----------------------------------------------------------------


def _file(tmp: Path, name: str = "afile") -> Path:
    (tmp / name).write_text("not a directory\n")
    return tmp / name


def _dir(tmp: Path, name: str) -> Path:
    (tmp / name).mkdir(parents=True)
    return tmp / name


def _module(tmp: Path, change: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Path:
    """A saved relpos module file (the format of relpos.export.save_module), its state
    changed by ``change``."""
    import relpos
    from relpos.export import FORMAT, FORMAT_VERSION, module_config

    attn = relpos.RelativeMultiheadAttention(16, 2, max_distance=3, batch_first=True)
    spec = module_config(attn)
    state = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    if change is not None:
        change(state)
    payload = {"format": FORMAT, "format_version": FORMAT_VERSION, "relpos_version": "0",
               "class": spec["class"], "config": json.dumps(spec["config"]), "state_dict": state}
    torch.save(payload, tmp / "m.pt")
    return tmp / "m.pt"


def _rename_key(state: dict[str, torch.Tensor]) -> None:
    state["bogus.weight"] = state.pop(next(k for k in state if k.endswith("weight")))


def _drop_key(state: dict[str, torch.Tensor]) -> None:
    del state[next(k for k in state if k.endswith("weight"))]


def _misshape(state: dict[str, torch.Tensor]) -> None:
    key = next(k for k, v in state.items() if v.dim() == 2)
    state[key] = torch.zeros(3, 3)


def _blank_tail(tmp: Path) -> Path:
    """A text file whose last tenth (the eval split) holds only empty lines."""
    (tmp / "blank.txt").write_text("some text here\n" * 6 + "\n" * 20)
    return tmp / "blank.txt"


def _used_run(tmp: Path) -> Path:
    _dir(tmp, "used/checkpoints")
    (tmp / "used/checkpoints/latest.json").write_text("{}")
    (tmp / "used/metrics.json").write_text("{}")
    return tmp / "used"


def _used_experiment(tmp: Path) -> Path:
    _dir(tmp, "exp/runs")
    (tmp / "exp/results.json").write_text("{}")
    (tmp / "exp/runs/recall-K0-depth1.json").write_text("{}")
    return tmp / "exp"


def _foreign_checkpoints(tmp: Path) -> Path:
    out = _used_run(tmp)
    (out / "checkpoints/notes.txt").write_text("mine\n")
    return out


def _copy_run(trained: Path, tmp: Path) -> Path:
    import shutil

    shutil.copytree(trained, tmp / "run")
    return tmp / "run"


# (name, setup(tmp, trained) -> argv, fragment)
Setup = Callable[[Path, Path], list[str]]
CASES: list[tuple[str, Setup, str]] = [
    # --- output paths: checked before the work -------------------------------------------
    ("export-onnx -o existing dir/",
     lambda t, r: ["export-onnx", str(_module(t)), "-o", f"{_dir(t, 'out')}/"], "is a directory"),
    ("export-onnx -o existing dir",
     lambda t, r: ["export-onnx", str(_module(t)), "-o", str(_dir(t, "out"))], "is a directory"),
    ("heatmap -o existing dir.png",
     lambda t, r: ["heatmap", "-o", str(_dir(t, "x.png"))], "is a directory"),
    ("heatmap -o FILE/x.png",
     lambda t, r: ["heatmap", "-o", str(_file(t) / "x.png")], "is a file, not a directory"),
    ("train --out FILE", lambda t, r: ["train", *RUN, "--out", str(_file(t))],
     "--out '{tmp}/afile' is a file; allowed: a directory"),
    ("train --out FILE/sub", lambda t, r: ["train", *RUN, "--out", str(_file(t) / "sub")],
     "'{tmp}/afile' is a file, not a directory"),
    ("bench --out FILE", lambda t, r: ["bench", "--quick", "--out", str(_file(t))],
     "is a file; allowed: a directory"),
    ("bench --decode --out FILE/x.md",
     lambda t, r: ["bench", "--decode", "--quick", "--out", str(_file(t) / "x.md")],
     "is a file"),
    ("bench --out DIR holding a directory attention.md",
     lambda t, r: ["bench", "--quick", "--out", str(_dir(t, "b/attention.md").parent)],
     "the report '{tmp}/b/attention.md' is a directory"),
    ("experiment --out FILE", lambda t, r: ["experiment", "--quick", "--out", str(_file(t))],
     "is a file; allowed: a directory"),
    ("experiment --out DIR whose runs is a file",
     lambda t, r: ["experiment", "--quick", "--out", str(_file(_dir(t, "e"), "runs").parent)],
     "'{tmp}/e/runs' is a file"),
    # --- a used --out -----------------------------------------------------------------------
    ("train into a used --out", lambda t, r: ["train", *RUN, "--out", str(_used_run(t))],
     "already holds a run (checkpoints, metrics.json); pass --resume to continue it, "
     "--overwrite to replace it"),
    ("experiment into a used --out",
     lambda t, r: ["experiment", "--quick", "--out", str(_used_experiment(t))],
     "already holds an experiment (results.json, 1 run file); pass --reuse"),
    ("train --overwrite with foreign files in checkpoints/",
     lambda t, r: ["train", *RUN, "--overwrite", "--out", str(_foreign_checkpoints(t))],
     "holds files relpos train does not write (notes.txt)"),
    ("train --resume --overwrite",
     lambda t, r: ["train", "--resume", "--overwrite", "--out", str(t)],
     "argument --overwrite: not allowed with argument --resume"),
    ("experiment --reuse --overwrite",
     lambda t, r: ["experiment", "--reuse", "--overwrite", "--out", str(t)],
     "argument --overwrite: not allowed with argument --reuse"),
    # --- numbers: finite, in range ------------------------------------------------------------
    ("train -k 1000000000", lambda t, r: ["train", "-k", "1000000000"],
     "must be an int <= 65536, got '1000000000'; allowed: 0..65536"),
    ("train --length 1000000000", lambda t, r: ["train", "--length", "1000000000"],
     "--length: must be an int <= 65536"),
    ("train --eval-lengths 8,1000000000",
     lambda t, r: ["train", "--eval-lengths", "8,1000000000"],
     "must be comma-separated ints <= 65536"),
    ("train --weight-decay nan", lambda t, r: ["train", "--weight-decay", "nan"],
     "--weight-decay: must be a finite number >= 0, got 'nan'"),
    ("train --weight-decay -1", lambda t, r: ["train", "--weight-decay", "-1"],
     "--weight-decay: must be a finite number >= 0, got '-1'"),
    ("train --weight-decay inf", lambda t, r: ["train", "--weight-decay", "inf"],
     "must be a finite number >= 0, got 'inf'"),
    ("table --length 10000000", lambda t, r: ["table", "--length", "10000000"],
     "--length: must be an int <= 100000, got '10000000'; allowed: 1..100000"),
    ("export-onnx --opset 1", lambda t, r: ["export-onnx", str(_module(t)), "--opset", "1"],
     "--opset: must be an int >= 18, got '1'"),
    ("export-onnx --opset 17", lambda t, r: ["export-onnx", str(_module(t)), "--opset", "17"],
     "--opset: must be an int >= 18, got '17'"),
    ("export-onnx --opset 1000",
     lambda t, r: ["export-onnx", str(_module(t)), "--opset", "1000"],
     "--opset 1000 is newer than the installed onnx"),
    ("train --seed 99999999999999999999",
     lambda t, r: ["train", "--seed", "99999999999999999999"],
     "--seed: must be an int <= 18446744073709551615, got '99999999999999999999'"),
    ("generate --seed -1", lambda t, r: ["generate", str(t), "--prompt-ids", "1", "--seed", "-1"],
     "--seed: must be an int >= 0"),
    ("train --threads 100000000000", lambda t, r: ["train", "--threads", "100000000000"],
     "--threads: must be an int <= 1024"),
    ("train --ff 99999999999999999999", lambda t, r: ["train", "--ff", "99999999999999999999"],
     "--ff: must be an int <= 9223372036854775807"),
    ("generate -n 1000000000000",
     lambda t, r: ["generate", str(_copy_run(r, t)), "--prompt-ids", "1,2", "-n",
                   "1000000000000"],
     "max_new_tokens=1000000000000: a cache of 2 + 1000000000000 positions needs"),
    # --- lists: each value once -------------------------------------------------------------
    ("experiment --ks 2,2", lambda t, r: ["experiment", "--ks", "2,2", "--out", str(t / "e")],
     "argument --ks: must be distinct, got '2,2' (2 more than once)"),
    ("experiment --tasks recall,recall",
     lambda t, r: ["experiment", "--tasks", "recall,recall", "--out", str(t / "e")],
     "argument --tasks: must be distinct, got 'recall,recall' (recall more than once)"),
    ("experiment --seeds 1,2,1",
     lambda t, r: ["experiment", "--seeds", "1,2,1", "--out", str(t / "e")],
     "argument --seeds: must be distinct, got '1,2,1' (1 more than once)"),
    ("experiment --code-ks 4,4", lambda t, r: ["experiment", "--code-ks", "4,4"],
     "argument --code-ks: must be distinct"),
    ("experiment --depths 1,1", lambda t, r: ["experiment", "--depths", "1,1"],
     "argument --depths: must be distinct"),
    # --- what the input is -------------------------------------------------------------------
    ("train --text DIR", lambda t, r: ["train", "--text", f"{_dir(t, 'corpus')}/", "--out",
                                       str(t / "o")],
     "text file '{tmp}/corpus/' is a directory; allowed: a UTF-8 text file"),
    # --- --lines and --pad: variable-length text only -------------------------------------------
    ("train --lines without --text", lambda t, r: ["train", "--lines", "--out", str(t / "o")],
     "--lines is for task 'text' (--text FILE), not 'recall'"),
    ("train --lines --task sort",
     lambda t, r: ["train", "--task", "sort", "--lines", "--out", str(t / "o")],
     "--lines is for task 'text' (--text FILE), not 'sort'"),
    ("train --pad on a fixed-length task",
     lambda t, r: ["train", *RUN, "--pad", "--out", str(t / "o")],
     "--pad compares padded with packed training of variable-length batches (--text FILE "
     "--lines); task 'recall' has fixed-length rows, with no padding"),
    ("train --text --pad without --lines",
     lambda t, r: ["train", "--text", str(_file(t, "t.txt")), "--pad", "--out", str(t / "o")],
     "task 'text' has windows of --length characters, with no padding"),
    ("train --text --lines on a file without lines in a split",
     lambda t, r: ["train", "--text", str(_blank_tail(t)), "--lines", "--out", str(t / "o")],
     "has no line of 2 characters or more in its eval split"),
    # --- --resume reads the saved configuration -----------------------------------------------
    ("train --resume -k other than saved",
     lambda t, r: ["train", "--resume", "-k", "3", "--out", str(_copy_run(r, t))],
     "different configuration: -k 3 (the checkpoint: 2)"),
    ("train --resume --bidirectional on a causal run",
     lambda t, r: ["train", "--resume", "--bidirectional", "--out", str(_copy_run(r, t))],
     "--bidirectional (the checkpoint: False)"),
    ("train --resume --text on a recall run",
     lambda t, r: ["train", "--resume", "--text", str(_file(t, "t.txt")), "--out",
                   str(_copy_run(r, t))], "--task text (the checkpoint: recall)"),
    ("train --resume --pad on a packed run",
     lambda t, r: ["train", "--resume", "--pad", "--out", str(_copy_run(r, t))],
     "different configuration: --pad (the checkpoint: False)"),
    ("train --resume --lines on a recall run",
     lambda t, r: ["train", "--resume", "--lines", "--out", str(_copy_run(r, t))],
     "different configuration: --lines (the checkpoint: False)"),
    ("train --resume --steps below the checkpoint",
     lambda t, r: ["train", "--resume", "--steps", "1", "--out", str(_copy_run(r, t))],
     "--steps 1 is below the step of the checkpoint in '{tmp}/run', 2; allowed: 2 or more"),
    # --- export-onnx: what it reads ------------------------------------------------------------
    ("export-onnx DIR without a checkpoint",
     lambda t, r: ["export-onnx", str(_dir(t, "empty"))],
     "neither '{tmp}/empty/latest.json' nor '{tmp}/empty/checkpoints/latest.json' exists"),
    ("export-onnx module with a renamed weight",
     lambda t, r: ["export-onnx", str(_module(t, _rename_key))],
     'Unexpected key(s) in state_dict: "bogus.weight"'),
    ("export-onnx module without a weight",
     lambda t, r: ["export-onnx", str(_module(t, _drop_key))], "Missing key(s) in state_dict"),
    ("export-onnx module with a misshapen weight",
     lambda t, r: ["export-onnx", str(_module(t, _misshape))], "size mismatch for"),
]


def test_table_is_large_enough():
    assert len(CASES) >= 30
    assert len({name for name, *_ in CASES}) == len(CASES)


@pytest.mark.parametrize(("setup", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_command_line(tmp_path, trained, no_long_work, setup, fragment):
    argv = setup(tmp_path, trained)
    if argv[0] == "export-onnx":
        pytest.importorskip("onnxscript")  # without the extra it says so first
    before = sorted(tmp_path.rglob("*"))
    code, err = _run(argv)
    assert sorted(tmp_path.rglob("*")) == before, "a refused run left files behind"
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("relpos: error: "), err
    fragment = fragment.replace("{tmp}", str(tmp_path))
    assert fragment in err, err


def test_a_refused_export_output_loads_no_torch(tmp_path):
    """``export-onnx -o DIR/`` fails before loading torch, let alone exporting."""
    model = _module(tmp_path)
    out = _dir(tmp_path, "out")
    code = (
        "import sys\n"
        "from relpos.cli import main\n"
        f"status = main(['export-onnx', {str(model)!r}, '-o', {str(out) + '/'!r}])\n"
        "assert status == 2, status\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("relpos: error: the output") and "is a directory" in (
        result.stderr
    )


def test_heatmap_checks_the_suffixes_plotting_writes():
    from relpos.cli import heatmap
    from relpos.training.plotting import IMAGE_FORMATS

    assert set(heatmap.IMAGE_SUFFIXES) == set(IMAGE_FORMATS)


# --- a misspelled option or subcommand: the closest known one ----------------------------

def _subcommands() -> dict[str, object]:
    import argparse

    from relpos.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _misspelled(option: str, known: set[str]) -> str:
    """``option`` with two letters of its name swapped, known to no option (nor a prefix of
    one: argparse accepts those)."""
    name = option[2:]
    for i in range(len(name) - 2, 0, -1):
        if name[i] != name[i + 1]:
            wrong = "--" + name[:i] + name[i + 1] + name[i] + name[i + 2:]
            if not any(k.startswith(wrong) for k in known):
                return wrong
    raise AssertionError(f"cannot misspell {option}")


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_a_misspelled_option_gets_the_closest_one_suggested(command):
    """Every subcommand: one line on stderr naming the closest option, exit status 2."""
    sub = _subcommands()[command]
    known = {o for a in sub._actions for o in a.option_strings}
    options = sorted(o for o in known if o.startswith("--") and len(o) > 6 and o != "--help")
    # Each positional argument given, so the misspelled option is what is wrong.
    given = ["x" for a in sub._actions if not a.option_strings and a.required]
    for option in options[:3]:
        wrong = _misspelled(option, known)
        code, err = _run([command, *given, wrong])
        assert code == 2 and err.count("\n") == 1 and err.startswith("relpos: error: "), err
        # argparse's own words (unrecognized arguments, or a required option it lacks first)
        assert f"unrecognized arguments: {wrong}" in err or "required" in err, err
        near = err.rsplit("; did you mean ", 1)[-1].rstrip("?\n")
        assert near == option or near in known, (wrong, err)


def test_the_issues_misspelling_and_a_misspelled_subcommand_get_their_suggestion():
    code, err = _run(["train", "--max-distnace", "4"])
    assert (code, err) == (2, "relpos: error: unrecognized arguments: --max-distnace 4; did "
                              "you mean --max-distance?\n")
    code, err = _run(["trian", "--steps", "3"])
    assert code == 2 and err.endswith("; did you mean 'train'?\n") and err.count("\n") == 1
    code, err = _run(["table", "--format", "markdwn"])
    assert code == 2 and err.endswith("; did you mean 'markdown'?\n"), err
    code, err = _run(["train", "--stpes", "3", "--seeed", "1"])
    assert err.endswith("did you mean --steps (for --stpes), --seed (for --seeed)?\n"), err
    code, err = _run(["table", "--zzzzzz"])  # nothing close: argparse's words alone
    assert (code, err) == (2, "relpos: error: unrecognized arguments: --zzzzzz\n")
