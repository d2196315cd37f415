"""Whether a compiled library of the native kernels may be loaded, decided without loading it
in this process: a damaged library is never ``dlopen``-ed where it would take the process
down (a truncated one dies with SIGBUS, an overwritten one with SIGSEGV).

A build records, once the builder process has loaded the library, its sha256 and its size in
``<library>.sha256`` (``<sha256>  <name>`` as ``sha256sum`` writes it, then ``# size=<bytes>``,
a line ``sha256sum -c`` skips), atomically. :func:`check` requires:

- the record: a regular file of at most 4 KiB (opened without blocking and read to a bound:
  a FIFO or a link to ``/dev/zero`` under that name is refused, never waited on or read
  without end);
- the library: a regular file of the size recorded, whose ELF headers, program headers
  (every segment ``dlopen`` maps) and section headers lie within the file (a truncated
  library fails this even where its checksum was recomputed after the damage: ``sha256sum
  lib > lib.sha256``);
- its sha256: the one recorded.

A record without a size (written by hand, or by an older relpos) vouches for less: such a
library is loaded first in a child process (:func:`trial_load`), whose crash says it is
damaged; the caller remembers the libraries a trial vouched for (their path, size, mtime and
sha256: :attr:`Check.identity`), so it runs once per library.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import stat
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from relpos._io import atomic_write_text

__all__ = ["NOT_BUILT", "Check", "check", "checksum_path", "import_library", "read_small",
           "trial_load", "write_record"]

NOT_BUILT = "not built yet"
_RECORD_BYTES = 4096  # the most a checksum record may hold
_SHA = re.compile(r"[0-9a-f]{64}")
_SIZE = re.compile(r"^#\s*size\s*=\s*(\d+)\s*$", re.MULTILINE)
TRIAL_SECONDS = 120  # the most a trial load may take (a child importing torch: a few seconds)


def checksum_path(library: Path) -> Path:
    """``<library>.sha256``: the record of the library's sha256 and size."""
    return library.with_name(library.name + ".sha256")


def write_record(library: Path) -> None:
    """Record the sha256 and size of ``library`` (after the build loaded it), atomically."""
    with _open_regular(library) as fd:
        size, digest = os.fstat(fd).st_size, _sha256(fd)
    atomic_write_text(checksum_path(library), f"{digest}  {library.name}\n# size={size}\n")


@dataclass(frozen=True)
class Check:
    """What :func:`check` found: ``problem`` (None: sound; :data:`NOT_BUILT`: absent; else
    why it must not be loaded), whether the record holds the library's ``size`` (else a
    trial load in a child process vouches for it), and its ``identity`` (path, size, mtime,
    sha256: what such a trial vouches for)."""

    problem: str | None
    sized: bool = True
    identity: str = ""


class _Refused(ValueError):
    """Why a file cannot be read as what it should be."""


