"""``relpos experiment``: sweep the clip distance K (and depth) on offset recall and
agreement, train at length 64, evaluate at 64..512 against absolute baselines, and write
tables, figures and a report computed from the numbers.

Examples::

    relpos experiment                 # the full default (about half an hour on 2 CPU cores)
    relpos experiment --quick         # a smaller sweep (a few minutes)
    relpos experiment --out runs/exp --seed 1 --ks 0,4,16 --depths 1
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from relpos.cli import CLIError
from relpos.cli.table import non_negative_int, positive_int


def _ints(text: str, minimum: int) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints, got {text!r}") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints >= {minimum}, got {text!r}")
    return values


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "experiment",
        help="sweep the clip distance K: where does it matter?",
        description=(
            "Train small causal transformers with clipped relative positions for K in "
            "{0,1,2,4,8,16,32,64} and depth {1,2} (plus learned and sinusoidal absolute "
            "baselines) on offset recall and long-range agreement at length 64; evaluate "
            "at lengths 64-512; print tables and write figures and a report to --out."
        ),
    )
    p.add_argument("--quick", action="store_true", help="a smaller sweep (a few minutes)")
    p.add_argument("--out", default="runs/experiment", metavar="DIR", help="output directory")
    p.add_argument("--seed", type=non_negative_int, default=None, help="seed (default 0)")
    p.add_argument(
        "--ks",
        type=lambda t: _ints(t, 0),
        default=None,
        metavar="K,K,...",
        help="clip distances to sweep",
    )
    p.add_argument(
        "--depths",
        type=lambda t: _ints(t, 1),
        default=None,
        metavar="N,N,...",
        help="numbers of layers to sweep",
    )
    p.add_argument("--tasks", default=None, metavar="T,T", help="tasks (default recall,agree)")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps per run")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default 1; fixed so reruns give the same numbers)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep finished runs already in --out (continue an interrupted sweep)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from relpos.training.experiment import ExperimentConfig, run_experiment

    config = ExperimentConfig.quick() if args.quick else ExperimentConfig()
    changes: dict[str, Any] = {}
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.ks is not None:
        changes["ks"] = args.ks
    if args.depths is not None:
        changes["depths"] = args.depths
    if args.steps is not None:
        changes["steps"] = args.steps
    if args.threads is not None:
        changes["threads"] = args.threads
    if args.tasks is not None:
        tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
        bad = [t for t in tasks if t not in ("recall", "agree")]
        if bad or not tasks:
            raise CLIError(f"--tasks: unknown task(s) {bad or tasks!r}; allowed: recall, agree")
        changes["tasks"] = tasks
    if changes:
        config = replace(config, **changes, preset="custom")
    run_experiment(config, args.out, progress=not args.no_progress, reuse=args.reuse)
    print(f"results, figures and report.md in {args.out}")
    return 0
