"""``relpos experiment``: sweep the clip distance K on synthetic dependency tasks and on a
character-level LM of Python's own standard library, several seeds each, and write tables
with 95% intervals, figures and a report whose verdicts are computed from the numbers.

Examples::

    relpos experiment                 # the default study
    relpos experiment --quick         # a small sweep
    relpos experiment --full          # the whole study
    relpos experiment --long          # agreement and pysrc until learned
    relpos experiment --out runs/exp --seeds 0,1,2,3 --ks 0,4,16 --tasks recall
    relpos experiment --out runs/exp --code-ks 4,16,64 --reuse   # keeps the finished runs

An --out that holds an experiment (results.json.gz, report.md, figures, runs/*.json) is
refused unless --reuse keeps its finished runs (runs with other settings are retrained;
run files and figures not part of the new sweep are removed afterwards, and said so) or
--overwrite replaces it (its files are removed first).

How long each preset takes is said in ``--help`` (:data:`PRESET_TIMES`).
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

from relpos._timings import FIRST_COMPILE_SECONDS, duration_text
from relpos.cli import CLIError, _args

# The tasks the sweep knows.
TASKS = ("recall", "agree", "pysrc")
# Options that replace the field of the same name of the preset's ExperimentConfig.
_CONFIG_OPTIONS = ("seeds", "ks", "depths", "tasks", "steps", "threads", "code_ks",
                   "code_steps", "corpus_root", "jobs", "code_seeds", "code_extra_seeds",
                   "code_extra_models")


def _models(text: str) -> tuple[str, ...]:
    """argparse type: ``K=128,unclipped`` (pysrc model labels, checked against the sweep's
    K later), or ``none``."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names == ("none",):
        return ()
    wrong = [n for n in names if n != "unclipped" and not (
        n.startswith("K=") and n[2:].isdigit())]
    if wrong or not names:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated models K=<k> or unclipped, or none, got {text!r}")
    return names


#: How long each preset takes on the reference machine with a job per core: the strings
#: ``relpos.training.experiment.calibrate.time_claim`` makes of each preset's measured time
#: (``relpos._timings``), written out here because that module loads torch and ``--help``
#: must not (a test checks that they agree, and the README's with them).
PRESET_TIMES = {
    "default": "about 2 minutes on 2 CPU cores",
    "quick": "about 1 minute on 2 CPU cores",
    "full": "about 20 minutes on 2 CPU cores",
    "long": "about 6.5 hours on 2 CPU cores",
}
#: The native kernels' first compile on a machine, which the first sweep there waits for.
FIRST_COMPILE = duration_text(FIRST_COMPILE_SECONDS)

SUMMARY = "sweep the clip distance K: where does it matter?"
DESCRIPTION = f"""\
Train small causal transformers with clipped relative positions over K (plus absolute
baselines), 3 seeds each, on offset recall, long-range agreement and a character-level LM of
the running Python's standard library (pysrc: bits per character at 1x/4x/8x the training
length, closing-bracket accuracy by opener distance, the training signal per table row);
print an up-front time estimate for this machine and progress; write results.json.gz,
figures and a report with 95% intervals to --out, and print a summary: the verdict on each
claim, which K to choose, where the report and figures are. The default study takes
{PRESET_TIMES["default"]} (a job of one torch thread per core, nothing else running), and
{FIRST_COMPILE} more the first time on a machine, compiling the native kernels. An --out
that holds an experiment is refused unless --reuse keeps its finished runs or --overwrite
replaces it.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``relpos experiment``."""
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help=f"a small sweep ({PRESET_TIMES['quick']})")
    size.add_argument("--full", action="store_true",
                      help=f"the whole study ({PRESET_TIMES['full']})")
    size.add_argument("--long", action="store_true",
                      help="agreement and pysrc (20 seeds each; K=128 and unclipped of "
                           "pysrc 61) trained until learned, with learning curves "
                           f"({PRESET_TIMES['long']}; --reuse trains only the runs not yet "
                           "in --out)")
    p.add_argument("--out", default="runs/experiment", metavar="DIR", help="output directory")
    p.add_argument("--seeds", type=_args.int_list(0, _args.SEED_MAX, distinct=True),
                   metavar="S,S,...",
                   help="seeds (default 0,1,2; --long: 0-19)")
    p.add_argument("--code-seeds", type=_args.int_list(0, _args.SEED_MAX, distinct=True),
                   metavar="S,S,...",
                   help="seeds of pysrc (default: --seeds; --long: 0-19)")
    p.add_argument("--code-extra-seeds", type=_args.int_list(0, _args.SEED_MAX, distinct=True),
                   metavar="S,S,...",
                   help="more pysrc seeds, for the --code-extra-models alone (default none; "
                        "--long: 20-60)")
    p.add_argument("--code-extra-models", type=_models, metavar="M,M",
                   help="the pysrc models the extra seeds train, e.g. K=128,unclipped, or "
                        "none (--long: K=128,unclipped)")
    p.add_argument("--ks", type=_args.int_list(0, distinct=True), metavar="K,K,...",
                   help="clip distances of the synthetic tasks")
    p.add_argument("--code-ks", type=_args.int_list(0, distinct=True), metavar="K,K,...",
                   help="clip distances of the pysrc task")
    p.add_argument("--depths", type=_args.int_list(1, distinct=True), metavar="N,N,...",
                   help="numbers of layers of the synthetic tasks")
    p.add_argument("--tasks", type=_args.name_list(TASKS, "task(s)", distinct=True),
                   metavar="T,T",
                   help="tasks (default recall,agree,pysrc)")
    p.add_argument("--steps", type=_args.positive_int, help="training steps (synthetic)")
    p.add_argument("--code-steps", type=_args.positive_int, help="training steps (pysrc)")
    p.add_argument("--corpus-root", metavar="DIR",
                   help="directory of .py files for pysrc (default: this Python's stdlib)")
    _args.add_threads(p, "torch CPU threads per job (default 1; fixed so reruns give the same "
                         "numbers)")
    p.add_argument("--jobs", type=_args.positive_int, metavar="N",
                   help="runs trained at once, one process each (default: one per usable "
                        "CPU core, divided by --threads); the numbers do not depend on it")
    used = p.add_mutually_exclusive_group()
    used.add_argument("--reuse", action="store_true",
                      help="keep finished runs already in --out (continue an interrupted or "
                           "extend a finished sweep); remove its files not part of this sweep")
    used.add_argument("--overwrite", action="store_true",
                      help="replace the experiment in --out (its files are removed first)")
    _args.add_no_progress(p)


