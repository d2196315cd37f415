"""What the native kernels run on here: the instruction set and vector code they are built
for, and the two switches that choose their GEMM engines. Which engine a call runs on the
kernels decide themselves, at each call (``csrc/gemm.h``), and say: :func:`gemm_engines` asks
the loaded module; relpos never works it out on its own. Where no kernels are loaded there is
no engine to name (:func:`gemm_lines` says "not built").

The kernels read the two GEMM switches themselves (``std::getenv``, at each call) and refuse
a value they do not know. relpos reads them first (:func:`settle_switches`, at every call
that asks for the kernels): a value with spaces or capitals is written back as the kernels
accept it; one that names no engine is refused with a ValueError naming the variable, the
value and the engines allowed. Switches of earlier development versions
(:data:`REMOVED_SWITCHES`) change nothing; one that is set is said once, with what replaces it.

Environment (docs/numerics.md has the table of the switches and their engines):
    RELPOS_NATIVE: ``0`` (``false``, ``off``, ``no``) turns the native kernels off.
    RELPOS_NATIVE_FLOAT_GEMM: ``vec`` or ``brgemm``: float32's GEMM engine.
    RELPOS_NATIVE_BF16_GEMM: ``amx``, ``avx512bf16``, ``brgemm`` or ``widened``: bfloat16's.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from relpos import _env
from relpos._sysinfo import cpu_flags, cpuinfo

__all__ = [
    "BF16_ENGINES",
    "BF16_GEMM_ENV",
    "FLOAT_ENGINES",
    "FLOAT_GEMM_ENV",
    "GEMM_SWITCHES",
    "NATIVE_ENV",
    "REMOVED_SWITCHES",
    "build_facts",
    "disabled",
    "gemm_engines",
    "gemm_lines",
    "has_vectors",
    "have_blas",
    "isa",
    "settle_switches",
    "switch",
    "vector_code",
]

NATIVE_ENV = "RELPOS_NATIVE"
FLOAT_GEMM_ENV = "RELPOS_NATIVE_FLOAT_GEMM"
BF16_GEMM_ENV = "RELPOS_NATIVE_BF16_GEMM"

#: float32's GEMM engines (what ``RELPOS_NATIVE_FLOAT_GEMM`` names).
FLOAT_ENGINES = ("vec", "brgemm")
#: bfloat16's GEMM engines, in the order one the build or CPU lacks gives way to the next
#: (what ``RELPOS_NATIVE_BF16_GEMM`` names).
BF16_ENGINES = ("amx", "avx512bf16", "brgemm", "widened")

#: The switches the kernels read themselves, and the values they accept.
GEMM_SWITCHES: Mapping[str, tuple[str, ...]] = {FLOAT_GEMM_ENV: FLOAT_ENGINES,
                                                BF16_GEMM_ENV: BF16_ENGINES}

#: Switches of earlier development versions that change nothing now, and what replaces each.
REMOVED_SWITCHES: Mapping[str, str] = {
    "RELPOS_NATIVE_SGEMM": f"{FLOAT_GEMM_ENV}=vec|brgemm chooses float32's GEMM engine",
    "RELPOS_NATIVE_BLAS": "none: float64 runs on the BLAS's dgemm_ where libtorch exports it, "
                          "else on libtorch's matrix multiply",
    "RELPOS_NATIVE_HALF_GEMM": f"{BF16_GEMM_ENV}=widened widens bfloat16's tiles to float32 "
                               "(float16's always are)",
    "RELPOS_NATIVE_AMX": f"{BF16_GEMM_ENV}=amx|avx512bf16|brgemm|widened chooses bfloat16's "
                         "GEMM engine",
}

_switches_now = _env.watch((NATIVE_ENV, *GEMM_SWITCHES, *REMOVED_SWITCHES))


def switch(name: str) -> str:
    """The value of the GEMM switch ``name`` (:data:`GEMM_SWITCHES`) as the kernels take it:
    stripped and lower-cased, "" when unset or empty; ValueError when it names no engine."""
    return _env.strict_choice(name, GEMM_SWITCHES[name])


def settle_switches() -> None:
    """Read each GEMM switch (:func:`switch`: a value that names no engine raises ValueError)
    and write it back as the kernels accept it (stripped, lower-cased); say once of each
    removed switch that is set (:data:`REMOVED_SWITCHES`) that it changes nothing, and what
    replaces it."""
    for name in GEMM_SWITCHES:
        raw = os.environ.get(name)
        if raw is None:
            continue
        value = switch(name)
        if value != raw:
            if value:
                os.environ[name] = value
            else:
                del os.environ[name]
    for name, instead in REMOVED_SWITCHES.items():
        _env.removed(name, f"{instead} (docs/numerics.md)")


_seen: tuple[object, ...] | None = None
_off = False


def disabled() -> bool:
    """Whether ``RELPOS_NATIVE=0`` (or ``false``/``off``/``no``) turns the kernels off. While
    they are on, every call (cheaply: only when a switch changed) :func:`settle_switches` first,
    before the kernels read any: a GEMM switch that names no engine raises ValueError here."""
    global _seen, _off
    now = _switches_now()
    if now != _seen:
        _off = not _env.flag(NATIVE_ENV, default=True, fallback="the native kernels stay on")
        if not _off:
            settle_switches()
        _seen = _switches_now()
    return _off


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` compiles for exactly these)."""
    fields = cpuinfo()
    flags = fields.get("flags") or fields.get("Features")
    return " ".join(sorted(flags.split())) if flags else platform.processor()


