"""Argument types and options shared by the ``relpos`` subcommands.

Every subcommand takes its validators from here, never from a sibling subcommand. Nothing
here imports torch, numpy or matplotlib: ``relpos --help`` builds every parser.

An argparse type raises :class:`argparse.ArgumentTypeError`, which the parser turns into
``relpos: error: argument --name: <message>`` (one line on stderr, exit status 2); the
checks that need several options at once raise :class:`relpos.cli.CLIError`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any


class CLIError(Exception):
    """A user error: printed as one line on stderr, exit status 2 (``relpos.cli.CLIError``)."""


__all__ = [
    "add_max_distance",
    "add_no_progress",
    "add_threads",
    "check_output_dir",
    "check_output_file",
    "checkpoint_dir",
    "float_in",
    "int_in",
    "int_list",
    "name_list",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "seed",
    "subcommand",
]

SEED_MAX = 2**64 - 1
"""The largest seed ``torch.manual_seed`` takes."""
THREADS_MAX = 1024
"""The most ``--threads`` a command takes."""


INT_MAX = 2**63 - 1
"""The largest int an option takes (torch's sizes and counts are 64-bit); seeds go to
:data:`SEED_MAX`."""


def _int(text: str, maximum: int = INT_MAX) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
    if value > maximum:
        raise argparse.ArgumentTypeError(f"must be an int <= {maximum}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """argparse type factory: an int in ``low..high`` (``high`` None = no upper bound)."""

    def parse(text: str) -> int:
        value = _int(text, max(INT_MAX, high or 0))
        allowed = "" if high is None else f"; allowed: {low}..{high}"
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text!r}{allowed}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be an int <= {high}, got {text!r}{allowed}")
        return value

    return parse


def int_list(
    minimum: int, maximum: int | None = None, *, distinct: bool = False
) -> Callable[[str], tuple[int, ...]]:
    """argparse type factory: at least one int in ``minimum..maximum`` (None = no upper
    bound), separated by commas (or spaces), as a tuple; ``distinct``: no value twice."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(_int(v, max(INT_MAX, maximum or 0))
                           for v in text.replace(",", " ").split())
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated ints, got {text!r}"
            ) from None
        allowed = "" if maximum is None else f"; allowed: {minimum}..{maximum}"
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated ints >= {minimum}, got {text!r}{allowed}"
            )
        if maximum is not None and max(values) > maximum:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated ints <= {maximum}, got {text!r}{allowed}"
            )
        if distinct:
            _check_distinct(values, text)
        return values

    return parse


def _check_distinct(values: tuple[object, ...], text: str) -> None:
    twice = sorted({str(v) for v in values if values.count(v) > 1})
    if twice:
        raise argparse.ArgumentTypeError(
            f"must be distinct, got {text!r} ({', '.join(twice)} more than once)"
        )


def seed(text: str) -> int:
    """argparse type: a seed, an int in ``0..SEED_MAX`` (what ``torch.manual_seed`` takes)."""
    return int_in(0, SEED_MAX)(text)


def _number(text: str, ok: Callable[[float], bool], allowed: str) -> float:
    """``text`` as a float that passes ``ok``, else an error saying what is ``allowed``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
    return value


def float_in(low: float, high: float) -> Callable[[str], float]:
    """argparse type factory: a number in ``[low, high)``."""
    return lambda text: _number(text, lambda v: low <= v < high,
                                f"a number in [{low:g}, {high:g})")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, lambda v: 0 < v < math.inf, "a number > 0")


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _number(text, lambda v: 0 <= v < math.inf, "a finite number >= 0")


def name_list(
    choices: Collection[str], what: str, *, distinct: bool = False
) -> Callable[[str], tuple[str, ...]]:
    """argparse type factory: at least one of ``choices``, comma-separated, as a tuple;
    ``what`` names them in the message (``"task(s)"``); ``distinct``: no name twice."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {unknown or list(names)!r}; allowed: {', '.join(choices)}"
            )
        if distinct:
            _check_distinct(names, text)
        return names

    return parse


