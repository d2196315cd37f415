"""What the native kernels run on here, said without loading them: the instruction set, the
vector code, the GEMM engines (MKL's ``sgemm_``/``dgemm_``, libtorch's matrix multiply, the
16-bit GEMMs and tile engines), and the switches that choose among them.

Every switch is read by :mod:`relpos._env` (stripped, lower-cased; a value that is none of
those allowed is ignored with one warning). The kernels read some switches themselves
(``std::getenv``) and would refuse every call on a value they do not know, so
:func:`settle_switches` first writes each back as they accept it: spaces and capitals
dropped, an unknown value removed from the environment (this process's and its children's).

Environment:
    RELPOS_NATIVE: ``0`` (``false``, ``off``, ``no``) turns the native kernels off.
    RELPOS_NATIVE_SGEMM: ``vec`` or ``blas``: float32 GEMMs on the kernels' vectors or the BLAS.
    RELPOS_NATIVE_BLAS: ``aten`` or ``blas``: the BLAS GEMMs on libtorch's matrix multiply or
        on MKL's ``sgemm_``/``dgemm_``.
    RELPOS_NATIVE_BF16_GEMM: ``amx``, ``avx512bf16``, ``mkl`` or ``widened``: bfloat16's engine.
    RELPOS_NATIVE_HALF_GEMM: ``1``: 16-bit GEMMs; ``0``: tiles widened to float32.
    RELPOS_NATIVE_AMX: ``0`` (the older switch): MKL's bfloat16 GEMM.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path
from types import ModuleType

from relpos import _env
from relpos._sysinfo import cpu_flags, cpuinfo

__all__ = [
    "AMX_ENV",
    "BF16_ENGINES",
    "BF16_GEMM_ENV",
    "BLAS_ENV",
    "HALF_GEMM_ENV",
    "NATIVE_ENV",
    "SGEMM_ENV",
    "amx_tiles",
    "build_facts",
    "disabled",
    "float_gemms",
    "half_gemms",
    "has_vectors",
    "have_blas",
    "isa",
    "settle_switches",
    "vector_code",
]

NATIVE_ENV = "RELPOS_NATIVE"
SGEMM_ENV = "RELPOS_NATIVE_SGEMM"  # float32 GEMMs on the kernels' vectors or the BLAS (once)
BLAS_ENV = "RELPOS_NATIVE_BLAS"  # =aten: the BLAS GEMMs on libtorch's matrix multiply (once)
HALF_GEMM_ENV = "RELPOS_NATIVE_HALF_GEMM"
BF16_GEMM_ENV = "RELPOS_NATIVE_BF16_GEMM"
AMX_ENV = "RELPOS_NATIVE_AMX"  # the older switch: =0 asks for MKL's bfloat16 GEMM

#: The engines a bfloat16 call can run its GEMMs on, in the order one the build or CPU lacks
#: gives way to the next (what ``RELPOS_NATIVE_BF16_GEMM`` names).
BF16_ENGINES = ("amx", "avx512bf16", "mkl", "widened")

#: The switches the kernels read themselves: the values they accept (no aliases: the words of
#: a yes/no switch), and what serves when one is given none of them.
_KERNEL_SWITCHES: dict[str, tuple[tuple[str, ...], dict[str, str] | None, str]] = {
    SGEMM_ENV: (("vec", "blas"), None, "float32 GEMMs run where this build runs them by "
                "default"),
    BLAS_ENV: (("aten", "blas"), None, "the GEMMs run on MKL's sgemm_/dgemm_ where libtorch "
               "exports them, else on libtorch's matrix multiply"),
    BF16_GEMM_ENV: (BF16_ENGINES, None, "bfloat16 calls run on the default engine"),
    HALF_GEMM_ENV: (("0", "1"), dict(_env.FLAG_WORDS), "16-bit calls run on the default "
                    "engines"),
    AMX_ENV: (("0", "1"), dict(_env.FLAG_WORDS), "bfloat16 calls run on the default engine"),
}
_switches_now = _env.watch((NATIVE_ENV, *_KERNEL_SWITCHES))


def switch(name: str) -> str:
    """The value of the kernels' switch ``name`` as relpos reads it ("" when unset, or given
    a value that is none of those allowed: then with one warning)."""
    allowed, aliases, fallback = _KERNEL_SWITCHES[name]
    return _env.choice(name, allowed, fallback=fallback, aliases=aliases)


def settle_switches() -> None:
    """Write each switch the kernels read (:data:`_KERNEL_SWITCHES`) back as they accept it:
    stripped and lower-cased (``true``/``off`` as ``1``/``0``), and a value that is none of
    those allowed (said in one warning) removed, so the kernels take their default instead of
    refusing every call."""
    for name in _KERNEL_SWITCHES:
        raw = os.environ.get(name)
        if raw is None:
            continue
        value = switch(name)
        if value != raw:
            if value:
                os.environ[name] = value
            else:
                del os.environ[name]


_seen: tuple[object, ...] | None = None
_off = False


def disabled() -> bool:
    """Whether ``RELPOS_NATIVE=0`` (or ``false``/``off``/``no``) turns the kernels off; on
    every call (cheaply: only when a switch changed) :func:`settle_switches`, before the
    kernels read any."""
    global _seen, _off
    if _switches_now() != _seen:
        settle_switches()
        _off = not _env.flag(NATIVE_ENV, default=True, fallback="the native kernels stay on")
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
def have_blas() -> bool:
    """Whether libtorch exports MKL's ``sgemm_``/``dgemm_`` (x86 wheels do), which the
    kernels then call for their block GEMMs; without them (a wheel without MKL) the
    kernels run them on libtorch's own matrix multiply."""
    return all(_exported(s) for s in ("sgemm_", "dgemm_"))


