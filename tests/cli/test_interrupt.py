"""Messages that say what is true: an interrupted ``relpos train`` names its last checkpoint
and the command that continues it, in one line from one process (no rank's traceback, no
torchrun messages), exit status 130; ``--nproc`` above the usable cores warns once with the
numbers; ``--resume`` says what its learning rate does. Runs are subprocesses under a
timeout, interrupted as a terminal's Ctrl-C would: SIGINT to their process group."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relpos.cli import main

TINY = ["--task", "recall", "--distances", "1,2", "--length", "8", "--batch-size", "4",
        "--d-model", "16", "--heads", "2", "--layers", "1", "-k", "2", "--no-progress"]


def _interrupted(argv: list[str], out: Path, *, after: str = "checkpoint",
                 timeout: float = 240) -> tuple[int, str, str]:
    """Start ``relpos train ARGV --out OUT`` in a process group of its own, SIGINT the
    group once the run wrote its first checkpoint (``after="checkpoint"``) or printed its
    first evaluation line (``"eval"``), as Ctrl-C would; returns its status, stdout, stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "relpos", "train", *argv, "--out", str(out)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # as a terminal starts it: SIGINT at its default, even where this process was started
        # with SIGINT ignored (a background job of a shell without job control)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + timeout
        if after == "eval":
            assert proc.stdout is not None
            line = proc.stdout.readline()  # "step 5: eval loss ..."
            assert line.startswith("step "), line
        else:
            while not (out / "checkpoints" / "latest.json").is_file():
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "no checkpoint in time"
                time.sleep(0.05)
            time.sleep(0.5)  # a few steps more: the interrupt lands mid-step
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            # the processes it started (torchrun and the ranks, each in a session of its own)
            # would outlive it and hold its pipes open: kill them first
            for pid in _descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, stdout, stderr


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``; none elsewhere)."""
    from relpos.training.data_parallel import _children

    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _said(stderr: str, out: Path, nproc: str = "") -> int:
    """The step of the checkpoint the one line of ``stderr`` names (checked against it)."""
    from relpos.training.checkpoint import read_state

    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    match = re.fullmatch(
        rf"relpos: interrupted; the last checkpoint is step (\d+) of 100000 "
        rf"\({re.escape(str(out / 'checkpoints'))}\): `relpos train --resume --out "
        rf"{re.escape(str(out))}{nproc}` continues from there", lines[0])
    assert match, lines[0]
    assert int(match.group(1)) == read_state(out / "checkpoints")["step"]
    return int(match.group(1))


@pytest.mark.skipif(sys.platform == "win32", reason="process groups and SIGINT")
def test_an_interrupted_run_names_its_last_checkpoint_and_the_command_that_continues_it(
        tmp_path):
    out = tmp_path / "run"
    status, _, stderr = _interrupted([*TINY, "--steps", "100000", "--checkpoint-every", "5"],
                                     out)
    assert status == 130
    step = _said(stderr, out)
    # The command it names continues from that checkpoint (--steps: to end soon).
    done = subprocess.run(
        [sys.executable, "-m", "relpos", "train", "--resume", "--out", str(out), "--steps",
         str(step + 2), "--no-progress"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"resuming {out} at step {step} of {step + 2}")


@pytest.mark.skipif(sys.platform == "win32", reason="process groups and SIGINT")
def test_an_interrupt_before_the_first_checkpoint_says_there_is_nothing_to_resume(tmp_path):
    out = tmp_path / "run"
    status, _, stderr = _interrupted(
        [*TINY, "--steps", "100000", "--checkpoint-every", "0", "--eval-every", "5"], out,
        after="eval")
    assert status == 130
    assert stderr == (f"relpos: interrupted before the run's first checkpoint: {out} holds "
                      "nothing to resume; run the same command to start it again\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, /proc")
@pytest.mark.parametrize("scaling", [[], ["--context-parallel", "2"]])
def test_a_multi_process_interrupt_says_one_line_and_no_rank_a_traceback(tmp_path, scaling):
    """Ctrl-C on ``--nproc 2`` (data parallel, or one sequence over both processes, where a
    rank whose peer left first used to print a gloo traceback): one line, status 130."""
    from relpos.ops.native import build

    build.load(quiet=True)  # built here once; the ranks only load it
    out = tmp_path / "run"
    status, stdout, stderr = _interrupted(
        [*TINY, "--steps", "100000", "--checkpoint-every", "5", "--eval-every", "0",
         "--nproc", "2", *scaling], out)
    assert status == 130, stderr
    assert "Traceback" not in stderr + stdout and "[rank" not in stderr + stdout
    _said(stderr, out, " --nproc 2")


def test_oversubscribed_says_the_numbers():
    from relpos.cli.train import oversubscribed

    assert oversubscribed(2, 1, 2) is None and oversubscribed(1, 4, 4) is None
    assert oversubscribed(8, 1, 2) == (
        "relpos: warning: --nproc 8 with 1 torch thread(s) each asks for 8 cores, and this "
        "process may use 2: the processes will share them, each slower (--nproc 2 fills them)")
    assert "asks for 6 cores" in oversubscribed(3, 2, 4) and "--nproc 2 fills" in (
        oversubscribed(3, 2, 4) or "")


@pytest.mark.parametrize(("nproc", "warned"), [(8, True), (2, False)])
def test_nproc_above_the_usable_cores_warns_once(tmp_path, capsys, monkeypatch, nproc, warned):
    import relpos._sysinfo
    import relpos.training

    launched = []
    monkeypatch.setattr(relpos._sysinfo, "usable_cores", lambda: 2)
    monkeypatch.setattr(relpos.training, "launch", lambda n, argv: launched.append(n) or 0)
    assert main(["train", *TINY, "--batch-size", "8", "--device", "cpu", "--nproc",
                 str(nproc), "--out", str(tmp_path / "run")]) == 0
    assert launched == [nproc]
    err = capsys.readouterr().err
    assert err.count("relpos: warning: --nproc") == (1 if warned else 0), err
    if warned:
        assert f"asks for {nproc} cores, and this process may use 2" in err


def test_a_torchrun_rank_other_than_0_says_nothing_of_an_interrupt(monkeypatch):
    from relpos.cli import _interrupt
    from relpos.training import data_parallel as distributed

    assert _interrupt.LAUNCHED_ENV == distributed.LAUNCHED_ENV
    for env, silent, status in (({}, False, 130), ({"WORLD_SIZE": "2", "RANK": "0"}, False, 130),
                                ({"WORLD_SIZE": "2", "RANK": "1"}, True, 130),
                                ({"WORLD_SIZE": "2", "RANK": "0", "RELPOS_LAUNCHED": "1"},
                                 True, 0)):
        for name in ("WORLD_SIZE", "RANK", "RELPOS_LAUNCHED"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert (_interrupt.silent(), _interrupt.exit_status()) == (silent, status), env


# --- --resume says what its learning rate does ------------------------------------------------

def test_resume_says_where_the_schedule_ends():
    from relpos.cli.train import resume_line
    from relpos.training import TrainConfig

    run = TrainConfig(steps=600, schedule_steps=300, lr=3e-3)
    assert resume_line(Path("r"), 300, 600, run) == (
        "resuming r at step 300 of 600: its learning-rate schedule ended at step 300, so "
        "steps 301-600 train at its floor rate, 0.0003")
    assert resume_line(Path("r"), 200, 600, run) == (
        "resuming r at step 200 of 600: its learning-rate schedule still ends at step 300 (it "
        "keeps the length the run started with), and steps 301-600 train at its floor rate, "
        "0.0003")
    assert resume_line(Path("r"), 200, 300, TrainConfig(steps=300)) == (
        "resuming r at step 200 of 300")
    assert resume_line(Path("r"), 100, 200, TrainConfig(steps=200, schedule_steps=300)) == (
        "resuming r at step 100 of 200, before the end of its learning-rate schedule (300 "
        "steps, which stays as it was)")


def test_the_readme_says_what_resuming_longer_does():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "--resume --steps 600" in x)
    assert line.endswith("# 300 steps more, at the floor learning rate"), line
    assert "continued exactly" not in readme
