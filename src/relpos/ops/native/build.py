"""Build the native CPU kernels on first use, once per machine, and load them.

The C++ sources (``csrc/``) travel with the package. The first call that needs them compiles
them with ``torch.utils.cpp_extension.load`` (ninja, ``-O3 -march=native``, OpenMP as torch
uses it) into a cache directory keyed by the torch version, the sources' hash and the CPU's
instruction set; later calls, and later processes, load the compiled module from there. A file
lock (``build.lock``) makes concurrent processes (torchrun ranks, pytest-xdist workers)
compile once: the others wait and load the result.

What keeps a cache sound:

- The compiled library's sha256 is recorded beside it (``<library>.sha256``, written
  atomically once the build has loaded it) and checked before every load: a library without
  it (a build killed while linking) or that no longer matches it (truncated, overwritten) is
  never loaded: it is rebuilt from scratch, announced as a first build is.
- The compile runs in a child process (``_builder.py``) that leads a session of its own,
  with ninja and every compiler process in it; when the child or this process dies (SIGTERM,
  SIGINT, SIGHUP; on Linux SIGKILL too, through ``PR_SET_PDEATHSIG``) the whole session is
  killed, so no compiler runs on as an orphan. Its id is kept in ``build.session`` while it
  runs; a later build kills what is left of a session recorded there (those processes that
  work in the build directory), should both processes have been killed at once.
- A build killed midway leaves torch's ``FileBaton`` (``lock`` in the build directory),
  on which every later ``cpp_extension.load`` would wait forever. Builds take relpos's lock
  first, so whoever holds it removes a leftover baton: nobody else can be building.
- A cache that cannot be written (a read-only image or shared directory) holding a complete,
  verified build is loaded as it is, without the lock and without writing anything.
- Every relpos or torch upgrade adds a build directory; :func:`prune` (``relpos kernels
  --prune``) removes the ones this installation does not use, each under its lock, taken
  without waiting (a process building or loading there keeps it), renamed aside before it is
  deleted; a process that waited on that lock meanwhile takes the lock at the path again.
  Each load stamps the lock file's time, the build's last use (``prune(unused_days=)``).

Prebuilt kernels, for machines that cannot compile (no compiler in a container image, a
read-only software tree): ``relpos kernels --build --into DIR`` (:func:`build_into`) compiles
portable variants (``amx``, ``avx512bf16``, ``avx512``, ``avx2``, ``baseline``:
:mod:`.variants`) into ``DIR``, and
``RELPOS_KERNELS_DIR=DIR`` makes every process load the best variant this CPU runs from there,
checksum first, before looking at the per-user cache. That directory is never written to: a
damaged or missing variant is skipped with one warning, and the per-user cache serves (built
there if it has to be).

Where the build cannot happen (no C++ compiler, no ninja, a failing build, a read-only cache
without a usable build), relpos says so in one warning, the cause first (the missing
compiler, the compiler's first error), and where the full output is (``build.log`` in the
build directory); the other backends serve every call: relpos never fails for want of a
compiler. ``RELPOS_NATIVE=0`` turns the kernels off (no build, no warning).

Environment:
    RELPOS_NATIVE: ``0`` turns the native kernels off.
    RELPOS_KERNELS_DIR: a directory of prebuilt kernels, searched first, never written to.
    RELPOS_CACHE_DIR: where compiled kernels live (default ``$XDG_CACHE_HOME/relpos`` or
        ``~/.cache/relpos``), under ``kernels/``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

from relpos._io import atomic_write_text
from relpos._sysinfo import cpu_flags, cpuinfo
from relpos.ops.native._builder import kill_session
from relpos.ops.native.variants import runnable, variants
from relpos.ops.native.variants import variant as variant_named

__all__ = [
    "BUILD_SECONDS",
    "KERNELS_DIR_ENV",
    "BuildError",
    "KernelStatus",
    "Prebuilt",
    "Pruned",
    "Target",
    "build_directory",
    "build_into",
    "disabled",
    "failure",
    "failure_log",
    "has_vectors",
    "library_path",
    "load",
    "megabytes",
    "other_builds",
    "prebuilt",
    "prebuilt_root",
    "prune",
    "status",
]

_CSRC = Path(__file__).with_name("csrc")
SOURCES = (_CSRC / "relpos_native.cpp", _CSRC / "decode_step.cpp")

BUILD_SECONDS = 45
"""About how long one build takes on 2 cores (said in the message printed while it builds)."""

def disabled() -> bool:
    """Whether ``RELPOS_NATIVE=0`` (or ``false``/``off``/``no``) turns the kernels off."""
    return os.environ.get("RELPOS_NATIVE", "1").strip().lower() in ("0", "false", "off", "no")


def _cache_root() -> Path:
    # Absolute: the build runs in a child process with another working directory.
    given = os.environ.get("RELPOS_CACHE_DIR")
    if given:
        return Path(given).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return ((Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "relpos").absolute()


def _kernels_root() -> Path:
    return _cache_root() / "kernels"


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


SGEMM_ENV = "RELPOS_NATIVE_SGEMM"  # =blas: float32 GEMMs on the BLAS (read once per process)
BLAS_ENV = "RELPOS_NATIVE_BLAS"  # =aten: the BLAS GEMMs on libtorch's matrix multiply

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
    ``RELPOS_NATIVE_BLAS=aten`` asks) on libtorch's own matrix multiply."""
    want = os.environ.get(SGEMM_ENV, "")
    if want not in ("", "vec", "blas"):
        return f"float32 calls refused: {SGEMM_ENV}={want!r} is neither vec nor blas"
    route = os.environ.get(BLAS_ENV, "")
    if route not in ("", "aten", "blas"):
        return f"every call refused: {BLAS_ENV}={route!r} is neither aten nor blas"
    aten = route == "aten" or not have_blas()
    blas = _ATEN_GEMM if aten else "MKL's sgemm_"
    dgemm = _ATEN_GEMM if aten else "MKL's dgemm_ (libtorch's)"
    vectors = _vectors(serving)
    if vectors is None or want == "blas" or (vectors == "AVX2" and want != "vec"):
        other = f" ({SGEMM_ENV}=vec: the kernels' AVX2 vectors)" if vectors == "AVX2" else ""
        return f"float32 {blas}{other}; float64 {dgemm}"
    return f"float32 on the kernels' {vectors} vectors ({SGEMM_ENV}=blas: {blas}); float64 {dgemm}"


