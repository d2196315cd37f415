"""Build the native CPU kernels on first use, once per machine, and load them.

The C++ sources (``csrc/``) travel with the package. The first call that needs them compiles
them with ``torch.utils.cpp_extension.load`` (ninja, ``-O3 -march=native``, OpenMP as torch
uses it) into a cache directory keyed by the torch version, the sources' hash and the CPU's
instruction set; later calls, and later processes, load the compiled module from there. A file
lock makes concurrent processes (torchrun ranks, pytest-xdist workers) compile once: the others
wait and load the result.

Where the build cannot happen (no C++ compiler, no ninja, a failing build), relpos says so in
one warning and the other backends serve every call: relpos never fails for want of a
compiler. ``RELPOS_NATIVE=0`` turns the kernels off (no build, no warning).

Environment:
    RELPOS_NATIVE: ``0`` turns the native kernels off.
    RELPOS_CACHE_DIR: where compiled kernels live (default ``$XDG_CACHE_HOME/relpos`` or
        ``~/.cache/relpos``), under ``kernels/``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from relpos._sysinfo import cpuinfo

__all__ = [
    "BUILD_SECONDS",
    "KernelStatus",
    "build_directory",
    "disabled",
    "load",
    "status",
]

_CSRC = Path(__file__).with_name("csrc")
SOURCES = (_CSRC / "relpos_native.cpp",)

BUILD_SECONDS = 45
"""About how long one build takes on 2 cores (said in the message printed while it builds)."""

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


def disabled() -> bool:
    """Whether ``RELPOS_NATIVE=0`` (or ``false``/``off``/``no``) turns the kernels off."""
    return os.environ.get("RELPOS_NATIVE", "1").strip().lower() in ("0", "false", "off", "no")


def _cache_root() -> Path:
    given = os.environ.get("RELPOS_CACHE_DIR")
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "relpos"


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
    kernels then call for their block GEMMs; without them they use plain C++ loops."""
    path = _libtorch_cpu()
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(path)
        return all(hasattr(lib, s) for s in ("sgemm_", "dgemm_"))
    except OSError:
        return False


def _flags() -> tuple[list[str], list[str]]:
    cflags = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-Wno-unknown-pragmas"]
    if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        cflags.append("-march=native" if platform.machine() in ("x86_64", "AMD64")
                      else "-mcpu=native")
    if have_blas():
        cflags.append("-DRELPOS_HAVE_BLAS")
    return cflags, ["-fopenmp"]


def _key() -> str:
    import torch

    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes())
    h.update(repr(_flags()).encode())
    h.update(_cpu_flags().encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


def build_directory() -> Path:
    """Where this machine's kernels are (or will be) compiled:
    ``<cache>/kernels/torch<version>-<isa>-<hash of sources, flags and CPU>``."""
    import torch

    version = torch.__version__.replace("+", "_")
    return _cache_root() / "kernels" / f"torch{version}-{isa()}-{_key()}"


def _module_name() -> str:
    return f"relpos_native_{_key()}"


def _built(directory: Path) -> bool:
    return any(directory.glob(_module_name() + "*.so")) or any(
        directory.glob(_module_name() + "*.pyd"))


class _FileLock:
    """An exclusive lock on ``path`` across processes (fcntl where it exists)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> _FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: cpp_extension's own baton remains
            return self
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            try:
                import fcntl

                fcntl.flock(self.fd, fcntl.LOCK_UN)
            except ImportError:  # pragma: no cover
                pass
            os.close(self.fd)
            self.fd = None


def _compile(directory: Path, *, quiet: bool) -> ModuleType:
    from torch.utils import cpp_extension

    cflags, ldflags = _flags()
    with _FileLock(directory / "build.lock"):
        fresh = not _built(directory)
        if fresh and not quiet:
            print(f"relpos: compiling the native CPU kernels, once, about {BUILD_SECONDS} s "
                  f"(into {directory})", file=sys.stderr, flush=True)
        start = time.perf_counter()
        module = cpp_extension.load(
            name=_module_name(), sources=[str(s) for s in SOURCES], build_directory=str(directory),
            extra_cflags=cflags, extra_ldflags=ldflags, verbose=False,
        )
        if fresh and not quiet:
            print(f"relpos: native kernels built in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
    return module


def load(*, quiet: bool = False) -> ModuleType | None:
    """The compiled kernels, building them first if this machine has none; None when they are
    off (``RELPOS_NATIVE=0``) or cannot be built (then one warning says why)."""
    global _module, _failure
    if disabled():
        return None
    if _module is not None:
        return _module
    if _failure is not None:
        return None
    with _lock:
        if _module is not None or _failure is not None:
            return _module
        directory = build_directory()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            _module = _compile(directory, quiet=quiet)
        except Exception as error:  # no compiler, no ninja, a failing build: fall back
            first = str(error).strip().splitlines()
            _failure = f"{type(error).__name__}: {first[0] if first else ''}"[:300]
            warnings.warn(
                f"relpos: the native CPU kernels could not be built ({_failure}); the PyTorch "
                "backends serve every call instead (set RELPOS_NATIVE=0 to skip the attempt)",
                RuntimeWarning, stacklevel=3,
            )
            return None
    return _module


def failure() -> str | None:
    """Why the last build attempt failed, or None."""
    return _failure


@dataclass(frozen=True)
class KernelStatus:
    """What ``relpos kernels`` prints."""

    enabled: bool
    built: bool
    directory: Path
    isa: str
    blas: str
    torch_version: str
    failure: str | None


def status() -> KernelStatus:
    """Whether the kernels are built for this machine, where, and for which instruction set
    (builds nothing)."""
    import torch

    directory = build_directory()
    return KernelStatus(
        enabled=not disabled(), built=_built(directory), directory=directory, isa=isa(),
        blas="mkl (libtorch's sgemm_/dgemm_)" if have_blas() else "plain C++ loops",
        torch_version=torch.__version__, failure=_failure,
    )
