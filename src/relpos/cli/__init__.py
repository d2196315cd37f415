"""The ``relpos`` command line. One module per subcommand (``export_onnx`` is
``relpos export-onnx``), each declaring ``SUMMARY`` (its line in ``relpos --help``),
``DESCRIPTION`` (its ``--help`` text), ``add_arguments(parser) -> None`` and
``run(args) -> int``; :func:`build_parser` registers them all the same way. The argument
types and options they share live in :mod:`relpos.cli._args`, never in a sibling. No
subcommand module imports torch, numpy or matplotlib at import time, so ``relpos --help``
and ``relpos table`` start without them.

Errors the user can fix print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from relpos.cli._args import CLIError, subcommand

# Subcommand modules, in the order ``relpos --help`` lists them.
SUBCOMMANDS: tuple[str, ...] = (
    "experiment", "train", "generate", "table", "heatmap", "bench", "export_onnx", "export_ct2",
    "kernels",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CLIError(message)


def build_parser() -> argparse.ArgumentParser:
    from relpos._version import __version__

    parser = _Parser(
        prog="relpos",
        description="Clipped relative position attention (Shaw et al., 2018): tools.",
    )
    parser.add_argument("--version", action="version", version=f"relpos {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"relpos.cli.{name}")
        p = subcommand(sub, name.replace("_", "-"), module.run, module.SUMMARY,
                             module.DESCRIPTION)
        module.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``relpos`` command line; returns the exit status."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if getattr(args, "func", None) is None:
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except CLIError as err:
        print(f"relpos: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError, PermissionError) as err:
        print(f"relpos: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except MemoryError:
        print("relpos: error: out of memory; try smaller sizes", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("relpos: interrupted", file=sys.stderr)
        return 130


def _one_line(err: BaseException, limit: int | None = None) -> str:
    """The message of ``err`` on one line; with ``limit``, at most that many characters (and
    the exception's type name when it has no message)."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if limit is None:
        return text
    text = text or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