def isa() -> str:
    """The instruction set the kernels are compiled for: torch's CPU capability (``AVX512``,
    ``AVX2``, ``DEFAULT``) on this machine's architecture."""
    import torch

    return f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}"


def _libtorch_cpu() -> str | None:
    import torch

    lib = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        if (lib / name).exists():
            return str(lib / name)
    return None


@functools.cache
def _exported(symbol: str) -> bool:
    """Whether libtorch_cpu exports ``symbol``."""
    path = _libtorch_cpu()
    if path is None:
        return False
    try:
        return hasattr(ctypes.CDLL(path), symbol)
    except OSError:
        return False


@functools.cache
def have_blas() -> bool:
    """Whether libtorch exports the BLAS's ``sgemm_``/``dgemm_`` (x86 wheels do: MKL's): a
    build flag (``-DRELPOS_HAVE_BLAS``), with which the kernels call them where they run GEMMs
    on the BLAS (float64's, float32's decode-like products); without them on libtorch's own
    matrix multiply."""
    return all(_exported(s) for s in ("sgemm_", "dgemm_"))


def build_facts(module: ModuleType) -> dict[str, str]:
    """A loaded kernels module's ``build_info()`` as a dict: ``"blas=mkl amx=none
    vectors=avx512 ..."`` gives ``{"blas": "mkl", "amx": "none", "vectors": "avx512", ...}``:
    what the build has, not what a call runs on (:func:`gemm_engines`)."""
    return dict(t.partition("=")[::2] for t in module.build_info().split() if "=" in t)


def has_vectors(module: ModuleType) -> bool:
    """Whether loaded kernels were built with their float32 vector code (AVX-512 or AVX2:
    ``vectors=`` in ``build_info()``); without it (the x86-64 ``baseline`` variant, builds for
    other architectures) their row passes and decode kernels are compiled C++ loops."""
    return build_facts(module).get("vectors", "none") != "none"


def gemm_engines(module: ModuleType) -> dict[str, str]:
    """What a call made now (this environment) runs its GEMMs on, per dtype, as the loaded
    kernels ``module`` say (their ``gemm_engines()``: the one place the choice is made):
    ``{"float32": "vec" | "brgemm", "float64": "blas" | "aten", "bfloat16": "amx" |
    "avx512bf16" | "brgemm" | "widened", "float16": "widened"}``. Reads the switches first
    (:func:`settle_switches`: ValueError for a value that names no engine)."""
    settle_switches()
    return {str(k): str(v) for k, v in module.gemm_engines().items()}


#: What each engine name the kernels give stands for.
ENGINE_NAMES: Mapping[str, str] = {
    "vec": "the kernels' own vector code",
    "brgemm": "libtorch's brgemm, oneDNN's micro-kernels",
    "blas": "the BLAS's dgemm_ as libtorch exports it",
    "aten": "libtorch's matrix multiply",
    "amx": "the kernels' AMX tiles",
    "avx512bf16": "VDPBF16PS on the kernels' packed tiles",
    "widened": "tiles widened to float32",
}


def gemm_lines(engines: Mapping[str, str] | None) -> tuple[str, str]:
    """What ``relpos kernels`` says of the GEMMs, float32 and float64 on one line, bfloat16 and
    float16 on the other, from the loaded kernels' answer (:func:`gemm_engines`); with None
    (no kernels loaded) that there is none to give."""
    if engines is None:
        said = "not built (the kernels choose at each call, and say which once built)"
        return said, said

    def part(dtype: str) -> str:
        name = engines.get(dtype, "?")
        return f"{dtype} {name} ({ENGINE_NAMES.get(name, name)})"

    return f"{part('float32')}; {part('float64')}", f"{part('bfloat16')}; {part('float16')}"


def _vectors(serving: str | None) -> str | None:
    """The vector code the kernels that serve here are built with (a fact of the build's
    flags, said without loading them): ``"AVX-512"``, ``"AVX2"`` or None, for this CPU's own
    build or the prebuilt variant ``serving``."""
    from relpos.ops.native.variants import variant

    if serving is not None:
        return {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(variant(serving).capability)
    if platform.machine() != "x86_64":
        return None
    flags = cpu_flags() or frozenset()
    return "AVX-512" if "avx512f" in flags else "AVX2" if {"avx2", "fma"} <= flags else None


def vector_code(serving: str | None = None) -> str:
    """What ``relpos kernels`` says of the kernels' vector code (:func:`_vectors`)."""
    vectors = _vectors(serving)
    if vectors is not None:
        return f"{vectors} (row passes, exponentials, masks, decode attention)"
    return "none (compiled C++ loops)"