def check_output_file(
    path: str | Path, *, suffixes: Collection[str] | None = None, what: str = "image format"
) -> Path:
    """``path`` as a :class:`~pathlib.Path` after checking it can be written.

    Args:
        path: the file the command will write.
        suffixes: the allowed suffixes (lower case, with the dot); None = any.
        what: what the suffix tells, for the error message.

    Raises:
        CLIError: if the suffix is not allowed, ``path`` is a directory, or its directory
            does not exist or cannot be written.
    """
    target = Path(path)
    if target.is_dir() or str(path).endswith(("/", os.sep)):
        what = "is a directory" if target.is_dir() else "names a directory"
        raise CLIError(f"the output {str(path)!r} {what}; allowed: the path of a file to write")
    if suffixes is not None and target.suffix.lower() not in suffixes:
        raise CLIError(
            f"cannot tell the {what} of {str(path)!r} from its suffix; "
            f"allowed: {', '.join(suffixes)}"
        )
    if target.parent.exists() and not target.parent.is_dir():
        raise CLIError(f"output directory {str(target.parent)!r} is a file, not a directory")
    if not target.parent.is_dir():
        raise CLIError(f"output directory {str(target.parent)!r} does not exist")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise CLIError(f"cannot write in the output directory {str(target.parent)!r}")
    return target


def check_output_dir(path: str | Path, option: str = "--out") -> Path:
    """``path`` as a :class:`~pathlib.Path` after checking it is, or can be made, a
    writable directory (missing parents are created later).

    Raises:
        CLIError: if ``path`` or a parent of it is an existing file, or the nearest
            existing directory cannot be written.
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise CLIError(f"{option} {str(path)!r} is a file; allowed: a directory")
    existing = target
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise CLIError(
            f"{option} {str(path)!r} cannot be created: {str(existing)!r} is a file, not a "
            "directory"
        )
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise CLIError(f"{option} {str(path)!r}: cannot write in {str(existing)!r}")
    return target


def _plain(text: str) -> str:
    """Docstring markup as plain text for ``--help``: ``x`` and :role:`x` become x."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def subcommand(
    subparsers: Any, name: str, run: Callable[[argparse.Namespace], int], summary: str,
    description: str,
) -> argparse.ArgumentParser:
    """Register ``relpos NAME``, which calls ``run(args)``; returns its parser.

    Args:
        subparsers: what ``add_subparsers`` returned.
        name: the subcommand.
        run: its body; returns the exit status.
        summary: its line in ``relpos --help``.
        description: the text of ``relpos NAME --help``.
    """
    p: argparse.ArgumentParser = subparsers.add_parser(
        name, help=summary, description=_plain(description))
    p.set_defaults(func=run)
    return p


def add_max_distance(
    p: Any, default: int | None, help: str | None = None, maximum: int | None = None
) -> None:
    """``--max-distance``/``-k K``: the clip distance (an int in ``0..maximum``; None = no
    upper bound)."""
    p.add_argument(
        "--max-distance",
        "-k",
        type=non_negative_int if maximum is None else int_in(0, maximum),
        default=default,
        metavar="K",
        help=help or f"clip distance k (default {default})",
    )


def add_window(p: Any) -> None:
    """``--left L`` / ``--right R``: an asymmetric clip window ``[-L, +R]`` (each defaults to
    ``--max-distance``)."""
    p.add_argument("--left", type=non_negative_int, metavar="L",
                   help="clip offsets below -L (default: --max-distance)")
    p.add_argument("--right", type=non_negative_int, metavar="R",
                   help="clip offsets above +R (default: --max-distance)")


def window(args: argparse.Namespace) -> int | tuple[int, int]:
    """``K`` or ``(left, right)`` from ``--max-distance`` and ``--left``/``--right``."""
    left = args.max_distance if args.left is None else args.left
    right = args.max_distance if args.right is None else args.right
    return left if left == right else (left, right)


def add_threads(p: Any, help: str) -> None:
    """``--threads N``: torch CPU threads (default None: the command's own default)."""
    p.add_argument("--threads", type=int_in(1, THREADS_MAX), default=None, help=help)


def add_no_progress(p: Any) -> None:
    """``--no-progress``: no progress bar."""
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# What a checkpoint directory holds; relpos train --out DIR writes it in DIR/checkpoints.
_MANIFEST = "latest.json"
_CHECKPOINTS = "checkpoints"


def checkpoint_dir(directory: Path) -> Path:
    """The checkpoint directory of ``directory``: itself if it holds ``latest.json``, else
    its ``checkpoints/`` (the layout ``relpos train --out DIR`` writes).

    Raises:
        CLIError: if neither holds a checkpoint.
    """
    if (directory / _MANIFEST).is_file():
        return directory
    if (directory / _CHECKPOINTS / _MANIFEST).is_file():
        return directory / _CHECKPOINTS
    raise CLIError(
        f"{str(directory)!r} is a directory without a training checkpoint: neither "
        f"{str(directory / _MANIFEST)!r} nor {str(directory / _CHECKPOINTS / _MANIFEST)!r} "
        "exists; allowed: a file saved with relpos.export.save_module, or a relpos train "
        "--out directory"
    )
