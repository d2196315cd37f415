"""``relpos train``'s output: the loss unit, evaluation lines without the progress bar,
``--lines`` runs (packed, or padded with ``--pad``), ``--resume`` of a finished run, and a
used ``--out`` refused on every rank under torchrun."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from relpos.cli import main


def test_no_progress_keeps_the_evaluation_lines_and_losses_say_their_unit(tmp_path, capsys):
    before = torch.get_num_threads()
    code = main(["train", "--task", "recall", "--distances", "1,2", "--length", "8", "--steps",
                 "4", "--eval-every", "2", "--batch-size", "4", "--d-model", "16", "--heads",
                 "2", "--layers", "1", "-k", "2", "--no-progress", "--out", str(tmp_path / "r")])
    torch.set_num_threads(before)
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    periodic = [line for line in lines if line.startswith("step 2: eval loss ")]
    assert len(periodic) == 1 and " nats (" in periodic[0] and " bits) " in periodic[0], out
    final = next(line for line in lines if line.lstrip().startswith("length"))
    nats = float(final.split("loss ")[1].split(" nats")[0])
    bits = float(final.split(" nats (")[1].split(" bits")[0])
    assert math.isclose(bits, nats / math.log(2), abs_tol=1e-4), final
    assert "train" not in err  # no progress bar


# --- --lines: one line an example, trained packed; --pad to compare ------------------------

LINES = ["--lines", "--length", "12", "--steps", "3", "--batch-size", "4", "--d-model", "16",
         "--heads", "2", "--layers", "1", "-k", "3", "--warmup", "1", "--eval-every", "0",
         "--checkpoint-every", "2", "--no-progress"]


def _lines_file(tmp_path):
    words = ["alpha", "beta", "gamma", "delta", "pi"]
    lines = [" ".join(words[(i * j) % 5] for j in range(i % 6)) for i in range(120)]
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _train(argv, capsys):
    before = torch.get_num_threads()
    code = main(["train", *argv])
    torch.set_num_threads(before)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_lines_train_packed_and_pad_gives_the_same_losses(tmp_path, capsys):
    from relpos.training import load_checkpoint

    text = str(_lines_file(tmp_path))
    packed, padded = tmp_path / "packed", tmp_path / "padded"
    _train(["--text", text, *LINES, "--out", str(packed)], capsys)
    _train(["--text", text, *LINES, "--pad", "--out", str(padded)], capsys)
    a = json.loads((packed / "metrics.json").read_text())
    b = json.loads((padded / "metrics.json").read_text())
    assert a["task"]["unit"] == b["task"]["unit"] == "line"
    assert "pad" not in a["train"] and b["train"]["pad"] is True
    assert load_checkpoint(packed / "checkpoints").step == 3
    losses = [row[1] for row in a["history"]["train"]]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert [row[1] for row in b["history"]["train"]] == pytest.approx(losses, rel=1e-5)
    assert b["eval"][0]["loss"] == pytest.approx(a["eval"][0]["loss"], rel=1e-5)
    assert a["eval"][0]["count"] == b["eval"][0]["count"]
    # A resumed run continues the same way, with or without the (agreeing) options.
    out = _train(["--resume", "--steps", "4", "--no-progress", "--out", str(padded)], capsys)
    assert (f"resuming {padded} at step 3 of 4: its learning-rate schedule ended at step 3, "
            "so step 4 trains at its floor rate, 0.0003") in out
    _train(["--resume", "--lines", "--pad", "--steps", "5", "--no-progress", "--out",
            str(padded)], capsys)
    saved = load_checkpoint(padded / "checkpoints").state
    assert saved["step"] == 5 and saved["train"]["pad"] is True
    assert saved["task"]["unit"] == "line"


# --- a finished run, and a used --out under torchrun ---------------------------------------

TINY = ["--task", "recall", "--distances", "1,2", "--length", "8", "--steps", "2",
        "--batch-size", "4", "--d-model", "16", "--heads", "2", "--layers", "1", "-k", "2",
        "--eval-every", "0", "--no-progress"]


def _snapshot(root):
    """Every file's bytes and every path's mtime under ``root``."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns,
                                       p.read_bytes() if p.is_file() else b"")
            for p in sorted(root.rglob("*"))}


def test_resume_of_a_finished_run_says_so_and_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    _train([*TINY, "--out", str(out)], capsys)
    seconds = json.loads((out / "metrics.json").read_text())["train_seconds"]
    before = _snapshot(out)
    for extra in ([], ["--steps", "2"], ["--eval-every", "1"]):
        before_threads = torch.get_num_threads()
        code = main(["train", "--resume", "--out", str(out), *extra])
        torch.set_num_threads(before_threads)
        printed, err = capsys.readouterr()
        assert code == 0 and err == "", err
        assert printed == (f"{out} already finished 2 steps; pass --steps N > 2 to train "
                           "longer\n")
        assert _snapshot(out) == before
    assert json.loads((out / "metrics.json").read_text())["train_seconds"] == seconds
    # Training longer still trains; a run stopped before its metrics were written resumes.
    printed = _train(["--resume", "--steps", "3", "--out", str(out)], capsys)
    assert (f"resuming {out} at step 2 of 3: its learning-rate schedule ended at step 2, so "
            "step 3 trains at its floor rate") in printed
    (out / "metrics.json").unlink()
    printed = _train(["--resume", "--out", str(out)], capsys)
    assert "already finished" not in printed and (out / "metrics.json").is_file()
    assert json.loads((out / "metrics.json").read_text())["steps"] == 3


