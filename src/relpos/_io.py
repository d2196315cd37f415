"""Atomic file writes: whatever relpos saves is either the old file or the new one, whole.

The new content goes to a temporary file beside the target, ``.<name>.<pid>.<random>.tmp``,
which is renamed over the target. A process killed in between leaves that file behind; the
next successful write in the same directory removes such leftovers (see
:func:`remove_stale_temporaries`).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "atomic_save",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "fsync_dir",
    "remove_stale_temporaries",
]

# The temporary files of atomic_save: "." + target name + "." + writer's pid + "." + the 8
# characters tempfile.mkstemp draws from [a-z0-9_] + ".tmp".
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


def atomic_save(path: str | os.PathLike[str], save: Callable[[str], object]) -> Path:
    """Call ``save(tmp_path)`` on a temporary file beside ``path``, fsync it, rename it over
    ``path`` and fsync the directory. On any error the temporary file is removed and ``path``
    is untouched. The file gets the mode a plain ``open()`` would give it (umask applied).

    Raises:
        FileNotFoundError: if the directory of ``path`` does not exist.
    """
    target = Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(f"output directory {str(target.parent)!r} does not exist")
    fd, tmp = tempfile.mkstemp(
        prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent
    )
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
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        with contextlib.suppress(OSError):
            match = _TEMPORARY.match(entry.name)
            if match is not None:
                running = _running(int(match["pid"]))
            elif (old := _OLD_TEMPORARY.match(entry.name)) is not None and old["name"] == name:
                running = None
            else:
                continue
            if not entry.is_file(follow_symlinks=False):
                continue
            if running is None:
                running = now - entry.stat(follow_symlinks=False).st_mtime < STALE_AGE_S
            if not running:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed
