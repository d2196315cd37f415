"""Atomic file writes: whatever relpos saves is either the old file or the new one, whole."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_save", "atomic_write", "atomic_write_bytes", "atomic_write_text", "fsync_dir"]


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
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
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