def build_facts(module: ModuleType) -> dict[str, str]:
    """A loaded kernels module's ``build_info()`` as a dict: ``"blas=mkl sgemm=vec
    vectors=avx512 ..."`` gives ``{"blas": "mkl", "sgemm": "vec", "vectors": "avx512", ...}``."""
    return dict(t.partition("=")[::2] for t in module.build_info().split() if "=" in t)


def has_vectors(module: ModuleType) -> bool:
    """Whether loaded kernels were built with their float32 vector code (AVX-512 or AVX2:
    ``vectors=`` in ``build_info()``); without it (the x86-64 ``baseline`` variant, builds for
    other architectures) their row passes and decode kernels are compiled C++ loops."""
    return build_facts(module).get("vectors", "none") != "none"


#: What the kernels' GEMMs run on where they are not on the kernels' own vectors.
_ATEN_GEMM = "libtorch's matrix multiply (at::addmm, the BLAS torch.mm runs on)"


def _vectors(serving: str | None) -> str | None:
    """The vector code of the kernels that serve here (predicted without loading them):
    ``"AVX-512"``, ``"AVX2"`` or None, for this CPU's own build or the prebuilt variant
    ``serving``."""
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


def float_gemms(serving: str | None = None) -> str:
    """How the kernels run their float32 and float64 block GEMMs, as ``relpos kernels`` says
    it (predicted without loading them): float32 on the kernels' own vectors where the build
    (for this CPU, or the prebuilt variant ``serving``) has AVX-512, unless
    ``RELPOS_NATIVE_SGEMM=blas``; on its AVX2 vectors only under ``RELPOS_NATIVE_SGEMM=vec``
    (they ran at MKL's speed); float64, and float32 otherwise, on libtorch's MKL
    (``sgemm_``/``dgemm_``), or where libtorch exports no such symbols (or
    ``RELPOS_NATIVE_BLAS=aten`` asks) on libtorch's own matrix multiply. A switch given a
    value it does not know is ignored (one warning), as the kernels then ignore it."""
    want, route = switch(SGEMM_ENV), switch(BLAS_ENV)
    aten = route == "aten" or not have_blas()
    blas = _ATEN_GEMM if aten else "MKL's sgemm_"
    dgemm = _ATEN_GEMM if aten else "MKL's dgemm_ (libtorch's)"
    vectors = _vectors(serving)
    if vectors is None or want == "blas" or (vectors == "AVX2" and want != "vec"):
        other = f" ({SGEMM_ENV}=vec: the kernels' AVX2 vectors)" if vectors == "AVX2" else ""
        return f"float32 {blas}{other}; float64 {dgemm}"
    return f"float32 on the kernels' {vectors} vectors ({SGEMM_ENV}=blas: {blas}); float64 {dgemm}"


#: The 16-bit GEMMs (float32 accumulation) the kernels look for in libtorch, by dtype.
_HALF_GEMMS = {"bfloat16": "cblas_gemm_bf16bf16f32", "float16": "cblas_gemm_f16f16f32"}


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


_WIDENED = "tiles widened to float32"


