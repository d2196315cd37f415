"""Pruning the builds an installation does not use (``relpos kernels --prune [DAYS]``): those
of other relpos sources, torch versions or CPUs, in the per-user cache or in a kernels
directory made by ``relpos kernels --build --into``.

Each build directory goes under its lock, taken without waiting (a process building or
loading there keeps it), renamed aside before it is deleted; a process that waited on that
lock meanwhile takes the lock at the path again. With ``DAYS`` a build some process loaded
within the last ``DAYS`` days stays. When that was:

- in the per-user cache: each load stamps the build's lock file (builds of releases before
  that stamp: their newest file);
- in a kernels directory, which loads never write to: the newest of the variant's build,
  its library's access time (every load reads the library whole to check it; file systems
  record that lazily, within a day under Linux's default ``relatime``, so a variant stays a
  day longer by it), and the stamps of this user's loads (``<cache>/prebuilt-loads/``,
  :mod:`.kernels_dir`). Where the file system records no access times (mounted
  ``noatime``), other users' loads cannot be seen, and pruning with ``DAYS`` is refused.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from relpos.ops.native.kernels_dir import load_stamp
from relpos.ops.native.target import _NATIVE, Target, kernels_root
from relpos.ops.native.variants import variants

__all__ = ["Pruned", "last_use_unknown", "megabytes", "older_builds", "other_builds",
           "prune"]

_DAY = 86400.0
_LIBRARY_SUFFIXES = (".so", ".pyd", ".dylib")

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

def _size_and_age(directory: Path, *, kernels_dir: bool = False, lag: float = 0.0
                  ) -> tuple[int, float]:
    """The bytes under ``directory`` and the days since a process last loaded it (see the
    module's docstring; ``kernels_dir``: a variant in a kernels directory, whose library's
    access time may be ``lag`` seconds behind its last read)."""
    total, newest, accessed = 0, 0.0, 0.0
    for folder, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(folder, name))
                total += st.st_size
                newest = max(newest, st.st_mtime)
                if name.endswith(_LIBRARY_SUFFIXES):
                    accessed = max(accessed, st.st_atime + lag)
    if kernels_dir:
        newest = max(newest, accessed)
        with contextlib.suppress(OSError):
            newest = max(newest, os.stat(load_stamp(directory)).st_mtime)
    return total, max(0.0, (time.time() - newest) / _DAY)


def last_use_unknown(root: Path) -> str | None:
    """Why the last use of the builds in the kernels directory ``root`` cannot be known (its
    file system records no access times), or None."""
    try:
        flags = os.statvfs(root).f_flag
    except (OSError, AttributeError):  # not there yet (nothing to prune), not POSIX
        return None
    if flags & getattr(os, "ST_NOATIME", 0):
        return (f"{root} is on a file system mounted noatime: when a process of another user "
                "last loaded a variant there cannot be known (loads never write there)")
    return None


def other_builds(root: Path | None = None) -> list[Pruned]:
    """The builds this installation does not use (other relpos sources, torch versions or
    CPUs), with their sizes, in the user cache's ``kernels/`` (``root`` None: all but this
    CPU's build) or in the kernels directory ``root`` (all but this architecture's variants);
    removes nothing."""
    if root is None:
        where, keep = kernels_root(), {_NATIVE.directory_name}
    else:
        where, keep = root, {Target(v.name).directory_name for v in variants()}
    try:
        entries = sorted(where.iterdir())
    except OSError:
        return []
    found = []
    for d in entries:
        with contextlib.suppress(OSError):  # (an entry that cannot be looked at stays)
            if (d.name not in keep and (_BUILD_NAME.fullmatch(d.name)
                                        or d.name.startswith(_PRUNING))
                    and d.is_dir() and not d.is_symlink()):
                found.append(Pruned(d.name, *_size_and_age(d, kernels_dir=root is not None)))
    return found



def older_builds() -> str:
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
    made by :func:`.kernels_dir.build_into`) every build this installation does not use:
    those of other relpos sources, torch versions or CPUs (:func:`other_builds`), unless a
    process loaded it within the last ``unused_days`` days (a cache shared by machines:
    another machine's build; a kernels directory: another environment's variant; see the
    module's docstring). Only directories named as builds are touched. A build whose lock a
    process holds (it is building or loading there) stays. Another environment sharing the
    cache rebuilds its own on first use. What was found, each with whether it was removed.

    Raises:
        ValueError: ``unused_days`` is given for a kernels directory whose last uses cannot
            be known (:func:`last_use_unknown`).
    """
    if root is not None and unused_days > 0:
        unknown = last_use_unknown(root)
        if unknown is not None:
            raise ValueError(f"cannot prune by days of disuse: {unknown}; prune without DAYS "
                             "once no environment reads the other versions' variants")
    done = []
    for found in other_builds(root):
        directory = (kernels_root() if root is None else root) / found.name
        unused = found.unused_days
        if root is not None:  # the access time may lag a day behind the last load
            unused = _size_and_age(directory, kernels_dir=True, lag=_DAY)[1]
        if unused < unused_days and not found.name.startswith(_PRUNING):
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
    the lock at the path again: :class:`.compiling._FileLock`): the new path, or why it
    stays."""
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


