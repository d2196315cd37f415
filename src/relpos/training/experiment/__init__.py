"""The K sweep: where does the clip distance matter?

Trains one small model per (task, position scheme, depth) at length 64, evaluates each at
several lengths with accuracy broken down by dependency distance, and writes
``results.json``, figures and ``report.md``. Every statement in the report is computed from
the numbers of the run; none is written in advance.

Modules:
    :mod:`~relpos.training.experiment.run`: the configuration, the plan of runs, training
        them and ``results.json``.
    :mod:`~relpos.training.experiment.results`: reading the results document.
    :mod:`~relpos.training.experiment.report`: tables, findings, verdicts, ``report.md``.
    :mod:`~relpos.training.experiment.figures`: the heatmaps and extrapolation curves.
"""

from relpos.training.experiment.figures import write_figures
from relpos.training.experiment.report import LARGE_PP, SMALL_PP, make_report, write_report
from relpos.training.experiment.run import ExperimentConfig, RunSpec, plan, run_experiment

__all__ = [
    "LARGE_PP",
    "SMALL_PP",
    "ExperimentConfig",
    "RunSpec",
    "make_report",
    "plan",
    "run_experiment",
    "write_figures",
    "write_report",
]