def half_gemms(serving: str | None = None) -> str:
    """How the kernels run 16-bit inputs' GEMMs here, as ``relpos kernels`` says it (what the
    kernels read per call, predicted without loading them; the loaded kernels' ``bf16_gemm()``
    says it for bfloat16). float16: tiles widened to float32 (faster where measured), MKL's
    16-bit GEMM under ``RELPOS_NATIVE_HALF_GEMM=1``. bfloat16: the engine
    ``RELPOS_NATIVE_BF16_GEMM`` names, else by default AMX tiles where the kernels built for
    this CPU have them (:func:`amx_tiles`; ``serving``: the prebuilt variant that serves, None
    for this CPU's own build; of the prebuilt variants only ``amx`` has AMX, only ``amx`` and
    ``avx512bf16`` VDPBF16PS), VDPBF16PS on
    packed tiles where this CPU has AVX512-BF16 and runs it faster than float32 FMAs (the
    kernels time both once), MKL's bfloat16 GEMM where the CPU has AMX-BF16 (MKL runs it on the
    tiles), tiles widened to float32 otherwise; ``RELPOS_NATIVE_HALF_GEMM=0`` the widened
    tiles, then ``RELPOS_NATIVE_AMX=0`` (older) MKL's GEMM, ``RELPOS_NATIVE_HALF_GEMM=1`` the
    first 16-bit GEMM there is. A switch given a value it does not know is ignored (one
    warning)."""
    fp16 = _HALF_GEMMS["float16"]
    fp16_runs = switch(HALF_GEMM_ENV) == "1" and have_blas() and _exported(fp16)
    return f"{_bf16_gemms(serving)}; float16 {fp16 if fp16_runs else _WIDENED}"


def _bf16_gemms(serving: str | None) -> str:
    """The bfloat16 part of :func:`half_gemms`."""
    symbol = _HALF_GEMMS["bfloat16"]
    want = switch(BF16_GEMM_ENV)
    if not (have_blas() and _exported(symbol)):
        return f"bfloat16 {_WIDENED}"
    flags = cpu_flags() or frozenset()
    amx = amx_tiles(serving)
    dot = (serving in (None, "amx", "avx512bf16") and platform.machine() == "x86_64"
           and {"avx512_bf16", "avx512bw", "avx512vl"} <= flags)
    names = {"amx": "bfloat16 AMX tiles (every tile GEMM)",
             "avx512bf16": "bfloat16 VDPBF16PS on packed tiles (every tile GEMM)",
             "mkl": f"bfloat16 {symbol}", "widened": f"bfloat16 {_WIDENED}"}
    have = {"amx": amx, "avx512bf16": dot, "mkl": True, "widened": True}

    def first_from(engine: str) -> str:
        start = BF16_ENGINES.index(engine)
        return names[next(e for e in BF16_ENGINES[start:] if have[e])]

    if want:
        return first_from(want)
    half = switch(HALF_GEMM_ENV)
    if half == "0":
        return names["widened"]
    if switch(AMX_ENV) == "0":
        return names["mkl"]
    if half == "1":
        return first_from("amx")
    fallback = "mkl" if "amx_bf16" in flags else "widened"
    if amx:
        return names["amx"]
    if dot:
        return (f"{names['avx512bf16']} if this CPU runs it faster than float32 FMAs (timed "
                f"once per process), else {names[fallback].removeprefix('bfloat16 ')}")
    return names[fallback]


def amx_tiles(serving: str | None = None) -> bool:
    """Whether the bfloat16 tile GEMMs (forward and backward) can run on AMX tiles here: a CPU
    with AMX-BF16 (the kernels built for this CPU, or the prebuilt ``amx`` variant, ``serving``,
    use them where Linux grants the tile state; the loaded library's ``build_info()`` says
    ``amx=bf16`` when it did; the other prebuilt variants never do). Whether a call does is
    :func:`half_gemms`' question (the switches)."""
    if serving not in (None, "amx") or platform.system() != "Linux":
        return False
    flags = cpu_flags() or frozenset()
    if platform.machine() != "x86_64" or not {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags:
        return False
    return _amx_granted()


@functools.cache
def _amx_granted() -> bool:
    """Whether Linux grants this process the AMX tile state (what the kernels ask for, once,
    before their first tile GEMM: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA))."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(158, 0x1023, 18)) == 0  # SYS_arch_prctl on x86_64
    except (OSError, AttributeError):
        return False
