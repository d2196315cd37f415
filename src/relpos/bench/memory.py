"""Peak memory of one call, measured in a fresh ``spawn`` subprocess (Linux ``/proc``), and
the memory this machine has available."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

__all__ = ["available_bytes", "peak_mib", "proc_status_kib", "reset_peak", "rss_peak_bytes"]

#: How :func:`peak_mib` measures, for a report.
METHOD = (
    "peak RSS (`VmHWM` of /proc/self/status, reset after the inputs were made) of a fresh "
    "`spawn` subprocess running one forward + backward, minus its RSS after creating the "
    "inputs and the upstream gradient"
)


def available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (8 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def proc_status_kib(field: str) -> int | None:
    """A ``field:`` of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``, ...), or None where
    it cannot be read."""
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_peak_bytes() -> int:
    """Peak RSS of this process: ``VmHWM`` (per address space, so not inherited from the
    parent like ``ru_maxrss`` is across fork + exec), else ``ru_maxrss``."""
    hwm = proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def reset_peak() -> None:
    """Reset the peak RSS to the current RSS where the kernel allows it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
            f.write("5")
    except OSError:
        pass


def _worker(prepare: Callable[[], Callable[[], object]], threads: int, queue: Any) -> None:
    """Subprocess body: the peak RSS increase (MiB) of the call ``prepare()`` returns."""
    try:
        import torch

        torch.set_num_threads(threads)
        call = prepare()
        reset_peak()
        base = max(rss_peak_bytes(), 1024 * (proc_status_kib("VmRSS") or 0))
        call()
        queue.put((rss_peak_bytes() - base) / 2**20)
    except BaseException as err:  # reported in the table, not raised across processes
        queue.put(f"error: {type(err).__name__}: {err}")


def peak_mib(prepare: Callable[[], Callable[[], object]], threads: int) -> float | str:
    """Peak MiB of one call in a fresh ``spawn`` subprocess with ``threads`` torch threads.

    Args:
        prepare: a picklable function (a module-level function or a ``functools.partial``
            of one) that the subprocess calls first, to make the inputs (and warm up); it
            returns the call to measure. Memory is counted from after ``prepare``.
        threads: torch threads in the subprocess.

    Returns:
        The peak RSS increase in MiB, or an ``"error: ..."`` string.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(prepare, threads, queue))
    proc.start()
    try:
        value = queue.get()
    finally:
        proc.join()
    return value