HALF_GEMM_ENV = "RELPOS_NATIVE_HALF_GEMM"

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


BF16_GEMM_ENV = "RELPOS_NATIVE_BF16_GEMM"
AMX_ENV = "RELPOS_NATIVE_AMX"  # the older switch: =0 asks for MKL's bfloat16 GEMM

#: The engines a bfloat16 call can run its GEMMs on, in the order one the build or CPU lacks
#: gives way to the next (what ``RELPOS_NATIVE_BF16_GEMM`` names).
BF16_ENGINES = ("amx", "avx512bf16", "mkl", "widened")

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
    first 16-bit GEMM there is."""
    wish = os.environ.get(HALF_GEMM_ENV)
    fp16 = _HALF_GEMMS["float16"]
    fp16_runs = wish == "1" and have_blas() and _exported(fp16)
    return f"{_bf16_gemms(serving)}; float16 {fp16 if fp16_runs else _WIDENED}"


def _bf16_gemms(serving: str | None) -> str:
    """The bfloat16 part of :func:`half_gemms`."""
    symbol = _HALF_GEMMS["bfloat16"]
    want = os.environ.get(BF16_GEMM_ENV, "")
    if want and want not in BF16_ENGINES:
        return (f"bfloat16 calls refused: {BF16_GEMM_ENV}={want!r} is none of "
                f"{', '.join(BF16_ENGINES)}")
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
    if os.environ.get(HALF_GEMM_ENV) == "0":
        return names["widened"]
    if os.environ.get(AMX_ENV) == "0":
        return names["mkl"]
    if os.environ.get(HALF_GEMM_ENV) == "1":
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


def _isa_flags(variant: str) -> tuple[str, ...]:
    """The compiler flags that choose the instruction set: this CPU's (``native``) or a
    portable variant's (:mod:`.variants`)."""
    if variant != NATIVE:
        return variant_named(variant).flags
    if platform.machine() in ("x86_64", "AMD64"):
        return ("-march=native",)
    if platform.machine() in ("aarch64", "arm64"):
        return ("-mcpu=native",)
    return ()


