"""What one build of the native kernels compiles for (:class:`Target`: this CPU, or a portable
variant) and where builds live: the per-user cache's ``kernels/`` (``RELPOS_CACHE_DIR``), one
directory per build, keyed by the torch version, the instruction set and a hash of the
sources and flags.

Environment:
    RELPOS_CACHE_DIR: where compiled kernels live (default ``$XDG_CACHE_HOME/relpos`` or
        ``~/.cache/relpos``), under ``kernels/``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from relpos import _env
from relpos.ops.native.engines import _cpu_flags, have_blas, isa
from relpos.ops.native.variants import variant as variant_named

__all__ = ["CACHE_DIR_ENV", "NATIVE", "SOURCES", "Target", "build_directory", "cache_root",
           "kernels_root", "library_path"]

_CSRC = Path(__file__).with_name("csrc")
# The translation units the build compiles: the kernels (attention.cpp, which includes the
# headers), the decode step, the bindings. The headers are in the build's key too.
SOURCES = (_CSRC / "attention.cpp", _CSRC / "decode.cpp", _CSRC / "bindings.cpp")
CACHE_DIR_ENV = "RELPOS_CACHE_DIR"


def cache_root() -> Path:
    """relpos's per-user cache: ``RELPOS_CACHE_DIR``, else ``$XDG_CACHE_HOME/relpos``, else
    ``~/.cache/relpos``; absolute (the build runs in a child process with another working
    directory)."""
    given = _env.path(CACHE_DIR_ENV)
    if given is not None:
        return given.absolute()
    xdg = _env.path("XDG_CACHE_HOME")
    return ((xdg if xdg is not None else Path.home() / ".cache") / "relpos").absolute()


def kernels_root() -> Path:
    """Where the per-user cache keeps its builds: ``<cache>/kernels``."""
    return cache_root() / "kernels"


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
        """A hash of the sources (``csrc/``: the translation units and every header, by name
        and content), the flags, torch's version and (``native`` only: it compiles for exactly
        this CPU) the CPU's flags."""
        import torch

        h = hashlib.sha256()
        for src in sorted({*SOURCES, *_CSRC.glob("*.h")}):  # every file the compiler reads
            h.update(src.name.encode() + b"\0" + src.read_bytes())
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
    return kernels_root() / _NATIVE.directory_name


def library_path(directory: Path | None = None, target: Target = _NATIVE) -> Path:
    """The compiled library of ``target`` in ``directory`` (default :func:`build_directory`)."""
    directory = build_directory() if directory is None else directory
    return directory / (target.module_name + (".pyd" if os.name == "nt" else ".so"))

