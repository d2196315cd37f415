"""Running the K sweep: its configuration, the runs it trains, and ``results.json``.

:func:`run_experiment` trains one small model per (task, position scheme, depth) of
:func:`plan`, evaluates each at several lengths with accuracy broken down by dependency
distance, writes ``runs/<name>.json`` per run and ``results.json``, then hands the results
to :mod:`relpos.training.experiment.report` for the figures and ``report.md``.

An output directory that already holds an experiment is refused unless its finished runs
are to be reused (``reuse``: runs with other settings are retrained, files that are not
part of the new sweep are removed afterwards) or the old experiment replaced
(``overwrite``: its files are removed first), so two sweeps never mix.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from relpos._io import atomic_write_text
from relpos.tasks import Task, build_task
from relpos.training.checkpoint import atomic_write_json
from relpos.training.experiment.figures import write_figures
from relpos.training.experiment.report import make_report
from relpos.training.trainer import TrainConfig, train

__all__ = ["ExperimentConfig", "RunSpec", "experiment_files", "plan", "run_experiment"]

RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"
RUNS_DIR = "runs"
# The figures of figures.write_figures, per task.
FIGURE_PATTERNS = ("heatmap_*.png", "extrapolation_*.png")


@dataclass
class ExperimentConfig:
    """What the sweep trains and evaluates (defaults: the full experiment)."""

    tasks: tuple[str, ...] = ("recall", "agree")
    ks: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64)
    depths: tuple[int, ...] = (1, 2)
    baselines: tuple[str, ...] = ("learned", "sinusoidal")
    train_length: int = 64
    eval_lengths: tuple[int, ...] = (64, 128, 256, 512)
    steps: int = 180
    batch_size: int = 32
    d_model: int = 64
    num_heads: int = 4
    lr: float = 1e-2
    warmup: int = 20
    eval_tokens: int = 8192
    seed: int = 0
    threads: int = 1
    preset: str = "full"

    @classmethod
    def quick(cls) -> ExperimentConfig:
        """A smaller sweep for a few minutes on 2 CPU cores."""
        return cls(
            ks=(0, 2, 4, 16, 32, 64),
            depths=(1,),
            baselines=("learned",),
            steps=120,
            eval_tokens=4096,
            preset="quick",
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class RunSpec:
    """One training run of the sweep."""

    task: str
    positions: str  # "relative" | "learned" | "sinusoidal" | "none"
    k: int  # clip distance (relative only; 0 otherwise)
    depth: int

    @property
    def model(self) -> str:
        """Row label: ``K=8`` or the baseline's name."""
        return f"K={self.k}" if self.positions == "relative" else self.positions

    @property
    def name(self) -> str:
        return f"{self.task}-{self.model.replace('=', '')}-depth{self.depth}"


def plan(config: ExperimentConfig) -> list[RunSpec]:
    """The runs of the sweep, in order."""
    runs = []
    for task in config.tasks:
        for depth in config.depths:
            runs += [RunSpec(task, "relative", k, depth) for k in config.ks]
            runs += [RunSpec(task, b, 0, depth) for b in config.baselines]
    return runs


def _model_config(spec: RunSpec, task: Task, config: ExperimentConfig) -> Any:
    from relpos.models import ModelConfig

    relative = spec.positions == "relative"
    return ModelConfig(
        vocab_size=task.vocab_size,
        d_model=config.d_model,
        num_layers=spec.depth,
        num_heads=config.num_heads,
        max_distance=spec.k,
        relative_keys=relative,
        relative_values=relative,
        positions=spec.positions,
        max_length=max(*config.eval_lengths, config.train_length),
        causal=True,
    )


