"""What ``relpos train`` says when it is interrupted (Ctrl-C, SIGINT): one line, naming the
run's last checkpoint and the command that continues it, exit status 130.

One process says it: a single process; the process that launched the others for
``--nproc`` (they stay silent, and end with status 0, so torchrun reports no failure: the
launcher interrupted them and exits with 130); under torchrun, rank 0. A process of a
multi-process run raises :class:`KeyboardInterrupt` on its first SIGINT only
(:func:`watch`), and treats an error that follows an interrupt, its own or another
process's (a peer that left closes the connections a collective was using), as the
interrupt: no traceback from any rank.
Nothing here imports torch.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from pathlib import Path
from types import FrameType

__all__ = ["LAUNCHED_ENV", "exit_status", "is_interrupt", "line", "says", "silent", "watch"]

#: Set by :func:`relpos.training.data_parallel.launch` in the processes it starts (the same
#: name there: that module loads torch).
LAUNCHED_ENV = "RELPOS_LAUNCHED"
#: How long a process of a multi-process run waits, after an error, for the SIGINT that
#: would make the error an interrupt's (the peers are signalled at nearly the same moment).
GRACE_S = 3.0

_STATE = {"interrupted": False}


def _handler(signum: int, frame: FrameType | None) -> None:
    if _STATE["interrupted"]:
        return  # winding down already: no second KeyboardInterrupt in the middle of it
    _STATE["interrupted"] = True
    raise KeyboardInterrupt


def watch() -> None:
    """In a process of a multi-process run: the first SIGINT raises
    :class:`KeyboardInterrupt`, later ones are only noted."""
    _STATE["interrupted"] = False
    signal.signal(signal.SIGINT, _handler)


def is_interrupt(err: BaseException, *, distributed: bool) -> bool:
    """Whether ``err`` ends the process because it was interrupted: a KeyboardInterrupt, or,
    in a multi-process run, any error raised once this process had its SIGINT, or within
    :data:`GRACE_S` before it (a communication error, when a peer left first)."""
    if isinstance(err, KeyboardInterrupt) or _STATE["interrupted"]:
        return True
    if not distributed or not isinstance(err, (RuntimeError, OSError)):
        return False
    deadline = time.monotonic() + GRACE_S
    try:
        while time.monotonic() < deadline and not _STATE["interrupted"]:
            time.sleep(0.05)
    except KeyboardInterrupt:
        return True
    return bool(_STATE["interrupted"])


def silent() -> bool:
    """Whether this process leaves an interrupt unsaid: a process of a multi-process run
    other than rank 0, or any process a ``--nproc`` launch started (the launcher says it)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return False
    return os.environ.get(LAUNCHED_ENV) == "1" or int(os.environ.get("RANK", "0") or 0) != 0


def exit_status() -> int:
    """The exit status of an interrupted process: 130, or 0 for one a ``--nproc`` launch
    started (its launcher exits with 130)."""
    launched = os.environ.get(LAUNCHED_ENV) == "1"
    return 0 if launched and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else 130


def says(distributed: bool) -> bool:
    """Whether this process reports the interrupt (see :func:`silent`)."""
    return not (distributed and silent())


def line(out: Path, processes: int) -> str:
    """``relpos: interrupted; the last checkpoint ...``: where the run in ``out`` can
    continue from, and the command that continues it (``--nproc`` for ``processes`` > 1)."""
    from relpos.training.checkpoint import CheckpointError, read_state
    from relpos.training.rundir import CHECKPOINT_DIR

    resume = f"relpos train --resume --out {shlex.quote(str(out))}" + (
        f" --nproc {processes}" if processes > 1 else "")
    try:
        state = read_state(out / CHECKPOINT_DIR)
        step, steps = int(state["step"]), int(state["train"]["steps"])
    except (CheckpointError, OSError, KeyError, TypeError, ValueError):
        return (f"relpos: interrupted before the run's first checkpoint: {out} holds "
                "nothing to resume; run the same command to start it again")
    return (f"relpos: interrupted; the last checkpoint is step {step} of {steps} "
            f"({out / CHECKPOINT_DIR}): `{resume}` continues from there")
