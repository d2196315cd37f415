"""Build the native CPU kernels on first use, once per machine, and load them.

The C++ sources (``csrc/``) travel with the package. The first call that needs them compiles
them with ``torch.utils.cpp_extension.load`` (ninja, ``-O3 -march=native``, OpenMP as torch
uses it) into a cache directory keyed by the torch version, the sources' hash and the CPU's
instruction set (:mod:`.target`); later calls, and later processes, load the compiled module
from there. A file lock (``build.lock``) makes concurrent processes (torchrun ranks,
pytest-xdist workers) compile once: the others wait and load the result.

The jobs, one module each:

- :mod:`.engines`: what the kernels are built for here (instruction set, vector code), the
  switches (``RELPOS_NATIVE*``, read by :mod:`relpos._env`), and the GEMM engines a call runs
  on, as the loaded kernels say;
- :mod:`.target`: what a build compiles for, and where builds live;
- :mod:`.verify`: whether a library may be loaded (its checksum and size record, its ELF
  headers, a trial load in a child process), decided without loading it here;
- :mod:`.compiling`: the build, under the lock, in a child process whose session dies with
  it (no orphan compiler), from scratch where a library is absent or damaged;
- :mod:`.kernels_dir`: prebuilt variants (``relpos kernels --build --into``,
  ``RELPOS_KERNELS_DIR``), searched first, never written to;
- :mod:`.pruning`: removing the builds this installation does not use;
- here: :func:`load` (the order: prebuilt, then the user cache, then the fallback) and
  :func:`status`.

A cache that cannot be written (a read-only image or shared directory) holding a complete,
verified build is loaded as it is, without the lock and without writing anything. Each load
stamps the lock file's time, the build's last use (``prune(unused_days=)``).

Where the build cannot happen (no C++ compiler, no ninja, a failing build, a read-only cache
without a usable build), relpos says so in one warning, the cause first (the missing
compiler, the compiler's first error), and where the full output is (``build.log`` in the
build directory); the other backends serve every call: relpos never fails for want of a
compiler. ``RELPOS_NATIVE=0`` turns the kernels off (no build, no warning).

Environment:
    RELPOS_NATIVE: ``0`` turns the native kernels off (the other switches: :mod:`.engines`).
    RELPOS_KERNELS_DIR: a directory of prebuilt kernels, searched first, never written to.
    RELPOS_CACHE_DIR: where compiled kernels live (default ``$XDG_CACHE_HOME/relpos`` or
        ``~/.cache/relpos``), under ``kernels/``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from relpos.ops.native.compiling import BUILD_SECONDS, BuildError, _build_locked, _cause, _FileLock
from relpos.ops.native.engines import (
    BF16_ENGINES,
    BF16_GEMM_ENV,
    FLOAT_ENGINES,
    FLOAT_GEMM_ENV,
    build_facts,
    disabled,
    gemm_engines,
    has_vectors,
    have_blas,
    isa,
    vector_code,
)
from relpos.ops.native.engines import (
    _cpu_flags as _cpu_flags,  # (reached here by tests/test_sysinfo.py)
)
from relpos.ops.native.kernels_dir import (
    KERNELS_DIR_ENV,
    Prebuilt,
    build_into,
    load_prebuilt,
    prebuilt,
    prebuilt_root,
)
from relpos.ops.native.pruning import Pruned, megabytes, older_builds, other_builds, prune
from relpos.ops.native.target import (
    NATIVE,
    SOURCES,
    Target,
    build_directory,
    cache_root,
    library_path,
)
from relpos.ops.native.verify import NOT_BUILT, check, checksum_path, import_library, trial_load

__all__ = [
    "BF16_ENGINES",
    "BF16_GEMM_ENV",
    "BUILD_SECONDS",
    "FLOAT_ENGINES",
    "FLOAT_GEMM_ENV",
    "KERNELS_DIR_ENV",
    "NATIVE",
    "SOURCES",
    "BuildError",
    "KernelStatus",
    "Prebuilt",
    "Pruned",
    "Target",
    "build_directory",
    "build_facts",
    "build_into",
    "disabled",
    "failure",
    "failure_log",
    "gemm_engines",
    "has_vectors",
    "have_blas",
    "isa",
    "library_path",
    "load",
    "loaded",
    "megabytes",
    "other_builds",
    "prebuilt",
    "prebuilt_root",
    "prune",
    "status",
    "vector_code",
]

_cache_root = cache_root  # (names reached here by tests)
_checksum_path = checksum_path


def _problem(library: Path) -> str | None:
    """Why ``library`` must not be loaded (:data:`NOT_BUILT` when absent), None when it is
    sound (:func:`.verify.check`)."""
    return check(library).problem


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
        found = check(library)
        problem = found.problem
        if problem is None and not found.sized:  # (a record without a size: a trial first)
            problem = trial_load(library)
        if problem is None:
            return import_library(library)
        raise BuildError(f"the cache {directory} cannot be written "
                         f"({error.strerror or error}) and holds no usable build: "
                         f"{problem}") from error
    try:
        built = _build_locked(directory, Target(), quiet=quiet, exclusive=lock.exclusive)
        module = import_library(library)
        with contextlib.suppress(OSError):  # the build's last use, for prune(unused_days=)
            os.utime(lock.path)
        if built is not None and not quiet:
            print(f"relpos: native kernels built in {built:.0f} s{older_builds()}",
                  file=sys.stderr, flush=True)
        return module
    finally:
        lock.release()


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
            _module, unused = load_prebuilt(root)
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


def loaded() -> ModuleType | None:
    """The kernels this process has loaded, or None (loads and builds nothing)."""
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
    sound); ``gemms``: what a call made now runs its GEMMs on, per dtype, as the kernels this
    process loaded say (:func:`.engines.gemm_engines`), None where it loaded none."""

    enabled: bool
    built: bool
    directory: Path
    isa: str
    torch_version: str
    failure: str | None
    damaged: str | None = None
    prebuilt_root: Path | None = None
    prebuilt: tuple[Prebuilt, ...] = ()
    vectors: str = ""  # the kernels' vector code (vector_code())
    others: tuple[Pruned, ...] = ()  # the cache's builds this installation does not use
    gemms: dict[str, str] | None = None

    @property
    def serving(self) -> Prebuilt | None:
        """The prebuilt variant a load would use (the best sound one this CPU runs), or None
        (the user cache's build serves)."""
        return next((p for p in self.prebuilt if p.runs and p.problem is None), None)


def status() -> KernelStatus:
    """Whether the kernels are built for this machine (and sound), where, and for which
    instruction set; the prebuilt variants of ``RELPOS_KERNELS_DIR``; the GEMM engines, where
    this process has loaded the kernels (builds and loads nothing)."""
    import torch

    directory = build_directory()
    problem = _problem(library_path(directory))
    root = prebuilt_root()
    found = tuple(prebuilt(root)) if root is not None else ()  # reads each library once
    serving = next((p.variant for p in found if p.runs and p.problem is None), None)
    return KernelStatus(
        enabled=not disabled(), built=problem is None, directory=directory, isa=isa(),
        torch_version=torch.__version__, failure=_failure,
        damaged=None if problem in (None, NOT_BUILT) else problem,
        prebuilt_root=root, prebuilt=found,
        vectors=vector_code(serving), others=tuple(other_builds()),
        gemms=gemm_engines(_module) if _module is not None and not disabled() else None,
    )
