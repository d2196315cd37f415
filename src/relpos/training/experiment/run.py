"""Running the K sweep: its configuration, the runs it trains, and ``results.json.gz``.

:func:`run_experiment` trains one small causal model per (task, position scheme, depth,
seed) of :func:`plan`: the synthetic tasks (``recall``, ``agree``) evaluated by accuracy per
dependency distance at several lengths, and a character-level language model on the
standard library's Python source (``pysrc``, :mod:`~relpos.training.experiment.corpus`)
evaluated by bits per character at 1x, 4x and 8x the training length and by closing-bracket
accuracy per opener distance. For the relative models of ``pysrc`` it also records the
training signal of every table row (:mod:`~relpos.training.experiment.row_signal`). It writes
``runs/<name>.json`` per run and ``results.json.gz`` (gzip-compressed JSON, with the
machine: CPU model, ISA, torch, threads), then the figures and ``report.md``.

An output directory that already holds an experiment is refused unless its finished runs
are to be reused (``reuse``: runs with other settings are retrained, files that are not
part of the new sweep are removed afterwards) or the old experiment replaced
(``overwrite``: its files are removed first), so two sweeps never mix.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relpos._io import atomic_write_bytes, atomic_write_text
from relpos._sysinfo import environment
from relpos.training.checkpoint import atomic_write_json
from relpos.training.experiment.calibrate import calibrate, cost, sweep_seconds, usable_cores
from relpos.training.experiment.code_metrics import chance, evaluate_code
from relpos.training.experiment.config import CODE_TASK, ExperimentConfig, default_command
from relpos.training.experiment.figures import write_figures
from relpos.training.experiment.report import make_report, make_summary
from relpos.training.experiment.results import (
    BUCKETS,
    LEGACY_RESULTS_FILE,
    RESULTS_FILE,
    results_bytes,
    results_path,
)
from relpos.training.experiment.reuse import (
    REPORT_FILE,
    RUNS_DIR,
    describe,
    earlier_document,
    earlier_invocations,
    earlier_seconds,
    experiment_files,
    remove_stale,
    reusable_runs,
)
from relpos.training.experiment.sweep import RunSpec, build_tasks, plan, train_run
from relpos.training.experiment.workers import train_parallel
from relpos.training.tasks import Task

__all__ = [
    "BUCKETS",
    "CODE_TASK",
    "ExperimentConfig",
    "RunSpec",
    "environment",
    "evaluate_code",
    "experiment_files",
    "plan",
    "run_experiment",
]

FORMAT_VERSION = 2


def run_experiment(
    config: ExperimentConfig,
    out_dir: str | Path,
    *,
    progress: bool = True,
    reuse: bool = False,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Train and evaluate every run of :func:`plan`; write results, figures and report.

    Args:
        config: the sweep.
        out_dir: output directory (``results.json.gz``, ``report.md``, ``*.png``,
            ``runs/``).
        progress: show a progress bar over the sweep (and print the time estimate).
        reuse: keep finished runs with the same settings found in ``out_dir/runs`` or,
            where a run's file is missing, in the results document of ``out_dir``
            (others are retrained); after the sweep, remove the run files and figures of
            ``out_dir`` that are not part of it (and a plain ``results.json`` of an
            earlier sweep, which ``results.json.gz`` replaces).
        overwrite: remove the files of an experiment already in ``out_dir`` first.
        log: where to print the estimate, the summary (:func:`~relpos.training.experiment.
            report.make_summary`: verdicts, which K, where the report and figures are) and
            what was removed (None = stdout).
        command: the command line to record in the report (None = derived from ``config``).

    Returns:
        The results document (also in ``results.json.gz``).

    Raises:
        ValueError: if ``out_dir`` already holds an experiment and neither ``reuse`` nor
            ``overwrite`` is set, or both are; on a bad corpus root.
    """
    say = log or print
    out = Path(out_dir)
    if reuse and overwrite:
        raise ValueError("reuse and overwrite exclude each other")
    previous = experiment_files(out)
    if previous and not (reuse or overwrite):
        raise ValueError(
            f"{str(out)!r} already holds an experiment ({describe(previous, out)}); "
            "reuse=True keeps its finished runs, overwrite=True replaces it"
        )
    threads_before = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        tasks = build_tasks(config)
        if overwrite and previous:
            for path in previous:
                path.unlink()
            say(f"replaced the experiment in {out}: removed {describe(previous, out)}")
        (out / RUNS_DIR).mkdir(parents=True, exist_ok=True)
        return _sweep(config, tasks, out, progress=progress, reuse=reuse, say=say,
                      command=command)
    finally:
        torch.set_num_threads(threads_before)


