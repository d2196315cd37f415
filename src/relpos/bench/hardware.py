"""The OpenMP wait policy a benchmark runs under, and the warning ``relpos bench`` prints when
it is unset. (What the machine is, the instruction sets included, is
:mod:`relpos._sysinfo`'s; its names are re-exported here.)

Why the wait policy: torch's CPU thread pool is OpenMP (GNU libgomp in the Linux wheels).
Between parallel regions its idle threads spin for a while before they sleep. On a quiet
machine that shaves the wake-up latency; on a busy one (other processes, or more threads
than free cores) the spinning threads take the cores the working ones need, and timings
swing by 10x or more. ``OMP_WAIT_POLICY=PASSIVE`` makes idle threads sleep at once,
``ACTIVE`` makes them spin without limit. The OpenMP runtime reads the variable once, when
it is loaded (with torch), so setting ``os.environ`` in a process that has imported torch
changes nothing: ``relpos bench --omp-wait-policy passive`` runs the benchmark again in a
subprocess started with the variable set.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from relpos._sysinfo import OMP_ENV, cpu_flags, isa, omp_wait_policy, torch_cpu_capability

__all__ = [
    "OMP_ENV",
    "POLICIES",
    "cpu_flags",
    "isa",
    "omp_wait_policy",
    "omp_warning",
    "rerun_with_policy",
    "torch_cpu_capability",
]

#: What ``--omp-wait-policy`` takes (OpenMP's values, in lower case).
POLICIES = ("passive", "active")


def omp_warning(command: str) -> str | None:
    """The warning ``relpos bench`` prints on stderr when ``OMP_WAIT_POLICY`` is unset (None
    when it is set); ``command`` is the command to show with the variable set."""
    if omp_wait_policy() != "unset":
        return None
    return (
        f"relpos: warning: {OMP_ENV} is unset: idle OpenMP threads spin, and on a busy machine "
        f"spinning threads swing timings 10x or more; set it, as in "
        f"`{OMP_ENV}=PASSIVE {command}`, or pass --omp-wait-policy passive"
    )


def rerun_with_policy(argv: Sequence[str], policy: str) -> int:
    """Run ``python -m relpos *argv`` again in a subprocess started with
    ``OMP_WAIT_POLICY=policy`` (upper case); returns its exit status. Its output goes to this
    process's stdout/stderr."""
    value = policy.upper()
    print(f"relpos: running the benchmark in a subprocess with {OMP_ENV}={value} "
          "(OpenMP reads it when torch loads)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    return subprocess.run([sys.executable, "-m", "relpos", *argv],
                          env={**os.environ, OMP_ENV: value}, check=False).returncode
