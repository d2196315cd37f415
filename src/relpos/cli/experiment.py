"""``relpos experiment``: sweep the clip distance K (and depth) on offset recall and
agreement, train at length 64, evaluate at 64..512 against absolute baselines, and write
tables, figures and a report computed from the numbers.

Examples::

    relpos experiment                 # the full default (about half an hour on 2 CPU cores)
    relpos experiment --quick         # a smaller sweep (a few minutes)
    relpos experiment --out runs/exp --seed 1 --ks 0,4,16 --depths 1
    relpos experiment --out runs/exp --ks 0,4,16,64 --reuse   # keeps the finished runs

An --out that holds an experiment (results.json, report.md, figures, runs/*.json) is
refused unless --reuse keeps its finished runs (runs with other settings are retrained;
run files and figures not part of the new sweep are removed afterwards, and said so) or
--overwrite replaces it (its files are removed first).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from relpos.cli import CLIError, _args

# The tasks the sweep knows (the report's claims are about these two).
TASKS = ("recall", "agree")
# Options that replace the field of the same name of the preset's ExperimentConfig.
_CONFIG_OPTIONS = ("seed", "ks", "depths", "tasks", "steps", "threads")


def add_parser(subparsers: Any) -> None:
    """Register ``relpos experiment``."""
    p = _args.subcommand(
        subparsers, "experiment", run, "sweep the clip distance K: where does it matter?",
        "Train small causal transformers with clipped relative positions for K in "
        "{0,1,2,4,8,16,32,64} and depth {1,2} (plus learned and sinusoidal absolute baselines) "
        "on offset recall and long-range agreement at length 64; evaluate at lengths 64-512; "
        "print tables and write figures and a report to --out. An --out that holds an "
        "experiment is refused unless --reuse keeps its finished runs (others are retrained "
        "and files not part of the new sweep removed) or --overwrite replaces it.",
    )
    p.add_argument("--quick", action="store_true", help="a smaller sweep (a few minutes)")
    p.add_argument("--out", default="runs/experiment", metavar="DIR", help="output directory")
    p.add_argument("--seed", type=_args.non_negative_int, help="seed (default 0)")
    p.add_argument("--ks", type=_args.int_list(0), metavar="K,K,...",
                   help="clip distances to sweep")
    p.add_argument("--depths", type=_args.int_list(1), metavar="N,N,...",
                   help="numbers of layers to sweep")
    p.add_argument("--tasks", type=_args.name_list(TASKS, "task(s)"), metavar="T,T",
                   help="tasks (default recall,agree)")
    p.add_argument("--steps", type=_args.positive_int, help="training steps per run")
    _args.add_threads(p, "torch CPU threads (default 1; fixed so reruns give the same numbers)")
    used = p.add_mutually_exclusive_group()
    used.add_argument("--reuse", action="store_true",
                      help="keep finished runs already in --out (continue an interrupted or "
                           "extend a finished sweep); remove its files not part of this sweep")
    used.add_argument("--overwrite", action="store_true",
                      help="replace the experiment in --out (its files are removed first)")
    _args.add_no_progress(p)


def run(args: argparse.Namespace) -> int:
    out = _args.check_output_dir(args.out)
    _args.check_output_dir(out / "runs", "--out")

    from relpos.training.experiment import ExperimentConfig, run_experiment
    from relpos.training.experiment.run import describe, experiment_files

    previous = experiment_files(out)
    if previous and not (args.reuse or args.overwrite):
        raise CLIError(
            f"--out {str(out)!r} already holds an experiment ({describe(previous, out)}); "
            "pass --reuse to keep its finished runs, --overwrite to replace it, or choose "
            "another --out"
        )
    config = ExperimentConfig.quick() if args.quick else ExperimentConfig()
    changes: dict[str, Any] = {
        name: getattr(args, name) for name in _CONFIG_OPTIONS if getattr(args, name) is not None
    }
    if changes:
        config = replace(config, **changes, preset="custom")
    run_experiment(
        config, out, progress=not args.no_progress, reuse=args.reuse, overwrite=args.overwrite
    )
    print(f"results, figures and report.md in {args.out}")
    return 0