@contextlib.contextmanager
def _open_regular(path: Path) -> Iterator[int]:
    """The descriptor of ``path`` opened for reading without blocking (a FIFO opens at once),
    provided it is a regular file; closed on leaving."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_BINARY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _Refused("is not a regular file")
        yield fd
    finally:
        os.close(fd)


def _sha256(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    for block in iter(lambda: os.read(fd, 1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def read_small(path: Path, limit: int = _RECORD_BYTES) -> str:
    """The text of the small file ``path``: a regular file (opened without blocking) of at
    most ``limit`` bytes, else :class:`_Refused`; OSError where it cannot be read."""
    with _open_regular(path) as fd:
        data = os.read(fd, limit + 1)
    if len(data) > limit:
        raise _Refused(f"is larger than {limit} bytes")
    return data.decode("utf-8", errors="replace")


def _read_record(library: Path) -> tuple[str, int | None]:
    """The sha256 and the size (None where none is recorded) recorded for ``library``;
    raises :class:`_Refused` (why the record cannot be used) or OSError."""
    text = read_small(checksum_path(library))
    first = text.split(maxsplit=1)[0] if text.split() else ""
    if not _SHA.fullmatch(first):
        raise _Refused("holds no sha256")
    size = _SIZE.search(text)
    return first, int(size.group(1)) if size else None


def check(library: Path) -> Check:
    """Whether ``library`` may be loaded: see the module's docstring. Reads the library whole
    (its sha256); never loads it, never blocks on a file that is not a regular one."""
    name = library.name
    try:
        st = os.stat(library)
    except (FileNotFoundError, NotADirectoryError):
        return Check(NOT_BUILT)
    except OSError as error:
        return Check(f"{name} cannot be read ({error.strerror or error})")
    if not stat.S_ISREG(st.st_mode):
        return Check(f"{name} is not a regular file")
    try:
        recorded, size = _read_record(library)
    except (FileNotFoundError, NotADirectoryError):
        return Check(f"{name} has no recorded checksum (a build that was interrupted, or one "
                     "by an older relpos)")
    except (_Refused, OSError) as error:
        why = error.strerror or error if isinstance(error, OSError) else error
        return Check(f"{name} has no usable checksum record: "
                     f"{checksum_path(library).name} {why}")
    try:
        with _open_regular(library) as fd:
            held = os.fstat(fd)
            if size is not None and held.st_size != size:
                return Check(f"{name} is damaged: {held.st_size} bytes, where its build "
                             f"recorded {size} (truncated, or overwritten)")
            elf = _elf_problem(fd, held.st_size)
            if elf is not None:
                return Check(f"{name} is damaged: {elf}")
            actual = _sha256(fd)
    except (_Refused, OSError) as error:
        why = error.strerror or error if isinstance(error, OSError) else error
        return Check(f"{name} cannot be read ({why})")
    if actual != recorded:
        return Check(f"{name} is damaged (its sha256 is not the one recorded when it was "
                     "built)")
    identity = f"{os.path.realpath(library)}\t{held.st_size}\t{held.st_mtime_ns}\t{actual}"
    return Check(None, sized=size is not None, identity=identity)


# ELF: the identification bytes, then per class (1: 32-bit, 2: 64-bit) the header fields from
# e_type on and one program header's (p_type, p_offset, p_filesz at these struct positions).
_ELF_MAGIC = b"\x7fELF"
_ELF_HEADER = {1: "HHIIIIIHHHHHH", 2: "HHIQQQIHHHHHH"}
_ELF_PHDR = {1: ("IIIIIIII", 0, 1, 4), 2: ("IIQQQQQQ", 0, 2, 5)}
_ET_DYN = 3


def _elf_problem(fd: int, size: int) -> str | None:
    """Why the ELF file ``fd`` (``size`` bytes) would not map whole (None: it would, or it is
    no ELF file on a system whose libraries are not: macOS, Windows): its headers, each
    segment and the section headers within the file."""
    os.lseek(fd, 0, os.SEEK_SET)
    head = os.read(fd, 64)
    if head[:4] != _ELF_MAGIC:
        return "it is not an ELF shared library" if sys.platform.startswith("linux") else None
    if len(head) < 16:
        return f"it ends at byte {size}, inside its ELF header (truncated)"
    cls, order = head[4], {1: "<", 2: ">"}.get(head[5])
    if cls not in _ELF_HEADER or order is None:
        return "its ELF header is not one this reader knows"
    fields = order + _ELF_HEADER[cls]
    if len(head) < 16 + struct.calcsize(fields):
        return f"it ends at byte {size}, inside its ELF header (truncated)"
    (e_type, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
     _) = struct.unpack_from(fields, head, 16)
    if e_type != _ET_DYN:
        return "it is not an ELF shared library"
    phdr, at_type, at_offset, at_filesz = _ELF_PHDR[cls]
    if phentsize < struct.calcsize(order + phdr) or phoff + phnum * phentsize > size:
        return f"it ends at byte {size}, before its program headers do (truncated)"
    if shoff and shoff + max(shnum, 1) * shentsize > size:
        return f"it ends at byte {size}, before its section headers do (truncated)"
    os.lseek(fd, phoff, os.SEEK_SET)
    table = os.read(fd, phnum * phentsize)
    for i in range(phnum):
        try:
            entry = struct.unpack_from(order + phdr, table, i * phentsize)
        except struct.error:  # shorter than its size said: cut meanwhile
            return "its program headers end early (truncated)"
        if entry[at_type] != 0 and entry[at_offset] + entry[at_filesz] > size:
            return (f"it ends at byte {size}, before its segment {i} does (which ends at byte "
                    f"{entry[at_offset] + entry[at_filesz]}: truncated)")
    return None


_TRIAL = """\
import importlib.util, os, sys
sys.path[:] = [p for p in sys.path if p]  # nothing from the working directory
import torch  # the library links against libtorch
path = sys.argv[1]
name = os.path.basename(path).split(".")[0]  # as the library's PyInit_<name> says
spec = importlib.util.spec_from_file_location(name, path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.build_info()
"""


def trial_load(library: Path) -> str | None:
    """Load ``library`` in a child process (under :data:`TRIAL_SECONDS`): None when it loads
    there, else why it must not be loaded here (the signal that killed the child: a damaged
    library; or the error it loads with)."""
    try:
        done = subprocess.run([sys.executable, "-c", _TRIAL, str(library)],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=TRIAL_SECONDS)
    except subprocess.TimeoutExpired:
        return f"{library.name} did not load within {TRIAL_SECONDS} s in a test process"
    except OSError as error:
        return f"{library.name} could not be test-loaded ({error.strerror or error})"
    if done.returncode < 0:
        try:
            sig = signal.Signals(-done.returncode).name
        except ValueError:
            sig = f"signal {-done.returncode}"
        return f"{library.name} is damaged: loading it killed a test process ({sig})"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return f"{library.name} does not load ({lines[-1] if lines else 'no error given'})"
    return None


def import_library(library: Path) -> ModuleType:
    """Load ``library`` as the kernels' Python module (as ``cpp_extension.load`` does)."""
    import importlib.util

    import torch  # noqa: F401  (the library links against libtorch: torch loads it first)

    name = library.name.split(".")[0]  # the module's name, as its PyInit_<name> says
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:  # pragma: no cover - a .so path always has one
        raise ImportError(f"{library} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