def _curves_within(config: Any, changes: dict[str, Any]) -> dict[str, Any]:
    """The preset's learning-curve settings cut to what the changed sweep still has (its
    seeds and K, budgets other than its steps)."""
    seeds = set(changes.get("seeds", config.seeds))
    code_seeds = changes.get("code_seeds", config.code_seeds)
    if code_seeds is not None:
        seeds &= set(code_seeds)
    steps = changes.get("steps", config.steps)
    code_steps = changes.get("code_steps", config.code_steps)
    ks = changes.get("ks", config.ks)
    code_ks = changes.get("code_ks", config.code_ks)
    return {
        "curve_seeds": tuple(s for s in config.curve_seeds if s in seeds),
        "curve_ks": tuple(k for k in config.curve_ks if k in ks),
        "code_curve_ks": tuple(k for k in config.code_curve_ks if k in code_ks),
        "curve_steps": tuple(n for n in config.curve_steps if n != steps),
        "code_curve_steps": tuple(n for n in config.code_curve_steps if n != code_steps),
    }


def _extras_within(config: Any, changes: dict[str, Any]) -> dict[str, Any]:
    """The extra pysrc seeds and models: the preset's, cut to what the changed sweep still
    has (seeds it does not train every model with, models it has), none if that leaves
    either empty; a value given on the command line is kept as given (``none`` models: no
    extra runs)."""
    new = replace(config, **{k: v for k, v in changes.items()
                             if k not in ("code_extra_seeds", "code_extra_models")},
                  code_extra_seeds=(), code_extra_models=())
    given_seeds, given_models = "code_extra_seeds" in changes, "code_extra_models" in changes
    seeds = changes["code_extra_seeds"] if given_seeds else tuple(
        s for s in config.code_extra_seeds if s not in new.seeds_of("pysrc"))
    models = changes["code_extra_models"] if given_models else tuple(
        m for m in config.code_extra_models if m in new.code_models)
    none = {"code_extra_seeds": (), "code_extra_models": ()}
    if given_models and not models:  # --code-extra-models none
        return none
    if not (given_seeds or given_models) and not (seeds and models):
        return none  # the preset's, cut to nothing
    # Given ones as given: a lone --code-extra-seeds without models is refused by the config.
    return {"code_extra_seeds": seeds, "code_extra_models": models}


def run(args: argparse.Namespace) -> int:
    out = _args.check_output_dir(args.out)
    _args.check_output_dir(out / "runs", "--out")
    if args.corpus_root is not None and not Path(args.corpus_root).is_dir():
        raise CLIError(f"--corpus-root {args.corpus_root!r} is not a directory")

    from relpos.training.experiment import ExperimentConfig, run_experiment
    from relpos.training.experiment.run import describe, experiment_files

    previous = experiment_files(out)
    if previous and not (args.reuse or args.overwrite):
        raise CLIError(
            f"--out {str(out)!r} already holds an experiment ({describe(previous, out)}); "
            "pass --reuse to keep its finished runs, --overwrite to replace it, or choose "
            "another --out"
        )
    if args.quick:
        config = ExperimentConfig.quick()
    elif args.full:
        config = ExperimentConfig.full()
    elif args.long:
        config = ExperimentConfig.long()
    else:
        config = ExperimentConfig()
    changes: dict[str, Any] = {
        name: getattr(args, name) for name in _CONFIG_OPTIONS if getattr(args, name) is not None
    }
    if "seeds" in changes and "code_seeds" not in changes:
        changes["code_seeds"] = None  # --seeds alone: every task
    if changes:
        # --jobs alone changes no number: the preset keeps its name.
        preset = config.preset if set(changes) == {"jobs"} else "custom"
        changes.update(_curves_within(config, changes))
        try:
            changes.update(_extras_within(config, changes))
            config = replace(config, **changes, preset=preset)
        except ValueError as err:
            raise CLIError(str(err)) from None
    if args.jobs is None:  # one job a core (--jobs alone changes no number: not "custom")
        from relpos.training.experiment.calibrate import default_jobs

        config = replace(config, jobs=default_jobs(config.threads))
    import sys

    command = "relpos " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == [
        "experiment"] else None
    try:
        run_experiment(config, out, progress=not args.no_progress, reuse=args.reuse,
                       overwrite=args.overwrite, command=command)
    except (FileNotFoundError, ValueError) as err:
        if "already holds" in str(err) or "corpus" in str(err):
            raise CLIError(str(err)) from None
        raise
    return 0
