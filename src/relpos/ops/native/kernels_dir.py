"""Prebuilt kernels, for machines that cannot compile (no compiler in a container image, a
read-only software tree): ``relpos kernels --build --into DIR`` (:func:`build_into`) compiles
portable variants (``amx``, ``avx512bf16``, ``avx512``, ``avx2``, ``baseline``:
:mod:`.variants`) into ``DIR``, and ``RELPOS_KERNELS_DIR=DIR`` makes every process load the
best variant this CPU runs from there, verified first (:mod:`.verify`), before looking at the
per-user cache.

That directory is never written to: a damaged, unreadable or missing variant is skipped, a
directory that cannot be searched (a tree made under umask 077, read by another user) is
passed by, each with one warning, and the per-user cache serves (built there if it has to
be). A variant whose record holds no size is loaded first in a child process
(:func:`.verify.trial_load`), once per library.

Each load is recorded in the loading user's cache instead: ``<cache>/prebuilt-loads/``, one
stamp per variant directory (keyed by its real path; the stamp's time is the last load, its
text the path and the library a trial load vouched for), which :mod:`.pruning` reads.

Environment:
    RELPOS_KERNELS_DIR: a directory of prebuilt kernels, searched first, never written to.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from relpos import _env
from relpos._io import atomic_write_text
from relpos.ops.native.compiling import _build_locked, _FileLock
from relpos.ops.native.target import Target, cache_root, library_path
from relpos.ops.native.variants import runnable, variants
from relpos.ops.native.variants import variant as variant_named
from relpos.ops.native.verify import NOT_BUILT, check, import_library, read_small, trial_load

__all__ = ["KERNELS_DIR_ENV", "Prebuilt", "build_into", "prebuilt", "prebuilt_root"]

KERNELS_DIR_ENV = "RELPOS_KERNELS_DIR"
LOADS = "prebuilt-loads"  # the user cache's folder of load stamps


def prebuilt_root() -> Path | None:
    """The kernels directory ``RELPOS_KERNELS_DIR`` names, or None when it names none."""
    return _env.path(KERNELS_DIR_ENV)


@dataclass(frozen=True)
class Prebuilt:
    """One variant's place in a kernels directory: its ``library``, whether this CPU
    ``runs`` it, ``problem`` (why it must not be loaded; None when it is sound), whether its
    record holds the library's size (``sized``; else a trial load vouches for it) and the
    library's ``identity`` (:attr:`.verify.Check.identity`)."""

    variant: str
    library: Path
    runs: bool
    problem: str | None
    sized: bool = True
    identity: str = ""

    @property
    def state(self) -> str:
        if self.problem is None:
            return "built" if self.runs else "built (this CPU does not run it)"
        if self.problem == NOT_BUILT:
            return "absent"
        if "cannot be read" in self.problem:
            return f"unreadable: {self.problem}"
        return f"damaged: {self.problem}"


def prebuilt(root: Path) -> list[Prebuilt]:
    """The variants of this architecture in the kernels directory ``root``, best first, for
    this torch and these sources (reads the libraries to check them; loads nothing; a file
    that cannot be read is a variant's problem, never an error)."""
    found = []
    for v in variants():
        target = Target(v.name)
        library = library_path(root / target.directory_name, target)
        verdict = check(library)
        found.append(Prebuilt(v.name, library, runnable(v), verdict.problem, verdict.sized,
                              verdict.identity))
    return found


def _unsearchable(root: Path) -> str | None:
    """Why ``root`` cannot be searched ("cannot be searched (Permission denied)"), None where
    it can or does not exist."""
    try:
        os.stat(os.path.join(root, "."))  # resolving "." in it takes search permission
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        return f"cannot be searched ({error.strerror or error})"
    return None


def load_prebuilt(root: Path) -> tuple[ModuleType | None, str | None]:
    """The best variant in ``root`` this CPU runs, verified and loaded (else None), and what
    was skipped on the way, or why nothing serves (one sentence for a warning; None when the
    best variant served). Never raises for what the directory holds or denies."""
    problem = _unsearchable(root)
    if problem is None:
        try:
            return _load_best(root)
        except OSError as error:  # a file that could be found but not read, a vanished one
            problem = f"searching it failed ({error.strerror or error})"
    return None, f"{KERNELS_DIR_ENV}={root} is not used: it {problem}"


def _load_best(root: Path) -> tuple[ModuleType | None, str | None]:
    skipped = []
    for entry in prebuilt(root):
        if not entry.runs or entry.problem == NOT_BUILT:
            continue
        problem = entry.problem
        if problem is None and not entry.sized and not _vouched(entry):
            problem = trial_load(entry.library)  # (a damaged library kills that process)
            if problem is None:
                _record_load(entry, vouch=True)
        if problem is None:
            try:
                module = import_library(entry.library)
            except (ImportError, OSError) as error:  # built for another system (its glibc)
                skipped.append(f"{entry.variant}: {entry.library.name} does not load ({error})")
                continue
            _record_load(entry)
            note = (f"{KERNELS_DIR_ENV}={root}: skipped {'; '.join(skipped)}; the "
                    f"{entry.variant} build serves") if skipped else None
            return module, note
        skipped.append(f"{entry.variant}: {problem}")
    import torch

    runs = [v.name for v in variants() if runnable(v)]
    why = (f"skipped {'; '.join(skipped)}" if skipped
           else f"it holds no build of this relpos for torch {torch.__version__} that this "
                f"CPU runs (looked for {', '.join(runs)}"
                f"{'' if os.path.isdir(root) else '; the directory does not exist'})")
    return None, f"{KERNELS_DIR_ENV}={root} is not used: {why}"


def load_stamp(directory: Path) -> Path:
    """The stamp in this user's cache of the loads of the variant ``directory``."""
    key = hashlib.sha256(os.fsencode(os.path.realpath(directory))).hexdigest()[:32]
    return cache_root() / LOADS / key


def _stamp_lines(stamp: Path) -> list[str]:
    try:
        return read_small(stamp).splitlines()
    except (OSError, ValueError):
        return []


def _vouched(entry: Prebuilt) -> bool:
    """Whether a trial load vouched for this very library (its identity) before."""
    lines = _stamp_lines(load_stamp(entry.library.parent))
    return len(lines) > 1 and lines[1] == entry.identity


def _record_load(entry: Prebuilt, *, vouch: bool = False) -> None:
    """Stamp the load of ``entry`` in this user's cache (``vouch``: a trial load vouched for
    its library); nothing where the cache cannot be written."""
    stamp = load_stamp(entry.library.parent)
    lines = _stamp_lines(stamp)
    vouched = entry.identity if vouch else (lines[1] if len(lines) > 1 else "")
    text = f"{os.path.realpath(entry.library.parent)}\n{vouched}\n"
    with contextlib.suppress(OSError):
        if "\n".join(lines) + "\n" == text:
            os.utime(stamp)
        else:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(stamp, text)


def build_into(root: Path, names: list[str] | None = None, *, quiet: bool = False
               ) -> list[Prebuilt]:
    """Compile the portable variants ``names`` (default: every variant of this architecture)
    into the kernels directory ``root``, for ``RELPOS_KERNELS_DIR``; one already there and
    sound is kept. Each variant's directory keeps its library, checksum and build log (not
    the object files). Raises :class:`.compiling.BuildError` when a build fails. What
    ``root`` holds afterwards."""
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
