"""What machine a benchmark ran on, for its report; how much memory a request may take."""

from __future__ import annotations

import os
import platform

__all__ = ["available_memory", "hardware"]


def hardware() -> str:
    """CPU model, visible logical CPUs and OS, for a benchmark report."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs visible, {platform.system()} {platform.release()}"


def _read_int(path: str, field: str | None = None) -> int | None:
    """An integer from a file (the ``field:`` line's first number, in kB, with ``field``)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if field is None:
                    return int(line.strip())
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(device: object = "cpu") -> int | None:
    """Bytes a new allocation may take on ``device``, or None when unknown.

    CPU: ``MemAvailable`` of ``/proc/meminfo``, capped by a cgroup's ``memory.max`` minus its
    ``memory.current``; CUDA: the free memory of the device.
    """
    import torch

    dev = torch.device(device)  # type: ignore[call-overload]
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type != "cpu":
        return None
    free = _read_int("/proc/meminfo", "MemAvailable")
    limit = _read_int("/sys/fs/cgroup/memory.max")  # "max" (no limit) reads as None
    used = _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        free = limit - used if free is None else min(free, limit - used)
    return None if free is None else max(0, free)