@dataclass(frozen=True)
class Target:
    """What one build compiles for: this CPU (``variant`` :data:`NATIVE`, the per-user cache)
    or a portable variant (``amx``, ``avx512bf16``, ``avx512``, ``avx2``, ``baseline``: a
    kernels directory)."""

    variant: str = "native"

    @property
    def cflags(self) -> list[str]:
        cflags = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-Wno-unknown-pragmas",
                  *_isa_flags(self.variant)]
        if have_blas():
            cflags.append("-DRELPOS_HAVE_BLAS")
        return cflags

    @property
    def ldflags(self) -> list[str]:
        return ["-fopenmp"]

    @functools.cached_property
    def key(self) -> str:
        """A hash of the sources, the flags, torch's version and (``native`` only: it compiles
        for exactly this CPU) the CPU's flags."""
        import torch

        h = hashlib.sha256()
        for src in SOURCES:
            h.update(src.read_bytes())
        h.update(repr((self.cflags, self.ldflags)).encode())
        if self.variant == NATIVE:
            h.update(_cpu_flags().encode())
        h.update(torch.__version__.encode())
        return h.hexdigest()[:16]

    @property
    def module_name(self) -> str:
        return f"relpos_native_{self.key}"

    @property
    def directory_name(self) -> str:
        """``torch<version>-<isa>-<key>``; ``<isa>`` is torch's CPU capability on this
        architecture for a native build (``x86_64-AVX512``), the variant for a portable one
        (``x86_64-avx2``)."""
        import torch

        version = torch.__version__.replace("+", "_")
        where = isa() if self.variant == NATIVE else f"{platform.machine()}-{self.variant}"
        return f"torch{version}-{where}-{self.key}"


NATIVE = "native"
_NATIVE = Target()


def build_directory() -> Path:
    """Where this machine's kernels are (or will be) compiled:
    ``<cache>/kernels/torch<version>-<isa>-<hash of sources, flags and CPU>``."""
    return _kernels_root() / _NATIVE.directory_name


def library_path(directory: Path | None = None, target: Target = _NATIVE) -> Path:
    """The compiled library of ``target`` in ``directory`` (default :func:`build_directory`)."""
    directory = build_directory() if directory is None else directory
    return directory / (target.module_name + (".pyd" if os.name == "nt" else ".so"))


_BUILDER = Path(__file__).with_name("_builder.py")
_BATON = "lock"  # torch.utils.file_baton.FileBaton's file in the build directory
_SESSION = "build.session"  # the builder's session id while it runs
_LOG = "build.log"
_NOT_BUILT = "not built yet"


