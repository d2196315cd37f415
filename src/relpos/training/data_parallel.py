"""Data-parallel training with ``torch.distributed`` (gloo on CPU, nccl on CUDA).

A run started by ``torchrun`` (environment ``WORLD_SIZE`` > 1) joins the process group;
every rank builds the same global batch for ``(seed, step)`` and takes its own contiguous
slice (a deterministic distributed sampler; a batch whose number of rows varies, as lines
batched by a token budget, is split per batch by :func:`rank_share`), DDP averages the
gradients, and only rank 0
evaluates, reports and writes files. ``relpos train --nproc N`` starts torchrun itself via
:func:`launch`, on ``127.0.0.1`` and a free port.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import glob
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["DistContext", "free_port", "init_distributed", "launch", "launched_by_relpos",
           "rank_share", "rank_slice", "refuse_together", "shutdown"]

#: Default limit of :func:`launch` (None = no limit); a stuck run is killed after it.
LAUNCH_TIMEOUT_S: float | None = None


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in a (possibly one-process) run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but CUDA is not available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if device == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")


def init_distributed(device: str = "auto", *, timeout_s: float = 600.0) -> DistContext:
    """Join the process group if launched by torchrun; otherwise a one-process context.

    Args:
        device: ``"auto"`` (CUDA if available), ``"cpu"`` or ``"cuda"``.
        timeout_s: collective timeout.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local_rank)
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def refuse_together(refusal: str | None, *, timeout_s: float = 120.0) -> str | None:
    """Under torchrun (``WORLD_SIZE`` > 1), before any process group: tell the other ranks
    whether this one refuses to start (``refusal``, its one-line reason, already reported;
    None: it would start) and learn theirs. Returns the first refusal in rank order, or None
    when every rank starts; outside torchrun, ``refusal`` itself.

    torchrun stops the other ranks (SIGTERM) as soon as one exits with an error, so a rank
    that exits at once after refusing gets the others killed before they say anything. Here
    no rank returns before every rank has decided, and a rank that refuses (or learns of a
    refusal) ignores SIGTERM from then on, so it ends as it returns: every rank exits with its
    own status. Uses the store of the torchrun agent (``MASTER_ADDR``, ``MASTER_PORT``).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return refusal
    rank = int(os.environ.get("RANK", "0"))
    # SIG_IGN, not a Python handler: Python resets its handlers while it shuts down.
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    prefix = ("relpos/start/" + os.environ.get("TORCHELASTIC_RUN_ID", "") + "/"
              + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store.set(f"{prefix}/{rank}", "refused:" + refusal if refusal is not None else "starts")
    keys = [f"{prefix}/{r}" for r in range(world)]
    store.wait(keys)
    answers = [store.get(key).decode() for key in keys]
    found = next((a.removeprefix("refused:") for a in answers if a.startswith("refused:")), None)
    if found is None:
        signal.signal(signal.SIGTERM, previous)
    return found


def shutdown(ctx: DistContext) -> None:
    """Leave the process group (if one was joined), after freeing what nothing reaches any
    more (a sharded model the caller dropped, whose collectives' state would otherwise be torn
    down with the interpreter, after the group)."""
    if ctx.distributed and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def rank_slice(global_batch: int, ctx: DistContext) -> tuple[int, int]:
    """The ``[start, stop)`` examples of the global batch this rank trains on.

    Raises:
        ValueError: if the global batch does not split evenly over the ranks.
    """
    if global_batch % ctx.world_size:
        raise ValueError(
            f"the global batch size {global_batch} must be divisible by the number of "
            f"processes {ctx.world_size}"
        )
    share = global_batch // ctx.world_size
    return ctx.rank * share, (ctx.rank + 1) * share


def rank_share(rows: int, ctx: DistContext) -> tuple[int, int]:
    """The ``[start, stop)`` rows of a batch of ``rows`` this rank trains on: contiguous
    shares in rank order whose sizes differ by at most one (the first ``rows % world_size``
    ranks take one more, as ``numpy.array_split``); equal to :func:`rank_slice` when the
    rows divide evenly. With fewer rows than ranks the last ranks get none.
    """
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    base, extra = divmod(rows, ctx.world_size)
    start = ctx.rank * base + min(ctx.rank, extra)
    return start, start + base + (1 if ctx.rank < extra else 0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Set in the environment of the processes :func:`launch` starts: the launching process
#: reports an interrupt (and warns of too many processes), so they say nothing of it.
LAUNCHED_ENV = "RELPOS_LAUNCHED"


def launched_by_relpos() -> bool:
    """Whether this process is one of those a :func:`launch` started."""
    return os.environ.get(LAUNCHED_ENV) == "1"


def launch(nproc: int, argv: Sequence[str], *, timeout_s: float | None = None) -> int:
    """Run ``python -m relpos <argv>`` in ``nproc`` processes under torchrun on this host.

    torchrun runs in a session of its own, so a Ctrl-C (or SIGTERM) reaches this process
    alone: it sends SIGINT to each process torchrun started (as torchrun would, but without
    torchrun's own shutdown messages and traceback), waits for them to end (a process
    :func:`launch` started ends an interrupted run with status 0, saying nothing) and raises
    :class:`KeyboardInterrupt`; a second Ctrl-C kills them. On ``timeout_s`` they are killed.

    Args:
        nproc: number of processes (>= 1).
        argv: the ``relpos`` arguments (without ``--nproc``).
        timeout_s: kill the run after this many seconds (None = no limit).

    Returns:
        torchrun's exit status (124 after a timeout).

    Raises:
        KeyboardInterrupt: when this process was interrupted (SIGINT or SIGTERM), once the
            processes have ended.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "relpos",
        *argv,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env[LAUNCHED_ENV] = "1"
    limit = LAUNCH_TIMEOUT_S if timeout_s is None else timeout_s
    main_thread = threading.current_thread() is threading.main_thread()

    def terminated(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated) if main_thread else None
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return 124
    except KeyboardInterrupt:
        try:
            _interrupt(proc)
        except KeyboardInterrupt:  # a second one: no waiting
            _kill(proc)
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:  # an error here: nothing it started outlives it
            _kill(proc)


def _interrupt(proc: subprocess.Popen[bytes], *, patience_s: float = 10.0) -> None:
    """SIGINT to each process torchrun (``proc``) started, each in a session of its own,
    and to those it starts meanwhile; wait for torchrun to end. Where none shows within
    ``patience_s`` (it has not started them, or no ``/proc`` lists them), SIGINT to
    torchrun itself (its shutdown stops them, with its messages)."""
    import time

    told: set[int] = set()
    started = time.monotonic()
    while proc.poll() is None:
        for pid in set(_children(proc.pid)) - told:
            told.add(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGINT)
        if not told and time.monotonic() - started > patience_s:
            proc.send_signal(signal.SIGINT)
            told.add(-1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to torchrun (``proc``) and to the sessions of the processes it started (they
    would outlive it); waits for torchrun."""
    for pid in _children(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``; none elsewhere)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(stat.split("/")[2]))
    return found
