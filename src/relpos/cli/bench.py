"""``relpos bench``: time relpos backends against plain scaled dot-product attention.

Times the forward (under ``torch.no_grad``) and the forward + backward of every backend on
self-attention with both relative terms for each sequence length n and clip distance K,
and ``F.scaled_dot_product_attention`` without relative terms in the same interleaved
rounds (medians); measures the peak memory of one forward + backward per case in a fresh
subprocess; skips cases that would not fit in memory. ``--decode`` times one KV-cache
decode step of ``--steps`` new tokens over caches of ``--lengths`` keys instead.

The harness is :mod:`relpos.bench` (:mod:`relpos.bench.attention`,
:mod:`relpos.bench.decode`); this module only parses the options. It imports no torch
until the benchmark runs.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from relpos._deprecated import module_getattr, moved
from relpos.bench.common import DTYPES
from relpos.cli import CLIError, _args


def add_parser(subparsers: Any) -> None:
    """Register ``relpos bench``."""
    p = _args.subcommand(
        subparsers, "bench", run,
        "time relpos backends against plain SDPA (ms, ratio, peak memory)",
        __doc__.split("\n\n")[1] if __doc__ else "",
    )
    p.add_argument("--lengths", type=_args.int_list(1), default=None,
                   help="sequence lengths n (with --decode: cache lengths S), comma-separated "
                        "(default: 512,...,16384)")
    p.add_argument("--max-distances", type=_args.int_list(0), default=None,
                   help="clip distances K, comma-separated (default: 16,64; with --decode 64)")
    p.add_argument("--batch", type=_args.positive_int, default=None,
                   help="batch size B (default 1)")
    p.add_argument("--heads", type=_args.positive_int, default=None, help="heads H (default 8)")
    p.add_argument("--head-dim", type=_args.positive_int, default=None,
                   help="head dim D (default 64)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default float32")
    p.add_argument("--repeats", type=_args.positive_int, default=None,
                   help="measured rounds, median reported (default 3; with --decode 15)")
    p.add_argument("--warmup", type=_args.non_negative_int, default=None,
                   help="warm-up rounds (default 1; with --decode 3)")
    p.add_argument("--backends", default=None,
                   help="comma-separated backends: any of relpos.available_backends() and sdpa "
                        "(default: all but decode; with --decode: the backends timed by name "
                        "besides relpos (auto) and sdpa, default all but reference)")
    _args.add_threads(p, "torch threads (default: torch's default)")
    p.add_argument("--out", default=None,
                   help="directory for attention.md, attention.csv and attention.png (with "
                        "--decode: decode.md and decode.csv, or a .md path)")
    p.add_argument("--quick", action="store_true",
                   help="a small smoke run (n=256,512, K=16, 1 warm-up, 2 repeats; with "
                        "--decode S=512,1024, 1 warm-up, 3 repeats)")
    p.add_argument("--no-memory", dest="memory", action="store_false",
                   help="skip the per-case peak-memory subprocesses")
    p.add_argument("--memory-budget", type=_args.positive_float, default=None, metavar="GIB",
                   help="skip cases whose estimated peak exceeds this many GiB "
                        "(default: 60%% of the available memory)")
    p.add_argument("--causal", action="store_true",
                   help="causal self-attention (is_causal=True) for every backend and SDPA")
    g = p.add_argument_group("decode")
    g.add_argument("--decode", action="store_true",
                   help="run the KV-cache decode benchmark instead")
    g.add_argument("--steps", type=_args.int_list(1), default=None, metavar="T,T,...",
                   help="new tokens per decode step, comma-separated (default: 1,64)")


def output_files(args: argparse.Namespace) -> list[Path]:
    """The report files ``--out`` names (none without it), checked before any timing.

    Raises:
        CLIError: if ``--out`` is a file (or lies under one) where a directory is meant, or
            a report file would replace a directory.
    """
    if not args.out:
        return []
    out = Path(args.out)
    if args.decode and out.suffix.lower() in (".md", ".csv"):
        files = [out.with_suffix(".md"), out.with_suffix(".csv")]
        _args.check_output_dir(out.parent, f"--out {str(out)!r}: its directory")
    else:
        _args.check_output_dir(out)
        names = ("decode.md", "decode.csv") if args.decode else (
            "attention.md", "attention.csv", "attention.png"
        )
        files = [out / name for name in names]
    for path in files:
        if path.is_dir():
            raise CLIError(f"--out {str(args.out)!r}: the report {str(path)!r} is a directory")
    return files


def run(args: argparse.Namespace) -> int:
    """``relpos bench``: run the attention benchmark (or the decode one with ``--decode``)."""
    if args.steps is not None and not args.decode:
        raise CLIError("--steps applies to relpos bench --decode only")
    output_files(args)
    if args.decode:
        from relpos.bench.decode import run_decode

        return run_decode(args)
    from relpos.bench.attention import run_attention

    return run_attention(args)


# Names this module defined before the harness moved to relpos.bench.
__getattr__ = module_getattr(__name__, {
    **{name: moved(f"relpos.bench.attention.{name}") for name in (
        "DEFAULT_LENGTHS", "DEFAULT_MAX_DISTANCES", "QUICK_LENGTHS", "QUICK_MAX_DISTANCES",
        "MEMORY_METHOD", "Config", "Result", "estimate_bytes", "measure_memory", "run_attention",
    )},
    "BACKENDS": (
        "relpos.bench.attention.backends()",
        lambda: importlib.import_module("relpos.bench.attention").backends(),
    ),
})
