"""An output directory that already holds an experiment: its files
(:func:`experiment_files`), the finished runs a sweep with ``reuse`` takes from it instead of
training them again (:func:`reusable_runs`: from ``runs/<name>.json`` or, where a run's file
is missing, from the results document), what the earlier invocations took, and the files
that are no longer part of the sweep (:func:`remove_stale`).

``runs/`` is not committed: a sweep cloned with its results document alone is extended from
the run records in it (each written back to ``runs/``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from relpos.training.checkpoint import atomic_write_json
from relpos.training.experiment.config import ExperimentConfig
from relpos.training.experiment.results import LEGACY_RESULTS_FILE, RESULTS_FILE, load_results
from relpos.training.experiment.sweep import RunSpec, eval_settings, model_config, train_config
from relpos.training.tasks import Task

__all__ = [
    "FIGURE_PATTERNS",
    "REPORT_FILE",
    "RUNS_DIR",
    "describe",
    "earlier_document",
    "earlier_invocations",
    "earlier_seconds",
    "experiment_files",
    "remove_stale",
    "reusable_runs",
]


#: The report and the folder of the run records in an experiment's directory.
REPORT_FILE = "report.md"
RUNS_DIR = "runs"
#: The figures of :func:`~relpos.training.experiment.figures.write_figures`.
FIGURE_PATTERNS = ("heatmap_*.png", "extrapolation_*.png", "bpc_*.png", "signal_*.png",
                   "curves_*.png")


def experiment_files(out_dir: str | Path) -> list[Path]:
    """The files of an experiment in ``out_dir``: ``results.json.gz`` (or an earlier
    sweep's ``results.json``), ``report.md``, the figures and ``runs/*.json``, those
    present."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = [out / name for name in (RESULTS_FILE, LEGACY_RESULTS_FILE, REPORT_FILE)
             if (out / name).is_file()]
    for pattern in FIGURE_PATTERNS:
        found += sorted(p for p in out.glob(pattern) if p.is_file())
    if (out / RUNS_DIR).is_dir():
        found += sorted(p for p in (out / RUNS_DIR).glob("*.json") if p.is_file())
    return found


def describe(files: list[Path], out: Path) -> str:
    """``results.json.gz, report.md, 2 figures, 12 run files`` for
    :func:`experiment_files`."""
    names = [p.name for p in files if p.parent == out and not p.name.endswith(".png")]
    figures = sum(1 for p in files if p.parent == out and p.name.endswith(".png"))
    runs = sum(1 for p in files if p.parent != out)
    parts = names + [f"{figures} figure{'s' * (figures != 1)}"] * bool(figures)
    parts += [f"{runs} run file{'s' * (runs != 1)}"] * bool(runs)
    return ", ".join(parts)


def reusable_runs(specs: list[RunSpec], tasks: dict[str, Task], out: Path,
                  config: ExperimentConfig, before: dict[str, Any] | None, *, reuse: bool
                  ) -> tuple[list[dict[str, Any] | None], list[int], int, int]:
    """Which runs of ``specs`` an earlier sweep in ``out`` finished with the same settings
    (``reuse`` only): from ``out/runs/<name>.json`` or, where that file is missing or was
    trained otherwise, from ``before`` (the earlier results document; such a record is
    written back to ``runs/``).

    Returns:
        ``(records, todo, reused, retrained)``: the reused record at each run's index (None
        for the others), the indices to train, how many runs were reused, and how many had a
        saved record with other settings.
    """
    reused = retrained = 0
    records: list[dict[str, Any] | None] = [None] * len(specs)
    todo = []
    saved = _saved_runs(before)
    for number, spec in enumerate(specs):
        task = tasks[spec.task]
        path = out / RUNS_DIR / f"{spec.name}.json"
        if reuse and (path.is_file() or spec.name in saved):
            old: Any = None
            if path.is_file():
                try:
                    old = json.loads(path.read_text())
                except (OSError, ValueError):
                    old = None
            same = isinstance(old, dict) and _same_settings(old, spec, task, config)
            if not same:
                old = saved.get(spec.name)
                same = isinstance(old, dict) and _same_settings(old, spec, task, config)
                if same:
                    atomic_write_json(path, old)
            if same:
                records[number] = old
                reused += 1
                continue
            retrained += 1
        todo.append(number)
    return records, todo, reused, retrained


