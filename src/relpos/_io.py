"""Atomic file writes: whatever relpos saves is either the old file or the new one, whole.

The new content goes to a temporary file beside the target, ``.<name>.<pid>.<random>.tmp``,
which is renamed over the target. A process killed in between leaves that file behind; the
next successful write in the same directory removes such leftovers (see
:func:`remove_stale_temporaries`). :func:`atomic_directory` does the same for a whole
directory (a temporary directory of the same name pattern, renamed into place).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "atomic_directory",
    "atomic_save",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "fsync_dir",
    "remove_stale_temporaries",
]

# The temporaries of atomic_save (files) and atomic_directory (directories): "." + target
# name + "." + writer's pid + "." + the 8 characters tempfile.mkstemp / mkdtemp draw from
# [a-z0-9_] + ".tmp".
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<pid>[0-9]+)\.[a-z0-9_]{8}\.tmp$")
# Those of earlier relpos versions had no pid: "." + target name + "." + 8 characters + ".tmp".
_OLD_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp$")
#: A temporary file whose writer cannot be asked (an earlier relpos's, without a pid in its
#: name, or on a platform without a process probe) is stale after this many seconds.
STALE_AGE_S = 3600.0


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename inside ``directory`` durable (best effort: not every platform can)."""
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _prefix(target: Path) -> str:
    """The ``mkstemp`` / ``mkdtemp`` prefix of a temporary of ``target`` (``_TEMPORARY``)."""
    return f".{target.name}.{os.getpid()}."


def _check_parent(target: Path) -> None:
    if not target.parent.is_dir():
        raise FileNotFoundError(f"output directory {str(target.parent)!r} does not exist")


def atomic_save(path: str | os.PathLike[str], save: Callable[[str], object]) -> Path:
    """Call ``save(tmp_path)`` on a temporary file beside ``path``, fsync it, rename it over
    ``path`` and fsync the directory. On any error the temporary file is removed and ``path``
    is untouched. The file gets the mode a plain ``open()`` would give it (umask applied).

    Raises:
        FileNotFoundError: if the directory of ``path`` does not exist.
    """
    target = Path(path)
    _check_parent(target)
    fd, tmp = tempfile.mkstemp(prefix=_prefix(target), suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private (0600)
        save(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)
    remove_stale_temporaries(target.parent, target.name)
    return target


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> Path:
    """Like :func:`atomic_save`, with ``write(handle)`` writing to an open binary file."""

    def save(tmp: str) -> None:
        with open(tmp, "wb") as handle:
            write(handle)

    return atomic_save(path, save)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write(path, lambda handle: handle.write(data))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str], *, replace: bool = False) -> Iterator[Path]:
    """Write the directory ``path`` atomically: ``with atomic_directory(path) as tmp:`` fills
    ``tmp``, and ``path`` is then either what it was or the complete new directory.

    ``tmp`` is a fresh empty directory beside ``path``, named as :func:`atomic_save` names its
    temporaries (``.<name>.<pid>.<random>.tmp``), with the mode a plain ``mkdir`` would give
    it (umask applied). When the block ends normally, every file under ``tmp`` and ``tmp``
    itself are fsynced and ``tmp`` is renamed to ``path``; an existing directory at ``path``
    (``replace=True``) is first renamed aside to another such temporary name, renamed back
    if the rename of ``tmp`` fails, and removed once ``tmp`` is in place (between the two
    renames ``path`` is briefly absent). Then the parent directory is fsynced and the
    temporary directories of ``path`` whose writer no longer runs (interrupted writes) are
    removed. When the block raises, ``tmp`` is removed and ``path`` is untouched.

    Raises:
        FileNotFoundError: if the directory of ``path`` does not exist.
        FileExistsError: if ``path`` exists and is not a directory, or is a directory and
            ``replace`` is False (checked on entry and again before the rename).
    """
    target = Path(path)
    _check_parent(target)
    _check_replaceable(target, replace)
    tmp = Path(tempfile.mkdtemp(prefix=_prefix(target), suffix=".tmp", dir=target.parent))
    aside: Path | None = None
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes the directory private (0700)
        yield tmp
        _fsync_tree(tmp)
        _check_replaceable(target, replace)
        if os.path.lexists(target):  # move the old one aside, then swap
            aside = Path(tempfile.mkdtemp(prefix=_prefix(target), suffix=".tmp",
                                          dir=target.parent))
            os.rmdir(aside)  # a free temporary name
            os.replace(target, aside)
        os.replace(tmp, target)
    except BaseException:
        if aside is not None and not os.path.lexists(target):
            os.replace(aside, target)  # put the old one back
            aside = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if aside is not None:
        _remove(aside)
    fsync_dir(target.parent)
    for stale in _stale_temporaries(target.parent, target.name, directories=True):
        _remove(Path(stale.path))


def _check_replaceable(target: Path, replace: bool) -> None:
    if not os.path.lexists(target):
        return
    if not target.is_dir():
        raise FileExistsError(f"{str(target)!r} exists and is not a directory")
    if not replace:
        raise FileExistsError(f"{str(target)!r} exists; replace=True replaces it")


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, ``root`` last."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            file = os.path.join(folder, name)
            if not os.path.islink(file):
                with open(file, "rb") as handle:
                    os.fsync(handle.fileno())
        fsync_dir(folder)


def _remove(path: Path) -> None:
    """Remove a directory tree, or a file or link; errors are ignored."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _running(pid: int) -> bool | None:
    """Whether process ``pid`` runs on this host (None: cannot tell; not on Windows, where
    ``os.kill(pid, 0)`` is no probe)."""
    if pid == os.getpid():
        return True  # another thread of this process may be writing
    if pid < 1 or os.name != "posix":
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


def remove_stale_temporaries(
    directory: str | os.PathLike[str], name: str | None = None
) -> list[Path]:
    """Remove the temporary files that interrupted atomic writes left in ``directory``.

    Only files named as :func:`atomic_save` names them are touched: those of a writer
    process that no longer runs on this host (where that cannot be told, those older than
    :data:`STALE_AGE_S`), and, for the target ``name`` only, those of earlier relpos versions
    (their names hold no pid) older than :data:`STALE_AGE_S`. Nothing else in the directory
    is removed; errors are ignored.

    Returns:
        The files removed.
    """
    removed: list[Path] = []
    for entry in _stale_temporaries(directory, name, directories=False):
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed.append(Path(entry.path))
    return removed


def _stale_temporaries(
    directory: str | os.PathLike[str], name: str | None, *, directories: bool
) -> Iterator[os.DirEntry[str]]:
    """The temporaries in ``directory`` that :func:`remove_stale_temporaries` removes
    (``directories=False``), or the temporary directories of :func:`atomic_directory` for the
    target ``name`` whose writer no longer runs (where that cannot be told, those older than
    :data:`STALE_AGE_S`)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    now = time.time()
    for entry in entries:
        stale = False
        with contextlib.suppress(OSError):
            match = _TEMPORARY.match(entry.name)
            if match is not None and (not directories or match["name"] == name):
                running = _running(int(match["pid"]))
            elif (
                not directories
                and (old := _OLD_TEMPORARY.match(entry.name)) is not None
                and old["name"] == name
            ):
                running = None
            else:
                continue
            if directories:
                if not entry.is_dir(follow_symlinks=False):
                    continue
            elif not entry.is_file(follow_symlinks=False):
                continue
            if running is None:
                running = now - entry.stat(follow_symlinks=False).st_mtime < STALE_AGE_S
            stale = not running
        if stale:
            yield entry
