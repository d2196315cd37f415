"""The instruction sets a portable build of the native kernels is compiled for, and which of
them this CPU runs.

A build in the per-user cache is compiled for exactly this CPU (``-march=native``). A kernels
directory made to travel (``relpos kernels --build --into DIR``: a container image, a cluster's
shared software tree) holds one build per *variant* instead, and the loader picks, at load
time, the best variant the CPU runs:

==========  ======================  ===================================================
variant     compiled with           runs where the CPU has
==========  ======================  ===================================================
amx         ``-march=x86-64-v4``    AMX-TILE, AMX-BF16, AVX512-BF16 (and all of
            ``-mavx512bf16``        ``avx512``): Intel Xeon from Sapphire Rapids on
            ``-mamx-tile``
            ``-mamx-bf16``
avx512bf16  ``-march=x86-64-v4``    AVX512-BF16 (and all of ``avx512``): AMD EPYC from
            ``-mavx512bf16``        Zen 4 on, Intel Xeon Cooper Lake
avx512      ``-march=x86-64-v4``    AVX-512 F, BW, CD, DQ, VL (and all of ``avx2``)
avx2        ``-march=x86-64-v3``    AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE (x86-64-v3)
baseline    ``-march=x86-64``       any x86-64 CPU (on ARM: ``-march=armv8-a``)
==========  ======================  ===================================================

A variant also needs torch to run at that level (``torch.backends.cpu.get_cpu_capability()``),
so ``ATEN_CPU_CAPABILITY=avx2`` (torch's own switch) keeps the kernels on ``avx2`` or below.
``amx`` carries the kernels' own AMX tile GEMMs for bfloat16, ``amx`` and ``avx512bf16`` their
VDPBF16PS tile GEMMs (chosen where the CPU runs them faster than float32 FMAs), as a build for
such a CPU does; the other variants run bfloat16 on libtorch's brgemm (on a CPU with
AMX-BF16) or on widened tiles; which, the loaded kernels say (``gemm_engines()``).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

from relpos._sysinfo import cpu_flags, torch_cpu_capability

__all__ = ["Variant", "runnable", "variant", "variants"]

# The CPU flags (as /proc/cpuinfo names them) of GCC's x86-64 micro-architecture levels.
_X86_64_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_X86_64_V3 = _X86_64_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe",
                           "xsave"}
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_AVX512_BF16 = _X86_64_V4 | {"avx512_bf16"}
_AMX = _AVX512_BF16 | {"amx_tile", "amx_bf16"}

# torch's capability levels, lowest first (ATEN_CPU_CAPABILITY lowers the one it reports).
_CAPABILITY_RANK = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}


@dataclass(frozen=True)
class Variant:
    """One portable build: its ``name``, the compiler ``flags`` that choose its instruction
    set, the CPU ``requires`` (``/proc/cpuinfo`` flag names) and the torch ``capability`` it
    needs."""

    name: str
    flags: tuple[str, ...]
    requires: frozenset[str] = frozenset()
    capability: str = "DEFAULT"


_X86 = (
    Variant("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"), _AMX,
            "AVX512"),
    Variant("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16"), _AVX512_BF16, "AVX512"),
    Variant("avx512", ("-march=x86-64-v4",), _X86_64_V4, "AVX512"),
    Variant("avx2", ("-march=x86-64-v3",), _X86_64_V3, "AVX2"),
    Variant("baseline", ("-march=x86-64",)),
)
_ARM = (Variant("baseline", ("-march=armv8-a",)),)
_OTHER = (Variant("baseline", ()),)


def variants(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants of ``machine`` (default this one's architecture), best first."""
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        return _X86
    if machine in ("aarch64", "arm64"):
        return _ARM
    return _OTHER


def variant(name: str, machine: str | None = None) -> Variant:
    """The variant called ``name`` on ``machine``; a ValueError naming the ones there are."""
    for v in variants(machine):
        if v.name == name:
            return v
    names = ", ".join(v.name for v in variants(machine))
    raise ValueError(f"no kernels variant {name!r} on {machine or platform.machine()} "
                     f"(allowed: {names})")


def runnable(v: Variant, flags: frozenset[str] | None = None,
             capability: str | None = None) -> bool:
    """Whether this CPU (its ``flags``, default read from ``/proc/cpuinfo``) runs ``v`` and
    torch runs at its level (``capability``, default torch's). Where the CPU's flags cannot be
    read, only a variant that requires none runs.

    Example:
        >>> runnable(variant("avx2", "x86_64"), frozenset({"avx2"}), "AVX2")  # no FMA, ...
        False
        >>> runnable(variant("baseline", "x86_64"), None, "DEFAULT")
        True
    """
    if v.requires:
        flags = cpu_flags() if flags is None else flags
        if flags is None or not v.requires <= flags:
            return False
    capability = torch_cpu_capability() if capability is None else capability
    # An unknown capability (another architecture's: VSX, ZVECTOR, SVE256) is no x86 level.
    return _CAPABILITY_RANK.get(capability.upper(), 0) >= _CAPABILITY_RANK[v.capability]