def remove_stale(out: Path, specs: list[RunSpec], figures: list[Path], *, legacy: bool,
                 say: Callable[[str], None]) -> None:
    """After a sweep with ``reuse``: remove the run files and figures of ``out`` that are not
    part of it (``specs``, ``figures``), and the plain ``results.json`` of an earlier sweep
    where it was the document read (``legacy``; ``results.json.gz`` replaces it)."""
    wanted = {out / RUNS_DIR / f"{spec.name}.json" for spec in specs}
    wanted |= set(figures)
    stale = [p for p in experiment_files(out) if p.suffix != ".md" and p not in wanted
             and p.name not in (RESULTS_FILE, LEGACY_RESULTS_FILE)]
    if legacy and (out / LEGACY_RESULTS_FILE).is_file():
        (out / LEGACY_RESULTS_FILE).unlink()
        say(f"replaced {out / LEGACY_RESULTS_FILE} of an earlier sweep by "
            f"{out / RESULTS_FILE}")
    for path in stale:
        path.unlink()
    if stale:
        say(f"removed {describe(stale, out)} of {out} that are not part of this sweep: "
            + ", ".join(str(p.relative_to(out)) for p in stale[:5])
            + (", ..." if len(stale) > 5 else ""))


def earlier_document(path: Path | None) -> dict[str, Any] | None:
    """The results document an earlier sweep left at ``path`` (None if there is none or it
    cannot be read: its runs are then trained again)."""
    if path is None:
        return None
    try:
        return load_results(path)
    except (OSError, ValueError):
        return None


def _saved_runs(old: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The run records of an earlier results document by run name (empty if none)."""
    runs = (old or {}).get("runs", [])
    known = {f.name for f in fields(RunSpec)}
    saved = {}
    for record in runs if isinstance(runs, list) else []:
        try:
            spec = RunSpec(**{k: v for k, v in record["spec"].items() if k in known})
        except (KeyError, TypeError, AttributeError):
            continue
        saved[spec.name] = record
    return saved


def earlier_seconds(old: dict[str, Any] | None) -> float:
    """The wall time of the invocations whose runs this one reuses (from the results
    document they left; 0 if there is none)."""
    try:
        old = old or {}
        return float(old.get("sweep_seconds", 0.0)) + float(old.get("earlier_seconds", 0.0))
    except (ValueError, TypeError):
        return 0.0


def earlier_invocations(old: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The CPU, wall time and runs trained of each invocation whose runs this one reuses
    (from the results document they left). A document from before they were recorded names
    the CPU of its last invocation only; the earlier ones come back as one entry with no
    CPU."""
    if old is None:
        return []
    try:
        if isinstance(old.get("invocations"), list):
            return [dict(i) for i in old["invocations"] if isinstance(i, dict)]
        before = float(old.get("earlier_seconds", 0.0))
        last = {"cpu": old.get("environment", {}).get("cpu"),
                "seconds": float(old.get("sweep_seconds", 0.0)),
                "trained_runs": old.get("trained_runs", len(old.get("runs", ())))}
    except (ValueError, TypeError, AttributeError):
        return []
    return ([{"cpu": None, "seconds": before, "trained_runs": None}] if before else []) + [last]


def _same_settings(old: dict[str, Any], spec: RunSpec, task: Task,
                   config: ExperimentConfig) -> bool:
    """Whether a saved run record was trained and evaluated as ``spec`` would be."""
    return (old.get("model") == model_config(spec, task, config).to_dict()
            and old.get("train") == train_config(spec, config).to_dict()
            and old.get("task") == task.config()
            and old.get("eval_settings") == eval_settings(spec, config))
