"""The K sweep: where does the clip distance matter?

Trains small causal models with clipped relative positions for a range of K (and absolute
baselines), several seeds each, on synthetic dependency tasks and on real data that ships
with every Python (a character-level LM on the standard library's source), evaluates them
at and beyond the training length, measures the training signal each table row receives,
and writes ``results.json.gz``, figures and ``report.md``. Every statement in the report is
computed from the numbers of the run, with 95% intervals; none is written in advance.

Modules:
    :mod:`~relpos.training.experiment.run`: :func:`run_experiment`, the sweep from start to
        ``results.json.gz``, figures and ``report.md``.
    :mod:`~relpos.training.experiment.config`: the configuration and its presets.
    :mod:`~relpos.training.experiment.sweep`: the plan of runs, their settings, training one.
    :mod:`~relpos.training.experiment.code_metrics`: evaluating a ``pysrc`` model.
    :mod:`~relpos.training.experiment.reuse`: an output directory's files, reusing its
        finished runs.
    :mod:`~relpos.training.experiment.workers`: runs in parallel processes.
    :mod:`~relpos.training.experiment.calibrate`: the time estimate.
    :mod:`~relpos.training.experiment.corpus`: the Python-source corpus and its task.
    :mod:`~relpos.training.experiment.row_signal`: per-row pair counts, gradients, movement.
    :mod:`~relpos.training.experiment.stats`: intervals and verdicts.
    :mod:`~relpos.training.experiment.results`: reading the results document.
    :mod:`~relpos.training.experiment.claims`: the claims with verdicts, which K to choose.
    :mod:`~relpos.training.experiment.seeds`: what would settle an inconclusive claim.
    :mod:`~relpos.training.experiment.formatting`: how the report writes intervals and seeds.
    :mod:`~relpos.training.experiment.report`: the tables and ``report.md``.
    :mod:`~relpos.training.experiment.figures`: heatmaps, bands, extrapolation, signal.
"""

from relpos._deprecated import module_getattr
from relpos.training.experiment.figures import write_figures
from relpos.training.experiment.report import (
    BPC_SMALL,
    SMALL_PP,
    claims,
    make_report,
    write_report,
)
from relpos.training.experiment.results import load_results
from relpos.training.experiment.run import ExperimentConfig, RunSpec, plan, run_experiment

__all__ = [
    "BPC_SMALL",
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

# LARGE_PP (5.0) was kept for callers of the first report; no verdict uses it. Deprecated in
# 0.1, the name goes in 0.2.
__getattr__ = module_getattr(__name__, {
    "LARGE_PP": ("the value 5.0 (no verdict uses it; the name goes in 0.2)", lambda: 5.0),
})