def experiment_files(out_dir: str | Path) -> list[Path]:
    """The files of an experiment in ``out_dir``: ``results.json``, ``report.md``, the
    figures and ``runs/*.json``, those present."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = [out / name for name in (RESULTS_FILE, REPORT_FILE) if (out / name).is_file()]
    for pattern in FIGURE_PATTERNS:
        found += sorted(p for p in out.glob(pattern) if p.is_file())
    if (out / RUNS_DIR).is_dir():
        found += sorted(p for p in (out / RUNS_DIR).glob("*.json") if p.is_file())
    return found


def describe(files: list[Path], out: Path) -> str:
    """``results.json, report.md, 2 figures, 12 run files`` for :func:`experiment_files`."""
    names = [p.name for p in files if p.parent == out and not p.name.endswith(".png")]
    figures = sum(1 for p in files if p.parent == out and p.name.endswith(".png"))
    runs = sum(1 for p in files if p.parent != out)
    parts = names + [f"{figures} figure{'s' * (figures != 1)}"] * bool(figures)
    parts += [f"{runs} run file{'s' * (runs != 1)}"] * bool(runs)
    return ", ".join(parts)


def run_experiment(
    config: ExperimentConfig,
    out_dir: str | Path,
    *,
    progress: bool = True,
    reuse: bool = False,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train and evaluate every run of :func:`plan`; write results, figures and report.

    Args:
        config: the sweep.
        out_dir: output directory (``results.json``, ``report.md``, ``*.png``, ``runs/``).
        progress: show a progress bar over the sweep.
        reuse: keep finished runs found in ``out_dir/runs`` with the same settings
            (others are retrained); after the sweep, remove the run files and figures of
            ``out_dir`` that are not part of it.
        overwrite: remove the files of an experiment already in ``out_dir`` first.
        log: where to print tables and what was removed (None = stdout).

    Returns:
        The results document (also in ``results.json``).

    Raises:
        ValueError: if ``out_dir`` already holds an experiment and neither ``reuse`` nor
            ``overwrite`` is set, or both are.
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
    if overwrite and previous:
        for path in previous:
            path.unlink()
        say(f"replaced the experiment in {out}: removed {describe(previous, out)}")
    (out / RUNS_DIR).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(config.threads)
    specs = plan(config)
    tasks = {name: build_task(name) for name in config.tasks}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=len(specs), desc="experiment", unit="run", dynamic_ncols=True, file=sys.stderr
        )
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    reused = retrained = 0
    for spec in specs:
        task = tasks[spec.task]
        model_config = _model_config(spec, task, config)
        train_config = TrainConfig(
            steps=config.steps,
            batch_size=config.batch_size,
            length=config.train_length,
            lr=config.lr,
            warmup=config.warmup,
            seed=config.seed,
            eval_lengths=config.eval_lengths,
            eval_tokens=config.eval_tokens,
        )
        path = out / RUNS_DIR / f"{spec.name}.json"
        record = None
        if reuse and path.is_file():
            try:
                old = json.loads(path.read_text())
            except (OSError, ValueError):
                old = None
            if (
                isinstance(old, dict)
                and old.get("model") == model_config.to_dict()
                and old.get("train") == (train_config.to_dict())
                and old.get("task") == task.config()
            ):
                record = old
                reused += 1
            else:
                retrained += 1
        if record is None:
            if bar is not None:
                bar.set_postfix_str(spec.name)
            _, metrics = train(model_config, task, train_config, progress=False)
            record = {
                "spec": asdict(spec),
                "model_label": spec.model,
                "task": metrics["task"],
                "model": metrics["model"],
                "train": metrics["train"],
                "parameters": metrics["parameters"],
                "final_train_loss": metrics["final_train_loss"],
                "final_train_accuracy": metrics["final_train_accuracy"],
                "train_seconds": metrics["train_seconds"],
                "eval": metrics["eval"],
            }
            atomic_write_json(path, record)
        runs.append(record)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - started
    chance = {name: _chance(task) for name, task in tasks.items()}
    results = {
        "config": config.to_dict(),
        "chance": chance,
        "runs": runs,
        "sweep_seconds": elapsed,
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
    }
    atomic_write_json(out / RESULTS_FILE, results)
    figures = write_figures(results, out)
    report = make_report(results, figures=[f.name for f in figures])
    atomic_write_text(out / REPORT_FILE, report)
    say(report)
    if reuse:
        if reused or retrained:
            say(f"reused {reused} finished run(s) of {out}; retrained {retrained} whose "
                "settings differ")
        wanted = {out / RUNS_DIR / f"{spec.name}.json" for spec in specs}
        wanted |= set(figures)
        stale = [p for p in experiment_files(out) if p.suffix != ".md" and p not in wanted
                 and p.name != RESULTS_FILE]
        for path in stale:
            path.unlink()
        if stale:
            say(f"removed {describe(stale, out)} of {out} that are not part of this sweep: "
                + ", ".join(str(p.relative_to(out)) for p in stale[:5])
                + (", ..." if len(stale) > 5 else ""))
    return results


def _chance(task: Task) -> float:
    if task.name == "recall":
        return 1.0 / task.num_symbols  # type: ignore[attr-defined]
    if task.name == "agree":
        return 0.5
    return float("nan")
