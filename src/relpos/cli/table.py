"""``relpos table``: the clipped offset of every key seen from one query.

With no options it prints the worked example of the handbook section on clipped relative
positions (Shaw et al., 2018): length 10, query 5, K = 4, with the embedding-table row each
key reads, the columns of every format::

    Query position: 5
    Maximum relative distance (K): 4

    Position | Raw Offset | Clipped Offset | Table Row
    ------------------------------------------------------
        0    |     -5     |       -4       |    0
    ...
"""

from __future__ import annotations

import argparse
import csv
import io
import json

from relpos._deprecated import module_getattr, moved
from relpos.cli import CLIError, _args

FORMATS = ("text", "csv", "json", "markdown")
DEFAULT_LENGTH = 10
DEFAULT_MAX_DISTANCE = 4
#: Longest table printed (one line per position).
MAX_LENGTH = 100_000

# Column titles of the text table (those of the other formats) and the width of the slot
# each sits in, between the "|" separators; values are centred in their slot.
_TEXT_COLUMNS = (("Position", 9), ("Raw Offset", 12), ("Clipped Offset", 16), ("Table Row", 10))


SUMMARY = "print the clipped offset of every key seen from one query"
DESCRIPTION = """\
Print, for one query position, the raw offset j - i of every key position j, its clipped
value clip(j - i, -K, K), or clip(j - i, -L, R) with --left/--right, and the row of the
embedding table it reads (clipped + K, or + L). The defaults print the worked example of the
handbook section on clipped relative positions (Shaw et al., 2018): length 10, query 5,
K = 4.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``relpos table``."""
    p.add_argument("--length", type=_args.int_in(1, MAX_LENGTH), default=DEFAULT_LENGTH,
                   metavar="N", help=f"number of positions, 1..{MAX_LENGTH} "
                                     f"(default {DEFAULT_LENGTH})")
    p.add_argument("--query", type=_args.non_negative_int, metavar="I",
                   help="query position, 0..N-1 (default N // 2, i.e. 5 for the default length)")
    _args.add_max_distance(p, DEFAULT_MAX_DISTANCE)
    _args.add_window(p)
    p.add_argument("--format", choices=FORMATS, default="text", help="output format (default text)")


Window = int | tuple[int, int]


def _bounds(max_distance: Window) -> tuple[int, int]:
    return (max_distance, max_distance) if isinstance(max_distance, int) else max_distance


def table_rows(length: int, query: int, max_distance: Window) -> list[dict[str, int]]:
    """One row per key position: ``position``, ``raw_offset``, ``clipped_offset`` and
    ``table_row`` (the row of the ``left + right + 1``-row embedding table,
    ``clipped_offset + left``; ``2K + 1`` rows and ``+ K`` for a clip distance K).
    """
    left, right = _bounds(max_distance)
    rows = []
    for j in range(length):
        # clip(j - i, -left, right) in plain Python, as relpos.clip_relative_position (no torch)
        clipped = max(-left, min(right, j - query))
        rows.append(
            {
                "position": j,
                "raw_offset": j - query,
                "clipped_offset": clipped,
                "table_row": clipped + left,
            }
        )
    return rows


def format_text(length: int, query: int, max_distance: Window) -> str:
    """The worked example's console table, generalised to any length, query and K (or
    window)."""
    rows = table_rows(length, query, max_distance)
    cells = [
        (str(r["position"]), f"{r['raw_offset']:+d}", f"{r['clipped_offset']:+d}",
         str(r["table_row"])) for r in rows
    ]
    widths = [
        max(slot, *(len(c[n]) + 2 for c in cells)) for n, (_, slot) in enumerate(_TEXT_COLUMNS)
    ]
    # The worked example writes the titles joined by " | ", the first flush left.
    header = "|".join(f"{title:<{width}}" if n == 0 else f"{' ' + title:<{width}}"
                      for n, ((title, _), width) in enumerate(zip(_TEXT_COLUMNS, widths,
                                                                     strict=True)))
    lines = [
        f"Query position: {query}",
        f"Maximum relative distance (K): {max_distance}" if isinstance(max_distance, int)
        else f"Clip window: [-{max_distance[0]}, +{max_distance[1]}]",
        "",
        header.rstrip(),
        "-" * (len(header.rstrip()) + 4),
    ]
    for c in cells:
        line = "|".join(f"{value:^{width}}" for value, width in zip(c, widths, strict=True))
        lines.append(line.rstrip())
    return "\n".join(lines) + "\n"


def format_csv(length: int, query: int, max_distance: Window) -> str:
    rows = table_rows(length, query, max_distance)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def format_json(length: int, query: int, max_distance: Window) -> str:
    document = {
        "length": length,
        "query": query,
        "max_distance": max_distance if isinstance(max_distance, int) else list(max_distance),
        "rows": table_rows(length, query, max_distance),
    }
    return json.dumps(document, indent=2) + "\n"


def format_markdown(length: int, query: int, max_distance: Window) -> str:
    rows = table_rows(length, query, max_distance)
    lines = [
        "| Position | Raw Offset | Clipped Offset | Table Row |",
        "|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['position']} | {r['raw_offset']:+d} | {r['clipped_offset']:+d} "
            f"| {r['table_row']} |"
        )
    return "\n".join(lines) + "\n"


_FORMATTERS = {
    "text": format_text,
    "csv": format_csv,
    "json": format_json,
    "markdown": format_markdown,
}


def run(args: argparse.Namespace) -> int:
    length = args.length
    query = length // 2 if args.query is None else args.query
    if not 0 <= query < length:
        raise CLIError(
            f"--query {query} is not a position of a length-{length} sequence; "
            f"allowed: 0..{length - 1}"
        )
    print(_FORMATTERS[args.format](length, query, _args.window(args)), end="")
    return 0


# Validators that lived here before relpos.cli._args.
__getattr__ = module_getattr(
    __name__,
    {name: moved(f"relpos.cli._args.{name}") for name in ("positive_int", "non_negative_int")},
)
