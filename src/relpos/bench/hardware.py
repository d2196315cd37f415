"""What a benchmark report records about the CPU and its threads beyond the model name
(:func:`relpos._sysinfo.hardware`): the vector instruction sets (AVX2, AVX-512, AMX) and the
one torch's kernels use, and the OpenMP wait policy, with the warning ``relpos bench``
prints when that is unset.

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
import platform

__all__ = [
    "OMP_ENV",
    "POLICIES",
    "cpu_flags",
    "isa",
    "omp_wait_policy",
    "omp_warning",
    "torch_cpu_capability",
]

#: The environment variable OpenMP runtimes read their wait policy from.
OMP_ENV = "OMP_WAIT_POLICY"

#: What ``--omp-wait-policy`` takes (OpenMP's values, in lower case).
POLICIES = ("passive", "active")


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The ``flags`` of the first CPU in ``path`` (x86 Linux), or None where there are none
    (another OS, another architecture, an unreadable file)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return None


def _names(flags: frozenset[str], prefix: str) -> str:
    """The flags that start with ``prefix``, without it, upper case: ``avx512_bf16`` -> BF16."""
    return " ".join(sorted(f.removeprefix(prefix).lstrip("_").upper()
                           for f in flags if f.startswith(prefix)))


def isa(flags: frozenset[str] | None = None) -> str:
    """AVX2, AVX-512 (with its subsets) and AMX (with its parts) of this CPU, each said present
    or absent, from :func:`cpu_flags` (``flags`` None = read them).

    Example:
        >>> isa(frozenset({"avx2", "avx512f", "avx512bw", "amx_tile"}))
        'AVX2, AVX-512 (BW F), AMX (TILE)'
        >>> isa(frozenset({"avx2"}))
        'AVX2, no AVX-512, no AMX'
    """
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return f"unknown (no CPU flags in /proc/cpuinfo; {platform.machine() or 'machine unknown'})"
    return ", ".join((
        "AVX2" if "avx2" in flags else "no AVX2",
        f"AVX-512 ({_names(flags, 'avx512')})" if "avx512f" in flags else "no AVX-512",
        f"AMX ({_names(flags, 'amx')})" if any(f.startswith("amx") for f in flags) else "no AMX",
    ))


def torch_cpu_capability() -> str:
    """The instruction set torch's vectorized CPU kernels dispatch to
    (``torch.backends.cpu.get_cpu_capability()``: ``DEFAULT``, ``AVX2``, ``AVX512``, ...)."""
    import torch

    get = getattr(torch.backends.cpu, "get_cpu_capability", None)
    return str(get()) if get is not None else "unknown (torch too old to say)"


def omp_wait_policy() -> str:
    """``OMP_WAIT_POLICY`` as this process sees it, or ``"unset"``."""
    return os.environ.get(OMP_ENV, "").strip() or "unset"


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