class BuildError(RuntimeError):
    """The kernels could not be built or loaded: ``cause`` in one line; ``output`` the build's
    output; ``log`` the file that holds it (None when none was written)."""

    def __init__(self, cause: str, *, output: str = "", log: Path | None = None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.output = output
        self.log = log


def _checksum_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _problem(library: Path) -> str | None:
    """Why ``library`` must not be loaded (``_NOT_BUILT`` when absent); None when it is
    complete: its sha256 is the one recorded when it was built."""
    if not library.is_file():
        return _NOT_BUILT
    try:
        recorded = _checksum_path(library).read_text(encoding="ascii").split()[0]
    except (OSError, UnicodeDecodeError, IndexError):
        return (f"{library.name} has no recorded checksum (a build that was interrupted, or "
                "one by an older relpos)")
    try:
        actual = _sha256(library)
    except OSError as error:
        return f"{library.name} cannot be read ({error.strerror or error})"
    if actual != recorded:
        return (f"{library.name} is damaged (its sha256 is not the one recorded when it was "
                "built)")
    return None


_LOCK_ATTEMPTS = 8  # tries at a build's lock that a prune may move away meanwhile


class _FileLock:
    """An exclusive lock on ``path`` across processes (fcntl where it exists; ``exclusive``
    says whether it is held as such)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.exclusive = False

    def acquire(self) -> None:
        for attempt in range(_LOCK_ATTEMPTS):
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                import fcntl
            except ImportError:  # pragma: no cover - not POSIX: cpp_extension's baton remains
                return
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(self.fd)
                self.fd = None
                raise
            self.exclusive = True
            # (a file system whose inode numbers do not hold still gets a bounded number of
            # tries, never a loop: the lock is kept as it is at the last)
            if self._still_in_place() or attempt == _LOCK_ATTEMPTS - 1:
                return
            # prune() moved the directory away (under this lock) while this process waited:
            # the lock it holds guards nothing; take the one at the path again.
            self.release()
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def _still_in_place(self) -> bool:
        """Whether the locked file is still the one at ``path``."""
        assert self.fd is not None
        try:
            here = os.stat(self.path)
        except FileNotFoundError:
            return False
        held = os.fstat(self.fd)
        return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)

    def release(self) -> None:
        if self.fd is not None:
            if self.exclusive:
                import fcntl

                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
            self.exclusive = False

    def __enter__(self) -> _FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _import(library: Path) -> ModuleType:
    """Load ``library`` as the kernels' Python module (as ``cpp_extension.load`` does)."""
    import importlib.util

    import torch  # noqa: F401  (the library links against libtorch: torch loads it first)

    name = library.name.split(".")[0]  # the module's name, as its PyInit_<name> says
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:  # pragma: no cover - a .so path always has one
        raise BuildError(f"{library} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read_only(error: OSError) -> bool:
    return isinstance(error, PermissionError) or error.errno in (
        errno.EROFS, errno.EACCES, errno.EPERM)


def _load_or_build(directory: Path, *, quiet: bool) -> ModuleType:
    library = library_path(directory)
    lock = _FileLock(directory / "build.lock")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as error:
        if not _read_only(error):
            raise
        # A cache this process cannot write: a complete, verified build is used as it is
        # (no lock, nothing written); nothing else can be done here.
        problem = _problem(library)
        if problem is None:
            return _import(library)
        raise BuildError(f"the cache {directory} cannot be written "
                         f"({error.strerror or error}) and holds no usable build: "
                         f"{problem}") from error
    try:
        built = _build_locked(directory, _NATIVE, quiet=quiet, exclusive=lock.exclusive)
        module = _import(library)
        with contextlib.suppress(OSError):  # the build's last use, for prune(unused_days=)
            os.utime(lock.path)
        if built is not None and not quiet:
            print(f"relpos: native kernels built in {built:.0f} s{_older_builds()}",
                  file=sys.stderr, flush=True)
        return module
    finally:
        lock.release()


def _build_locked(directory: Path, target: Target, *, quiet: bool, exclusive: bool,
                  what: str = "the native CPU kernels, once,") -> float | None:
    """Under relpos's lock (``exclusive``: one that excludes every other process): unless
    ``directory`` holds a verified library of ``target``, build it from scratch and record
    its checksum. The seconds the build took, or None when there was one already."""
    library = library_path(directory, target)
    _clear_killed_build(directory, baton=exclusive)
    problem = _problem(library)
    if problem is None:
        return None
    _preflight()
    if not quiet:
        why = "" if problem == _NOT_BUILT else f"; rebuilding: {problem}"
        print(f"relpos: compiling {what} about {BUILD_SECONDS} s (into {directory}{why})",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    _clean(directory, library)
    try:
        output = _compile(directory, target)
    except BuildError as error:
        error.log = _write_log(directory, error.output)
        raise
    log = _write_log(directory, output)
    if not library.is_file():
        raise BuildError(f"the build finished without {library.name}", output=output, log=log)
    atomic_write_text(_checksum_path(library), f"{_sha256(library)}  {library.name}\n")
    return time.perf_counter() - start


def _clear_killed_build(directory: Path, *, baton: bool) -> None:
    """What a killed build left (relpos's lock held): the processes of its session that still
    work in ``directory``, and torch's baton (``baton``: only where relpos's lock excludes
    every other builder)."""
    session = directory / _SESSION
    with contextlib.suppress(OSError, ValueError):
        kill_session(int(session.read_text(encoding="ascii")), cwd=str(directory))
    with contextlib.suppress(OSError):
        session.unlink()
    if baton:
        with contextlib.suppress(FileNotFoundError):
            (directory / _BATON).unlink()


def _clean(directory: Path, library: Path) -> None:
    """Remove every output of an earlier build: each build in a keyed directory starts from
    scratch (an object file written by a killed compiler is as suspect as the library)."""
    paths = [library, _checksum_path(library), directory / ".ninja_log",
             directory / ".ninja_deps", *directory.glob("*.o"), *directory.glob("*.obj"),
             *directory.glob(library.name.split(".")[0] + "*")]
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _preflight() -> None:
    """The causes ninja and torch would bury in their output: no compiler, no ninja."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    program = (shlex.split(compiler) or [compiler])[0]
    if shutil.which(program) is None:
        raise BuildError(
            f"the C++ compiler was not found: CXX names {program!r}, which is no program "
            "here; set CXX to an installed C++ compiler (g++ or clang++)" if "CXX" in os.environ
            else f"the C++ compiler was not found: {program!r} (the default; CXX names "
            "another) is not on PATH; install g++ or clang++, or set CXX")
    if not cpp_extension.is_ninja_available():
        raise BuildError("ninja was not found (pip install ninja)")


def _spec(directory: Path, target: Target) -> dict[str, object]:
    # A variant this CPU cannot run is compiled, never loaded here ("load": false). The
    # builder runs in `directory`: a relative one (relpos kernels --build --into kernels)
    # would be read from there, so it goes absolute.
    return {"name": target.module_name, "sources": [str(s) for s in SOURCES],
            "directory": str(directory.absolute()), "cflags": target.cflags,
            "ldflags": target.ldflags,
            "parent": os.getpid(), "load": _runs_here(target)}


def _runs_here(target: Target) -> bool:
    return target.variant == NATIVE or runnable(variant_named(target.variant))


def _compile(directory: Path, target: Target) -> str:
    """Compile the kernels of ``target`` into ``directory`` in a child process
    (``_builder.py``) whose session is killed whole if either process dies; the build's
    output. Raises :class:`BuildError` (the cause, and the output) when it fails."""
    if os.name != "posix" or not sys.executable:  # pragma: no cover - no session to own
        return _compile_here(directory, target)
    child = subprocess.Popen(
        [sys.executable, str(_BUILDER), json.dumps(_spec(directory, target))], cwd=directory,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    session = directory / _SESSION
    try:
        with contextlib.suppress(OSError):
            atomic_write_text(session, f"{child.pid}\n")
        out, _ = child.communicate()
    except BaseException:  # KeyboardInterrupt, SystemExit from a signal handler, ...
        child.terminate()  # the builder kills its session, then exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=10)
        child.kill()
        child.wait()
        raise
    finally:
        # What is left of a builder that was killed itself (those of its processes that
        # work in the build directory: its pid may be another's once it is reaped).
        kill_session(child.pid, cwd=str(directory))
        with contextlib.suppress(OSError):
            session.unlink()
    output = out.decode("utf-8", errors="replace")
    if child.returncode < 0:
        raise BuildError(f"the build process was killed by signal {-child.returncode}",
                         output=output)
    if child.returncode != 0:
        raise BuildError(_cause(output), output=output)
    return output


def _compile_here(directory: Path, target: Target) -> str:  # pragma: no cover - not POSIX
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(name=target.module_name, sources=[str(s) for s in SOURCES],
                           build_directory=str(directory), extra_cflags=target.cflags,
                           extra_ldflags=target.ldflags, verbose=False)
    except Exception as error:
        output = f"{type(error).__name__}: {error}"
        raise BuildError(_cause(output), output=output) from error
    return ""


# Lines of a build's output that are no cause: ninja's progress and failed command lines,
# its summary, the compiler's context lines.
_NOISE = re.compile(r"^(\[\d+/\d+\]|FAILED:|ninja: build stopped|In file included from|"
                    r"from |\d+ \| |\| |\S+: In (function|member function|instantiation))")
_ERROR = re.compile(r"\b(error|fatal|not found|no such file|undefined reference|cannot|"
                    r"killed|permission denied)\b", re.IGNORECASE)
_TORCH_PREFIX = re.compile(r"^(\w+Error: )?Error building extension '[^']*':? ?")
_CAUSE_CHARS = 500


def _cause(output: str) -> str:
    """The line of a failed build's output that says why: the first error after torch's
    "Error building extension" (the compiler's first error, a missing program), else the
    last meaningful line; one line, at most ``_CAUSE_CHARS`` characters (errors say their
    cause first)."""
    text = output
    marker = re.search(r"(\w+Error: )?Error building extension", text)
    if marker:  # torch's own warnings (its compiler checks) come before it
        text = text[marker.start():]
    lines: list[str] = []
    skip_command = False
    for raw in text.splitlines():
        line = _TORCH_PREFIX.sub("", raw.strip())
        if skip_command:  # the command line ninja prints after "FAILED: <output>"
            skip_command = False
            continue
        if raw.startswith("FAILED:"):
            skip_command = True
        if line and not _NOISE.match(line):
            lines.append(line)
    cause = next((line for line in lines if _ERROR.search(line)), lines[-1] if lines else "")
    cause = cause or "the build failed without saying why"
    return cause if len(cause) <= _CAUSE_CHARS else cause[:_CAUSE_CHARS - 1] + "…"


def _write_log(directory: Path, output: str) -> Path | None:
    """The build's full output in ``directory/build.log`` (None when it cannot be written)."""
    try:
        return atomic_write_text(directory / _LOG, output)
    except OSError:
        return None


# ------------------------------------------------------------------------------------------
# Prebuilt kernels: a directory of portable builds, searched first, never written to

KERNELS_DIR_ENV = "RELPOS_KERNELS_DIR"


def prebuilt_root() -> Path | None:
    """The kernels directory ``RELPOS_KERNELS_DIR`` names, or None when it names none."""
    given = os.environ.get(KERNELS_DIR_ENV, "").strip()
    return Path(given).expanduser() if given else None


@dataclass(frozen=True)
class Prebuilt:
    """One variant's place in a kernels directory: its ``library``, whether this CPU
    ``runs`` it, and ``problem`` (why it must not be loaded; None when it is sound)."""

    variant: str
    library: Path
    runs: bool
    problem: str | None

    @property
    def state(self) -> str:
        if self.problem is None:
            return "built" if self.runs else "built (this CPU does not run it)"
        if self.problem == _NOT_BUILT:
            return "absent"
        return f"damaged: {self.problem}"


def prebuilt(root: Path) -> list[Prebuilt]:
    """The variants of this architecture in the kernels directory ``root``, best first, for
    this torch and these sources (reads the libraries to check them; loads nothing)."""
    found = []
    for v in variants():
        target = Target(v.name)
        library = library_path(root / target.directory_name, target)
        found.append(Prebuilt(v.name, library, runnable(v), _problem(library)))
    return found


def _load_prebuilt(root: Path) -> tuple[ModuleType | None, str | None]:
    """The best variant in ``root`` this CPU runs, verified and loaded (else None), and what
    was skipped on the way, or why nothing serves (one sentence for a warning; None when the
    best variant served)."""
    skipped = []
    for entry in prebuilt(root):
        if not entry.runs or entry.problem == _NOT_BUILT:
            continue
        if entry.problem is None:
            try:
                module = _import(entry.library)
            except (ImportError, OSError) as error:  # built for another system (its glibc)
                skipped.append(f"{entry.variant}: {entry.library.name} does not load ({error})")
                continue
            note = (f"{KERNELS_DIR_ENV}={root}: skipped {'; '.join(skipped)}; the "
                    f"{entry.variant} build serves") if skipped else None
            return module, note
        skipped.append(f"{entry.variant}: {entry.problem}")
    import torch

    runs = [v.name for v in variants() if runnable(v)]
    why = (f"skipped {'; '.join(skipped)}" if skipped
           else f"it holds no build of this relpos for torch {torch.__version__} that this "
                f"CPU runs (looked for {', '.join(runs)}"
                f"{'' if root.is_dir() else '; the directory does not exist'})")
    return None, f"{KERNELS_DIR_ENV}={root} is not used: {why}"


def build_into(root: Path, names: list[str] | None = None, *, quiet: bool = False
               ) -> list[Prebuilt]:
    """Compile the portable variants ``names`` (default: every variant of this architecture)
    into the kernels directory ``root``, for ``RELPOS_KERNELS_DIR``; one already there and
    sound is kept. Each variant's directory keeps its library, checksum and build log (not
    the object files). Raises :class:`BuildError` when a build fails. What ``root`` holds
    afterwards."""
    chosen = [variant_named(name) for name in names] if names else list(variants())
    for i, v in enumerate(chosen, 1):
        target = Target(v.name)
        directory = root / target.directory_name
        with _FileLock(directory / "build.lock") as lock:
            seconds = _build_locked(directory, target, quiet=quiet, exclusive=lock.exclusive,
                                    what=f"the {v.name} kernels ({i}/{len(chosen)}),")
            if seconds is not None:  # (the builder loaded it where this CPU runs it)
                for path in (*directory.glob("*.o"), *directory.glob("*.obj"),
                             directory / ".ninja_log", directory / ".ninja_deps"):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                if not quiet:
                    print(f"relpos: {v.name} kernels built in {seconds:.0f} s",
                          file=sys.stderr, flush=True)
    return prebuilt(root)


#: A build directory's name (:attr:`Target.directory_name`): ``torch<version>-<isa or
#: variant>-<16 hex digits>``; nothing else in a cache or kernels directory is pruned.
_BUILD_NAME = re.compile(r"torch\S+-[0-9a-f]{16}")
_PRUNING = ".pruning-"  # a build directory moved aside by prune(), removed next


@dataclass(frozen=True)
class Pruned:
    """One build directory :func:`prune` found: its ``name``, its ``size`` in bytes, the
    days since a process last loaded it (``unused_days``), and ``kept``: why it stays (None:
    removed)."""

    name: str
    size: int
    unused_days: float = 0.0
    kept: str | None = None

    @property
    def last_used(self) -> str:
        """``unused_days`` in words: ``"40 minutes ago"``, ``"5 hours ago"``, ``"3 days
        ago"``."""
        hours = self.unused_days * 24
        count, unit = ((round(hours * 60), "minute") if hours < 1 else (round(hours), "hour")
                       if hours < 48 else (round(self.unused_days), "day"))
        return f"{count} {unit}{'' if count == 1 else 's'} ago"


def _size_and_age(directory: Path) -> tuple[int, float]:
    """The bytes under ``directory`` and the days since its last use: a load stamps the
    build's lock (builds of releases before that stamp: the newest file's time)."""
    total, newest = 0, 0.0
    for folder, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(folder, name))
                total += st.st_size
                newest = max(newest, st.st_mtime)
    return total, max(0.0, (time.time() - newest) / 86400)


def other_builds(root: Path | None = None) -> list[Pruned]:
    """The builds this installation does not use (other relpos sources, torch versions or
    CPUs), with their sizes, in the user cache's ``kernels/`` (``root`` None: all but this
    CPU's build) or in the kernels directory ``root`` (all but this architecture's variants);
    removes nothing."""
    if root is None:
        root, keep = _kernels_root(), {_NATIVE.directory_name}
    else:
        keep = {Target(v.name).directory_name for v in variants()}
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    return [Pruned(d.name, *_size_and_age(d)) for d in entries
            if d.is_dir() and not d.is_symlink() and d.name not in keep
            and (_BUILD_NAME.fullmatch(d.name) or d.name.startswith(_PRUNING))]


def _older_builds() -> str:
    """After a build: how many other builds the cache holds (an upgrade leaves the last
    one's), and how to remove them; empty where there are none."""
    others = other_builds()
    if not others:
        return ""
    return (f"; the cache holds {len(others)} other build{'' if len(others) == 1 else 's'} "
            f"({megabytes(sum(o.size for o in others))}; `relpos kernels --prune` removes "
            "them)")


def megabytes(size: int) -> str:
    """``size`` bytes as the kernels' messages say it: ``"84.6 MB"``."""
    return f"{size / 1e6:.1f} MB"


def prune(root: Path | None = None, *, unused_days: float = 0.0) -> list[Pruned]:
    """Remove from ``root`` (default: the user cache's ``kernels/``; else a kernels directory
    made by :func:`build_into`) every build this installation does not use: those of other
    relpos sources, torch versions or CPUs (:func:`other_builds`), unless a process loaded it
    within the last ``unused_days`` days (a cache shared by machines: another machine's
    build). Only directories named as builds are touched. A build whose lock a process holds
    (it is building or loading there) stays. Another environment sharing the cache rebuilds
    its own on first use. What was found, each with whether it was removed."""
    done = []
    for found in other_builds(root):
        directory = (_kernels_root() if root is None else root) / found.name
        if found.unused_days < unused_days and not found.name.startswith(_PRUNING):
            done.append(replace(found, kept=f"loaded {found.last_used}"))
            continue
        aside = directory if found.name.startswith(_PRUNING) else _move_aside(directory)
        kept = aside if isinstance(aside, str) else None
        if isinstance(aside, Path):
            shutil.rmtree(aside, ignore_errors=True)
            if aside.exists():
                kept = f"could not be removed (left as {aside.name})"
        done.append(replace(found, kept=kept))
    return done


def _move_aside(directory: Path) -> Path | str:
    """Under the build's lock, taken without waiting, rename ``directory`` to a ``.pruning-``
    name, where no process looks for a build (one that waited on the lock meanwhile takes
    the lock at the path again: :class:`_FileLock`): the new path, or why it stays."""
    try:
        fd = os.open(directory / "build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        return f"cannot be written ({error.strerror or error})"
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # pragma: no cover - not POSIX
            pass
        except BlockingIOError:
            return "in use: a process is building or loading it"
        aside = directory.with_name(f"{_PRUNING}{directory.name}-{os.getpid()}")
        try:
            directory.rename(aside)
        except OSError as error:
            return f"cannot be removed ({error.strerror or error})"
        return aside
    finally:
        os.close(fd)


_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None
_failure_log: Path | None = None


def load(*, quiet: bool = False) -> ModuleType | None:
    """The compiled kernels, building them first if this machine has none; None when they are
    off (``RELPOS_NATIVE=0``) or cannot be built or loaded (then one warning says why)."""
    global _module, _failure, _failure_log
    if disabled():
        return None
    if _module is not None:
        return _module
    if _failure is not None:
        return None
    with _lock:
        if _module is not None or _failure is not None:
            return _module
        root, unused = prebuilt_root(), None
        if root is not None:
            _module, unused = _load_prebuilt(root)
            if _module is not None:
                if unused:  # a better variant is damaged: the image wants fixing
                    warnings.warn(f"relpos: {unused}.", RuntimeWarning, stacklevel=3)
                return _module
        try:
            _module = _load_or_build(build_directory(), quiet=quiet)
        except Exception as error:  # no compiler, no ninja, a failing build: fall back
            if isinstance(error, BuildError):
                _failure, _failure_log = error.cause, error.log
            else:
                _failure = f"{type(error).__name__}: {_cause(str(error))}"
            if unused:
                _failure = f"{unused}; and {_failure}"
            more = f"; the build's full output is in {_failure_log}" if _failure_log else ""
            warnings.warn(
                f"relpos: the native CPU kernels could not be built: {_failure}\n"
                f"The PyTorch backends serve every call instead{more} (set RELPOS_NATIVE=0 to "
                "skip the attempt).",
                RuntimeWarning, stacklevel=3,
            )
            return None
        if unused:
            warnings.warn(f"relpos: {unused}; the kernels in the user cache "
                          f"({build_directory()}) serve instead.", RuntimeWarning, stacklevel=3)
    return _module


def failure() -> str | None:
    """Why the last build attempt failed (one line), or None."""
    return _failure


def failure_log() -> Path | None:
    """The file with the full output of the last failed build, or None."""
    return _failure_log


@dataclass(frozen=True)
class KernelStatus:
    """What ``relpos kernels`` prints. ``built``: a complete, verified library is cached;
    ``damaged``: why the cached library must not be loaded (None when there is none, or it is
    sound)."""

    enabled: bool
    built: bool
    directory: Path
    isa: str
    blas: str  # how the float32 and float64 GEMMs run (float_gemms())
    torch_version: str
    failure: str | None
    damaged: str | None = None
    prebuilt_root: Path | None = None
    prebuilt: tuple[Prebuilt, ...] = ()
    half: str = ""  # how 16-bit inputs' GEMMs run (half_gemms())
    vectors: str = ""  # the kernels' vector code (vector_code())
    others: tuple[Pruned, ...] = ()  # the cache's builds this installation does not use

    @property
    def serving(self) -> Prebuilt | None:
        """The prebuilt variant a load would use (the best sound one this CPU runs), or None
        (the user cache's build serves)."""
        return next((p for p in self.prebuilt if p.runs and p.problem is None), None)


def status() -> KernelStatus:
    """Whether the kernels are built for this machine (and sound), where, and for which
    instruction set; the prebuilt variants of ``RELPOS_KERNELS_DIR`` (builds and loads
    nothing)."""
    import torch

    directory = build_directory()
    problem = _problem(library_path(directory))
    root = prebuilt_root()
    found = tuple(prebuilt(root)) if root is not None else ()  # reads each library once
    serving = next((p.variant for p in found if p.runs and p.problem is None), None)
    return KernelStatus(
        enabled=not disabled(), built=problem is None, directory=directory, isa=isa(),
        blas=float_gemms(serving),
        torch_version=torch.__version__, failure=_failure,
        damaged=None if problem in (None, _NOT_BUILT) else problem,
        prebuilt_root=root, prebuilt=found,
        half=half_gemms(serving), vectors=vector_code(serving), others=tuple(other_builds()),
    )
