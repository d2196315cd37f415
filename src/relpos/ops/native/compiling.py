"""Compiling the native kernels: under relpos's file lock, in a child process whose session
dies with it, from scratch into a keyed build directory, the library recorded
(:func:`.verify.write_record`) once the builder has loaded it.

- The compile runs in a child process (``_builder.py``) that leads a session of its own,
  with ninja and every compiler process in it; when the child or this process dies (SIGTERM,
  SIGINT, SIGHUP; on Linux SIGKILL too, through ``PR_SET_PDEATHSIG``) the whole session is
  killed, so no compiler runs on as an orphan. Its id is kept in ``build.session`` while it
  runs; a later build kills what is left of a session recorded there (those processes that
  work in the build directory), should both processes have been killed at once.
- A build killed midway leaves torch's ``FileBaton`` (``lock`` in the build directory),
  on which every later ``cpp_extension.load`` would wait forever. Builds take relpos's lock
  first, so whoever holds it removes a leftover baton: nobody else can be building.
- A library that is absent or damaged (:func:`.verify.check`) is rebuilt from scratch; one
  whose record holds no size (an older relpos's, or written by hand) is loaded in a child
  process first (:func:`.verify.trial_load`), and rebuilt unless it loads there (else its
  record gets the size). Where a build fails, :func:`_cause` says why in one line (the
  missing compiler, the compiler's first error).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from relpos._io import atomic_write_text
from relpos._timings import FIRST_COMPILE_SECONDS, duration_text
from relpos.ops.native._builder import kill_session
from relpos.ops.native.target import NATIVE, SOURCES, Target, library_path
from relpos.ops.native.variants import runnable
from relpos.ops.native.variants import variant as variant_named
from relpos.ops.native.verify import NOT_BUILT, check, checksum_path, trial_load, write_record

__all__ = ["BUILD_SECONDS", "BuildError"]

BUILD_SECONDS = FIRST_COMPILE_SECONDS
"""About how long one build takes on 2 cores (said in the message printed while it builds;
measured: :data:`relpos._timings.FIRST_COMPILE_SECONDS`)."""

_BUILDER = Path(__file__).with_name("_builder.py")
_BATON = "lock"  # torch.utils.file_baton.FileBaton's file in the build directory
_SESSION = "build.session"  # the builder's session id while it runs
_LOG = "build.log"


class BuildError(RuntimeError):
    """The kernels could not be built or loaded: ``cause`` in one line; ``output`` the build's
    output; ``log`` the file that holds it (None when none was written)."""

    def __init__(self, cause: str, *, output: str = "", log: Path | None = None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.output = output
        self.log = log


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




def _build_locked(directory: Path, target: Target, *, quiet: bool, exclusive: bool,
                  what: str = "the native CPU kernels, once,") -> float | None:
    """Under relpos's lock (``exclusive``: one that excludes every other process): unless
    ``directory`` holds a verified library of ``target``, build it from scratch and record
    its checksum and size. The seconds the build took, or None when there was one already."""
    library = library_path(directory, target)
    _clear_killed_build(directory, baton=exclusive)
    found = check(library)
    if found.problem is None and found.sized:
        return None
    problem = found.problem
    if problem is None:  # a record without a size (an older relpos's, or written by hand)
        problem = (trial_load(library) if _runs_here(target) else
                   f"the record of {library.name} holds no size, and this CPU cannot test it")
        if problem is None:  # it loads in a child process: the record gets its size
            write_record(library)
            return None
    _preflight()
    if not quiet:
        why = "" if problem == NOT_BUILT else f"; rebuilding: {problem}"
        print(f"relpos: compiling {what} {duration_text(BUILD_SECONDS)} on 2 cores "
              f"(into {directory}{why})",
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
    write_record(library)
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
    paths = [library, checksum_path(library), directory / ".ninja_log",
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