def test_torchrun_refuses_a_used_out_in_one_line_and_status_2_on_every_rank(tmp_path, capsys):
    import re
    import subprocess
    import sys

    from relpos.training.data_parallel import free_port

    out = tmp_path / "run"
    _train([*TINY, "--out", str(out)], capsys)
    before = _snapshot(out)
    logs = tmp_path / "logs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Each rank's stdout and stderr go to its own files under logs/ (-r 3).
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--log-dir", str(logs),
         "-r", "3", "-m", "relpos", "train", *TINY, "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode != 0
    # torchrun's own summary (unavoidable): both ranks exited with status 2.
    assert len(re.findall(r"exitcode\s*:\s*2 ", proc.stderr)) == 2, proc.stderr
    errs = sorted(logs.rglob("stderr.log"))
    assert len(errs) == 2, list(logs.rglob("*"))
    for err in errs:
        assert err.read_text() == (
            f"relpos: error: --out {str(out)!r} already holds a run (checkpoints, "
            "metrics.json); pass --resume to continue it, --overwrite to replace it, or "
            "choose another --out\n")
        assert (err.parent / "stdout.log").read_text() == ""
    assert _snapshot(out) == before


# --- scaling: --context-parallel, --cp-mode, --fsdp, --activation-checkpointing --------------

SCALE = ["--task", "recall", "--distances", "1,2", "--length", "8", "--batch-size", "4",
         "--d-model", "16", "--heads", "2", "--layers", "1", "-k", "2", "--eval-every", "0",
         "--no-progress"]


@pytest.mark.parametrize("argv, says", [
    (["--context-parallel", "3", "--nproc", "2"], "--context-parallel 3 must divide --nproc 2"),
    (["--context-parallel", "2"], "shards each sequence over 2 processes; pass --nproc 2"),
    (["--fsdp"], "--fsdp shards over processes; pass --nproc N"),
    (["--nproc", "4", "--context-parallel", "2", "--batch-size", "3"],
     "--batch-size 3 must be divisible by the 2 data-parallel groups"),
    (["--nproc", "2", "--length", "2"], "task 'recall' needs length >= 3, got 2"),
    (["--cp-mode", "ulysses"], "invalid choice: 'ulysses'"),
])
def test_scaling_options_that_cannot_run_are_refused_in_one_line_before_any_launch(
        tmp_path, capsys, argv, says):
    out = tmp_path / "run"
    code = main(["train", *SCALE, *argv, "--out", str(out)])
    printed, err = capsys.readouterr()
    assert code == 2 and says in err, err
    assert err.count("\n") == 1 and err.startswith("relpos: error: "), err
    assert printed == "" and not out.exists()


def test_packed_lines_need_pad_under_context_parallelism(tmp_path, capsys):
    path = _lines_file(tmp_path)
    code = main(["train", "--text", str(path), *LINES, "--nproc", "2", "--context-parallel",
                 "2", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "--context-parallel shards padded batches" in err
    assert "add --pad" in err and err.count("\n") == 1


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs...), read from /proc: torchrun starts
    its ranks in sessions of their own, so a process group does not hold them."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                found.append(child)
                todo.append(child)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the ranks")
def test_a_killed_context_parallel_fsdp_run_resumes_from_its_last_checkpoint(tmp_path, capsys):
    """A run on dp 1 x cp 2 with FSDP2 and activation checkpointing, every process SIGKILLed
    after a checkpoint, resumes (here on dp 2 with FSDP2, another layout) and ends with the
    losses of one uninterrupted process, step by step."""
    import signal
    import subprocess
    import time

    from relpos.ops.native import build
    from relpos.training.checkpoint import has_checkpoint, read_state

    build.load(quiet=True)  # built here once; the ranks only load it
    steps = 120
    run = [*SCALE, "--steps", str(steps), "--checkpoint-every", "5"]
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "relpos", "train", *run, "--nproc", "2", "--context-parallel",
         "2", "--fsdp", "--activation-checkpointing", "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed_at = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "checkpoints").is_dir() and has_checkpoint(out / "checkpoints"):
                killed_at = read_state(out / "checkpoints")["step"]
                break
            time.sleep(0.02)
        for pid in [proc.pid, *_descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        printed = proc.communicate(timeout=60)[0]
    assert killed_at is not None and killed_at < steps, printed[-3000:]
    assert not (out / "metrics.json").exists(), "the run finished before it could be killed"
    capsys.readouterr()

    # The ranks print to the terminal, not through this process: read the run's files.
    _train(["--resume", "--nproc", "2", "--fsdp", "--no-progress", "--out", str(out)], capsys)
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["resumed_from"] >= killed_at and resumed["parallelism"]["fsdp"]
    _train([*run, "--out", str(tmp_path / "straight")], capsys)
    straight = json.loads((tmp_path / "straight" / "metrics.json").read_text())
    assert [row[0] for row in resumed["history"]["train"]] == list(range(1, steps + 1))
    assert [row[1] for row in resumed["history"]["train"]] == pytest.approx(
        [row[1] for row in straight["history"]["train"]], rel=1e-4, abs=1e-6)
