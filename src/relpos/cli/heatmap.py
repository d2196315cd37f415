"""``relpos heatmap``: the clipped relative position matrix, as an image or as text.

``relpos heatmap --length 10 --max-distance 4 -o clipped.png`` draws the matrix of the worked
example of the handbook section on clipped relative positions (Shaw et al., 2018): rows =
queries i, columns = keys j, cell = clip(j - i, -K, K); without ``-o`` the matrix is
printed. Images need the ``plot`` extra (matplotlib).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from relpos.cli import CLIError, _args

if TYPE_CHECKING:
    import torch

DEFAULT_LENGTH = 10
DEFAULT_MAX_DISTANCE = 4
# Larger matrices do not fit in an image or a terminal in any useful way.
MAX_LENGTH = 4096
# The suffixes of relpos.training.plotting.IMAGE_FORMATS (that module loads torch).
IMAGE_SUFFIXES = (".png", ".svg", ".pdf")


SUMMARY = "draw (or print) the clipped relative position matrix"
DESCRIPTION = """\
Draw the matrix clip(j - p_i, -K, K) of query i (rows) and key j (columns) as a heatmap with
a diverging colormap, or print it as text when no -o is given. With fewer queries than keys
the queries are aligned to the end of the keys (p_i = i + length - queries) unless
--query-start says otherwise.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``relpos heatmap``."""
    p.add_argument("--length", type=_args.positive_int, default=DEFAULT_LENGTH, metavar="S",
                   help=f"number of key positions (default {DEFAULT_LENGTH})")
    _args.add_max_distance(p, DEFAULT_MAX_DISTANCE)
    _args.add_window(p)
    p.add_argument("--queries", type=_args.positive_int, metavar="L",
                   help="number of queries (default: S, self-attention)")
    p.add_argument("--query-start", type=_args.non_negative_int, metavar="P",
                   help="position of the first query, 0..S-L (default S-L)")
    p.add_argument("--causal", action="store_true",
                   help="blank out the keys after each query (j > p_i)")
    p.add_argument("--annotate", action=argparse.BooleanOptionalAction,
                   help="write the offset in every cell (default: only up to 32 rows and columns)")
    p.add_argument("--dpi", type=_args.positive_float, default=150.0,
                   help="resolution of PNG output (default 150)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="image to write (.png, .svg or .pdf); without it the matrix is printed")


def format_matrix(offsets: torch.Tensor, hidden: torch.Tensor, start: int) -> str:
    """Print-ready matrix: a header of key positions, one row per query position.

    Args:
        offsets: ``(L, S)`` clipped offsets.
        hidden: ``(L, S)`` bool, ``True`` where a causal mask hides the key (shown as ".").
        start: position of query 0.
    """
    query_len, key_len = offsets.shape
    hidden_rows = hidden.tolist()
    cells = [
        ["." if h else ("0" if v == 0 else f"{v:+d}") for v, h in zip(row, hrow, strict=True)]
        for row, hrow in zip(offsets.tolist(), hidden_rows, strict=True)
    ]
    width = max(len(str(key_len - 1)), *(len(c) for row in cells for c in row))
    label = "i\\j"
    first = max(len(label), len(str(start + query_len - 1)))
    lines = [f"{label:>{first}} " + " ".join(f"{j:>{width}}" for j in range(key_len))]
    for i, row in enumerate(cells):
        lines.append(f"{start + i:>{first}} " + " ".join(f"{c:>{width}}" for c in row))
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    length = args.length
    if length > MAX_LENGTH:
        raise CLIError(f"--length {length} is too large to show; allowed: 1..{MAX_LENGTH}")
    queries = length if args.queries is None else args.queries
    if queries > length:
        raise CLIError(f"--queries {queries} exceeds --length {length}; allowed: 1..{length}")
    if args.query_start is not None and args.query_start + queries > length:
        raise CLIError(
            f"--query-start {args.query_start} puts queries at positions "
            f"{args.query_start}..{args.query_start + queries - 1}, outside the {length} "
            f"keys; allowed: 0..{length - queries}"
        )
    output = None
    if args.output is not None:  # checked before torch and matplotlib load
        output = _args.check_output_file(args.output, suffixes=IMAGE_SUFFIXES)
    from relpos.training import plotting  # torch (and matplotlib) only now, to draw

    if output is None:
        offsets, hidden, start = plotting.clipped_offsets(
            length,
            _args.window(args),
            queries=queries,
            query_start=args.query_start,
            causal=args.causal,
        )
        print(format_matrix(offsets, hidden, start), end="")
        return 0

    try:
        fig = plotting.plot_relative_positions(
            length,
            _args.window(args),
            causal=args.causal,
            query_start=args.query_start,
            queries=queries,
            annotate=args.annotate,
        )
    except ImportError:
        raise CLIError(plotting.MISSING_MATPLOTLIB) from None
    path = plotting.save_figure(fig, output, dpi=args.dpi)
    print(f"wrote {path}")
    return 0
