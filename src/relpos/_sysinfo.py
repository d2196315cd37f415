"""Which machine this is, written once: the CPU model and flags of ``/proc/cpuinfo``, the
vector instruction sets, torch's CPU capability, the versions and the OpenMP wait policy
(:func:`environment`, recorded by benchmark reports, training runs, the K study and the
kernels' build key); and how much memory a request may take.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import functools
import os
import platform
from typing import Any

__all__ = [
    "OMP_ENV",
    "available_memory",
    "cpu_flags",
    "cpu_model",
    "cpuinfo",
    "environment",
    "hardware",
    "isa",
    "omp_wait_policy",
    "torch_cpu_capability",
    "usable_cores",
]

#: The environment variable OpenMP runtimes read their wait policy from.
OMP_ENV = "OMP_WAIT_POLICY"
CPUINFO = "/proc/cpuinfo"


@functools.cache
def cpuinfo(path: str = CPUINFO) -> dict[str, str]:
    """The fields of the first processor in ``path`` (``model name``, ``flags`` on x86,
    ``Features`` on ARM, ...); empty where the file cannot be read (another OS)."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break  # the end of the first processor's block
                    continue
                key, sep, value = line.partition(":")
                if sep:
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model(path: str = CPUINFO) -> str:
    """The CPU's model name, else ``platform.processor()`` or the architecture."""
    return cpuinfo(path).get("model name") or platform.processor() or platform.machine()


def cpu_flags(path: str = CPUINFO) -> frozenset[str] | None:
    """The x86 ``flags`` of the first CPU in ``path``, or None where there are none (another
    OS, another architecture, an unreadable file)."""
    flags = cpuinfo(path).get("flags")
    return None if flags is None else frozenset(flags.split())


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


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity (a container's or ``taskset``'s
    share), all logical CPUs where the platform has none."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def hardware() -> str:
    """CPU model, visible logical CPUs and OS, for a benchmark report."""
    return (f"{cpu_model()}, {os.cpu_count()} logical CPUs visible, "
            f"{platform.system()} {platform.release()}")


def environment(threads: int | None = None) -> dict[str, Any]:
    """The machine and the software, as every record of a run states them.

    Keys: ``cpu`` (model), ``isa`` (:func:`isa`), ``torch_cpu_capability``, ``logical_cpus``
    (visible), ``platform`` (OS and release), the ``torch``, ``relpos`` and ``python``
    versions, ``threads`` (``threads``, else torch's intra-op threads) and
    ``omp_wait_policy`` (:func:`omp_wait_policy`).
    """
    import torch

    from relpos._version import __version__

    return {
        "cpu": cpu_model(),
        "isa": isa(),
        "torch_cpu_capability": torch_cpu_capability(),
        "logical_cpus": os.cpu_count(),
        "platform": f"{platform.system()} {platform.release()}",
        "torch": torch.__version__,
        "relpos": __version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads() if threads is None else threads,
        "omp_wait_policy": omp_wait_policy(),
    }


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
