"""The ``relpos`` command line. One module per subcommand (``export_onnx`` is
``relpos export-onnx``), each declaring ``SUMMARY`` (its line in ``relpos --help``),
``DESCRIPTION`` (its ``--help`` text), ``add_arguments(parser) -> None`` and
``run(args) -> int``; :func:`build_parser` registers them all the same way. The argument
types and options they share live in :mod:`relpos.cli._args`, never in a sibling. No
subcommand module imports torch, numpy or matplotlib at import time, so ``relpos --help``
and ``relpos table`` start without them.

Errors the user can fix print one line on stderr and exit with status 2; a misspelled option
or subcommand gets the closest known one suggested. An interrupt (Ctrl-C) exits with status
130 (``relpos train`` names its last checkpoint: :mod:`relpos.cli._interrupt`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
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
        raise CLIError(message + _closest_choice(message))


def _closest(word: str, known: Sequence[str]) -> str | None:
    """The known word ``word`` most likely misspells, or None."""
    found = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return found[0] if found else None


def _closest_choice(message: str) -> str:
    """``; did you mean 'train'?`` for argparse's ``invalid choice: 'trian' (choose from
    ...)``, or nothing."""
    match = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if not match:
        return ""
    choices = [c.strip().strip("'\"") for c in match.group(2).split(",")]
    near = _closest(match.group(1), choices)
    return f"; did you mean {near!r}?" if near else ""


def _option_hints(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str:
    """``; did you mean --max-distance?`` for the options in ``argv`` that its command does
    not know (nor abbreviates) but one of its own is close to, or nothing."""
    chosen: argparse.ArgumentParser = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            command = next((a for a in argv if a in action.choices), None)
            if command is not None:
                chosen = action.choices[command]
    known = [o for a in chosen._actions for o in a.option_strings if o.startswith("--")]
    hints = {}
    for token in argv:
        flag = token.split("=", 1)[0]
        if token == "--":
            break
        if not flag.startswith("--") or any(k.startswith(flag) for k in known):
            continue
        near = _closest(flag, known)
        if near is not None:
            hints[flag] = near
    if len(hints) == 1:
        return f"; did you mean {next(iter(hints.values()))}?"
    return "; did you mean " + ", ".join(
        f"{near} (for {flag})" for flag, near in hints.items()) + "?" if hints else ""


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
        words = list(sys.argv[1:] if argv is None else argv)
        try:
            args, extras = parser.parse_known_args(words)
        except CLIError as err:  # another error first (a required option): the hint too
            hints = "" if "did you mean" in str(err) else _option_hints(parser, words)
            raise CLIError(f"{err}{hints}") from None
        if extras:
            raise CLIError(f"unrecognized arguments: {' '.join(extras)}"
                           + _option_hints(parser, extras if args.command is None
                                           else [args.command, *extras]))
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
        from relpos.cli._interrupt import exit_status, silent

        if not silent():  # a process of a multi-process run: rank 0 alone says it
            print("relpos: interrupted", file=sys.stderr)
        return exit_status()


def _one_line(err: BaseException, limit: int | None = None) -> str:
    """The message of ``err`` on one line; with ``limit``, at most that many characters (and
    the exception's type name when it has no message)."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if limit is None:
        return text
    text = text or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
