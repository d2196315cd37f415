"""The K sweep: where does the clip distance matter?

Trains small causal models with clipped relative positions for a range of K (and absolute
baselines), several seeds each, on synthetic dependency tasks and on real data that ships
with every Python (a character-level LM on the standard library's source), evaluates them
at and beyond the training length, measures the training signal each table row receives,
and writes ``results.json.gz``, figures and ``report.md``. Every statement in the report is
computed from the numbers of the run, with 95% intervals; none is written in advance.

Modules:
    :mod:`~relpos.training.experiment.run`: the configuration, the plan of runs, training
        and evaluating them, ``results.json.gz``.
    :mod:`~relpos.training.experiment.corpus`: the Python-source corpus and its task.
    :mod:`~relpos.training.experiment.row_signal`: per-row pair counts, gradients, movement.
    :mod:`~relpos.training.experiment.stats`: intervals and verdicts.
    :mod:`~relpos.training.experiment.results`: reading the results document.
    :mod:`~relpos.training.experiment.report`: guidance, claims, tables, ``report.md``.
    :mod:`~relpos.training.experiment.figures`: heatmaps, bands, extrapolation, signal.
"""

from relpos.training.experiment.figures import write_figures
from relpos.training.experiment.report import (
    BPC_SMALL,
    LARGE_PP,
    SMALL_PP,
    claims,
    make_report,
    write_report,
)
from relpos.training.experiment.results import load_results
from relpos.training.experiment.run import ExperimentConfig, RunSpec, plan, run_experiment

__all__ = [
    "BPC_SMALL",
    "LARGE_PP",
    "SMALL_PP",
    "ExperimentConfig",
    "RunSpec",
    "claims",
    "load_results",
    "make_report",
    "plan",
    "run_experiment",
    "write_figures",
    "write_report",
]