def _sweep(config: ExperimentConfig, tasks: dict[str, Task], out: Path, *, progress: bool,
           reuse: bool, say: Callable[[str], None], command: str | None) -> dict[str, Any]:
    specs = plan(config)
    # Whole numbers, so the bar sums them exactly in any order (parallel runs finish in any).
    costs = [max(1, round(cost(s, config))) for s in specs]
    started = time.perf_counter()
    found = results_path(out) if reuse else None
    before = earlier_document(found)
    # A plain results.json is replaced by results.json.gz only if it was the one read.
    legacy = found is not None and found.name == LEGACY_RESULTS_FILE
    records, todo, reused, retrained = reusable_runs(specs, tasks, out, config, before,
                                                     reuse=reuse)
    bar = None
    estimate = math.nan
    if progress:
        from tqdm.auto import tqdm

        left = [costs[number] for number in todo]
        estimate = 0.0
        if left:
            unit = calibrate(config, tasks)
            jobs = max(1, min(config.jobs, usable_cores() // config.threads))
            estimate = sweep_seconds(left, unit, jobs)
        curves = sum(1 for s in specs if s.steps)
        extra = config.code_extra_seeds if CODE_TASK in config.tasks else ()
        say(f"relpos experiment ({config.preset}): {len(specs)} runs "
            f"({len(config.main_seeds)} seeds"
            + (f" and {len(extra)} more for {' and '.join(config.code_extra_models)} of "
               f"{CODE_TASK}" if extra else "")
            + (f"; {curves} of them learning-curve runs" if curves else "") + ")"
            + (f", {reused} of them reused" if reused else "")
            + f"; {len(todo)} to train, estimated {estimate / 60:.0f} min with "
            + (f"{config.jobs} jobs of " if config.jobs > 1 else "")
            + f"{config.threads} thread(s) on this machine")
        # The bar counts estimated work (the runs' costs), so its ETA weighs long runs.
        bar = tqdm(total=sum(left), desc="experiment",
                   dynamic_ncols=True, file=sys.stderr,
                   bar_format="{l_bar}{bar}| {postfix} [{elapsed}<{remaining}]")

    def finished(number: int, record: dict[str, Any]) -> None:
        atomic_write_json(out / RUNS_DIR / f"{specs[number].name}.json", record)
        records[number] = record
        if bar is not None:
            bar.update(costs[number])

    try:
        if config.jobs > 1 and len(todo) > 1:
            train_parallel(config, specs, todo, finished, bar)
        else:
            for number in todo:
                if bar is not None:
                    bar.set_postfix_str(f"run {number + 1}/{len(specs)} {specs[number].name}")
                finished(number, train_run(specs[number], config, tasks[specs[number].task]))
    finally:
        if bar is not None:
            bar.close()
    runs = [r for r in records if r is not None]
    elapsed = time.perf_counter() - started
    earlier = earlier_seconds(before) if reused else 0.0
    env = environment(config.threads)
    invocations = [*(earlier_invocations(before) if reused else []),
                   {"cpu": env["cpu"], "seconds": elapsed, "trained_runs": len(todo)}]
    results: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "config": config.to_dict(),
        "command": command or default_command(config),
        "chance": {name: chance(task) for name, task in tasks.items()},
        "runs": runs,
        "sweep_seconds": elapsed,
        "estimated_seconds": estimate,
        "trained_runs": len(todo),
        "reused_runs": reused,
        "earlier_seconds": earlier,
        "environment": env,
        "invocations": invocations,
    }
    if CODE_TASK in tasks:
        results["corpus"] = tasks[CODE_TASK].corpus.describe()  # type: ignore[attr-defined]
    # Compressed: the long study's per-sequence bits per character alone are over 1 MB of
    # JSON (about a fifth of that compressed).
    atomic_write_bytes(out / RESULTS_FILE, results_bytes(results))
    figures = write_figures(results, out)
    report = make_report(results, figures=[f.name for f in figures])
    atomic_write_text(out / REPORT_FILE, report)
    say(make_summary(results, out / REPORT_FILE, figures))
    if reuse:
        if reused or retrained:
            say(f"reused {reused} finished run(s) of {out}; retrained {retrained} whose "
                "settings differ")
        remove_stale(out, specs, figures, legacy=legacy, say=say)
    return results
