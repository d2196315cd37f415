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

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from relpos._io import atomic_write_bytes, atomic_write_text
from relpos._sysinfo import environment
from relpos.training.checkpoint import atomic_write_json
from relpos.training.experiment.figures import write_figures
from relpos.training.experiment.report import make_report
from relpos.training.experiment.results import (
    BUCKETS,
    LEGACY_RESULTS_FILE,
    RESULTS_FILE,
    SEED_RANGE,
    load_results,
    results_bytes,
    results_path,
)
from relpos.training.tasks import Task, build_task
from relpos.training.trainer import TrainConfig, train

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

REPORT_FILE = "report.md"
RUNS_DIR = "runs"
FORMAT_VERSION = 2
# The figures of figures.write_figures.
FIGURE_PATTERNS = ("heatmap_*.png", "extrapolation_*.png", "bpc_*.png", "signal_*.png",
                   "curves_*.png")
#: The real-data task (a character-level LM on Python source).
CODE_TASK = "pysrc"
SYNTHETIC_TASKS = ("recall", "agree")
#: The code models are all evaluated on the same validation windows (this stream), so
#: seeds differ only in training and two models compare on identical characters.
EVAL_SEED = 0


@dataclass
class ExperimentConfig:
    """What the sweep trains and evaluates (defaults: the README's default run; see
    :meth:`full` and :meth:`quick`).

    Synthetic tasks use ``ks``, ``depths``, ``train_length``, ``eval_lengths``, ``steps``,
    ``batch_size``, ``lr``, ``eval_tokens``; ``pysrc`` the ``code_*`` fields (its lengths are
    ``code_train_length`` times ``code_eval_factors``; ``code_unclipped`` adds a model whose
    K covers the longest evaluation length, so no offset it meets is ever clipped).
    """

    tasks: tuple[str, ...] = ("recall", "agree", CODE_TASK)
    ks: tuple[int, ...] = (0, 2, 4, 8, 16, 32, 64)
    depths: tuple[int, ...] = (1,)
    baselines: tuple[str, ...] = ("learned",)
    seeds: tuple[int, ...] = (0, 1, 2)
    train_length: int = 64
    eval_lengths: tuple[int, ...] = (64, 128, 256, 512)
    steps: int = 120
    batch_size: int = 32
    d_model: int = 64
    num_heads: int = 4
    lr: float = 1e-2
    warmup: int = 20
    eval_tokens: int = 8192
    code_ks: tuple[int, ...] = (4, 16, 32, 64, 128)
    code_unclipped: bool = True
    code_baselines: tuple[str, ...] = ("learned",)
    code_depth: int = 2
    code_train_length: int = 128
    code_eval_factors: tuple[int, ...] = (1, 4, 8)
    code_steps: int = 150
    code_batch_size: int = 16
    code_lr: float = 3e-3
    code_eval_tokens: int = 16384
    #: Seeds of ``pysrc`` (None: ``seeds``), so a task whose seeds disagree more can have
    #: more of them.
    code_seeds: tuple[int, ...] | None = None
    #: More seeds for some ``pysrc`` models alone (``code_extra_models``: ``K=<k>`` of
    #: ``code_ks``, ``unclipped``): a comparison whose seeds spread widely gets them
    #: without every K trained again. Comparisons pair the seeds both models have.
    code_extra_seeds: tuple[int, ...] = ()
    code_extra_models: tuple[str, ...] = ()
    corpus_root: str | None = None
    threads: int = 1
    #: Runs trained at once, each in its own process with ``threads`` threads (the numbers
    #: do not depend on it).
    jobs: int = 1
    #: Learning curves: the synthetic tasks' ``curve_ks`` and ``pysrc``'s ``code_curve_ks``
    #: are also trained, for ``curve_seeds``, at each other budget of ``curve_steps`` /
    #: ``code_curve_steps`` (each a run of its own, with its own learning-rate schedule);
    #: the sweep's own runs give its budget's point. Budgets above the sweep's probe
    #: whether its models have stopped learning.
    curve_steps: tuple[int, ...] = ()
    code_curve_steps: tuple[int, ...] = ()
    curve_ks: tuple[int, ...] = ()
    code_curve_ks: tuple[int, ...] = ()
    curve_seeds: tuple[int, ...] = ()
    preset: str = "default"

    def __post_init__(self) -> None:
        for name in ("tasks", "ks", "depths", "baselines", "seeds", "eval_lengths", "code_ks",
                     "code_baselines", "code_eval_factors", "curve_steps", "code_curve_steps",
                     "curve_ks", "code_curve_ks", "curve_seeds", "code_extra_seeds",
                     "code_extra_models"):
            setattr(self, name, tuple(getattr(self, name)))
        unknown = [t for t in self.tasks if t not in (*SYNTHETIC_TASKS, CODE_TASK)]
        if unknown or not self.tasks:
            raise ValueError(f"unknown task(s) {unknown!r}; allowed: "
                             f"{', '.join((*SYNTHETIC_TASKS, CODE_TASK))}")
        if self.code_seeds is not None:
            self.code_seeds = tuple(self.code_seeds)
        for name in ("seeds", "code_seeds", "code_extra_seeds"):
            seeds = getattr(self, name)
            if seeds is None or (name == "code_extra_seeds" and not seeds):
                continue
            if not seeds or len(set(seeds)) != len(seeds):
                raise ValueError(f"{name} must be distinct and at least one, got {list(seeds)}")
            if any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= 2**64 - 1
                   for s in seeds):
                raise ValueError(f"{name} must be ints in 0..2**64 - 1, got {list(seeds)}")
        self._check_extra_seeds()
        for name in ("tasks", "ks", "depths", "baselines", "code_ks", "code_baselines"):
            values = list(getattr(self, name))
            if len(set(values)) != len(values):  # each would train and report twice
                raise ValueError(f"{name} must be distinct, got {values}")
        for name in ("ks", "code_ks"):
            if any(isinstance(k, bool) or not isinstance(k, int) or k < 0
                   for k in getattr(self, name)):
                raise ValueError(f"{name} must be ints >= 0, got {list(getattr(self, name))}")
        if isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 1:
            raise ValueError(f"jobs must be an int >= 1, got {self.jobs!r}")
        if any(f < 1 for f in self.code_eval_factors) or 1 not in self.code_eval_factors:
            raise ValueError("code_eval_factors must be ints >= 1 and include 1, got "
                             f"{list(self.code_eval_factors)}")
        for name, full in (("curve_steps", self.steps), ("code_curve_steps", self.code_steps)):
            values = list(getattr(self, name))
            if len(set(values)) != len(values) or any(
                    isinstance(v, bool) or not isinstance(v, int) or v < 1 or v == full
                    for v in values):
                raise ValueError(f"{name} must be distinct ints >= 1 other than the sweep's "
                                 f"budget {full} (its own runs are that point), got {values}")
        for name, sweep in (("curve_ks", "ks"), ("code_curve_ks", "code_ks"),
                            ("curve_seeds", "seeds"), ("curve_seeds", "code_seeds")):
            extra = [v for v in getattr(self, name) if v not in (getattr(self, sweep)
                                                                  or self.seeds)]
            if extra or len(set(getattr(self, name))) != len(getattr(self, name)):
                raise ValueError(f"{name} must be distinct values of {sweep} (the full "
                                 f"budget's point is the sweep's own run), got "
                                 f"{list(getattr(self, name))}")

    def _check_extra_seeds(self) -> None:
        repeated = [s for s in self.code_extra_seeds if s in self.seeds_of(CODE_TASK)]
        if repeated:
            raise ValueError(f"code_extra_seeds must not repeat the seeds of {CODE_TASK}, got "
                             f"{repeated} in both")
        models = self.code_models
        wrong = [m for m in self.code_extra_models if m not in models]
        if wrong or len(set(self.code_extra_models)) != len(self.code_extra_models):
            raise ValueError(f"code_extra_models must be distinct models of the {CODE_TASK} "
                             f"sweep ({', '.join(models)}), got {list(self.code_extra_models)}")
        if bool(self.code_extra_seeds) != bool(self.code_extra_models):
            raise ValueError(
                "code_extra_seeds and code_extra_models go together: got "
                f"{list(self.code_extra_seeds)} and {list(self.code_extra_models)}")

    @property
    def code_models(self) -> tuple[str, ...]:
        """The labels of the relative ``pysrc`` models: ``K=<k>`` and ``unclipped``."""
        return (*(f"K={k}" for k in self.code_ks), *(("unclipped",) * self.code_unclipped))

    @classmethod
    def full(cls) -> ExperimentConfig:
        """The whole study (about 50 minutes on 2 CPU cores)."""
        return cls(
            ks=(0, 1, 2, 4, 8, 16, 32, 64),
            depths=(1, 2),
            baselines=("learned", "sinusoidal"),
            code_ks=(0, 1, 2, 4, 8, 16, 32, 64, 128),
            code_baselines=("learned", "sinusoidal"),
            code_steps=250,
            code_eval_tokens=32768,
            preset="full",
        )

    @classmethod
    def long(cls) -> ExperimentConfig:
        """The long study: agreement and ``pysrc`` (20 seeds each) trained until learned,
        large evaluations, and the learning curves the budget was chosen from (the curve K
        at 1/4 and 1/2 of it, and ``pysrc`` at 2x and 4x it), two jobs; about 6.5 hours on 2
        CPU cores (``reuse`` extends a finished sweep by its new runs alone).

        ``pysrc``'s K=128 and unclipped models get 41 more seeds (61 in all): beyond the
        training length both put every far offset on table rows no training pair reached,
        and at 8x it their seeds differ by about 0.16 bits per character."""
        return cls(
            tasks=("agree", CODE_TASK),
            ks=(4, 8, 16, 32, 64),
            depths=(1, 2),
            baselines=(),
            seeds=tuple(range(20)),
            steps=2000,
            eval_tokens=65536,
            code_ks=(4, 8, 16, 32, 64, 128),
            code_baselines=(),
            code_steps=2000,
            code_eval_tokens=131072,
            code_seeds=tuple(range(20)),
            code_extra_seeds=tuple(range(20, 61)),
            code_extra_models=("K=128", "unclipped"),
            curve_steps=(500, 1000),
            code_curve_steps=(500, 1000, 4000, 8000),
            curve_ks=(4, 16, 64),
            code_curve_ks=(4, 16, 128),
            curve_seeds=(0, 1),
            jobs=2,
            preset="long",
        )

    @classmethod
    def quick(cls) -> ExperimentConfig:
        """A small sweep for under 3 minutes on 2 CPU cores."""
        return cls(
            tasks=("recall", CODE_TASK),
            ks=(0, 4, 16, 64),
            baselines=(),
            steps=100,
            eval_lengths=(64, 256),
            eval_tokens=4096,
            code_ks=(4, 16, 64),
            code_baselines=(),
            code_depth=1,
            code_train_length=64,
            code_eval_factors=(1, 4),
            code_steps=60,
            code_eval_tokens=8192,
            preset="quick",
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExperimentConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def seeds_of(self, task: str) -> tuple[int, ...]:
        """The seeds ``task`` is trained with."""
        return (self.code_seeds or self.seeds) if task == CODE_TASK else self.seeds

    @property
    def main_seeds(self) -> tuple[int, ...]:
        """The seeds every model of some task is trained with, in order (``seeds``, then the
        other ``code_seeds``)."""
        used = {s for task in self.tasks for s in self.seeds_of(task)}
        order = (*self.seeds, *(s for s in self.code_seeds or () if s not in self.seeds))
        return tuple(s for s in order if s in used)

    @property
    def all_seeds(self) -> tuple[int, ...]:
        """Every seed of the sweep: :attr:`main_seeds`, then ``code_extra_seeds`` (where
        ``pysrc`` is one of the tasks)."""
        extra = self.code_extra_seeds if CODE_TASK in self.tasks else ()
        return (*self.main_seeds, *extra)

    @property
    def code_eval_lengths(self) -> tuple[int, ...]:
        return tuple(self.code_train_length * f for f in self.code_eval_factors)

    @property
    def unclipped_k(self) -> int:
        """K of the unclipped code model: no offset at any evaluated length is clipped."""
        return max(self.code_eval_lengths) - 1


@dataclass(frozen=True)
class RunSpec:
    """One training run of the sweep."""

    task: str
    positions: str  # "relative" | "learned" | "sinusoidal"
    k: int  # clip distance (relative only; 0 otherwise)
    depth: int
    seed: int = 0
    unclipped: bool = False
    #: A learning-curve run's step budget (0: the sweep's own budget).
    steps: int = 0

    @property
    def model(self) -> str:
        """Row label: ``K=8``, ``unclipped`` or the baseline's name."""
        if self.positions != "relative":
            return self.positions
        return "unclipped" if self.unclipped else f"K={self.k}"

    @property
    def name(self) -> str:
        label = self.model.replace("=", "")
        budget = f"-steps{self.steps}" if self.steps else ""
        return f"{self.task}-{label}-depth{self.depth}-seed{self.seed}{budget}"


def plan(config: ExperimentConfig) -> list[RunSpec]:
    """The runs of the sweep, seed by seed (an interrupted sweep has whole seeds), then the
    learning-curve runs at the other budgets."""
    runs: list[RunSpec] = []
    for seed in config.main_seeds:
        for task in config.tasks:
            if seed not in config.seeds_of(task):
                continue
            if task == CODE_TASK:
                runs += _code_runs(config, seed)
                continue
            for depth in config.depths:
                runs += [RunSpec(task, "relative", k, depth, seed) for k in config.ks]
                runs += [RunSpec(task, b, 0, depth, seed) for b in config.baselines]
    if CODE_TASK in config.tasks:
        for seed in config.code_extra_seeds:
            runs += [spec for spec in _code_runs(config, seed)
                     if spec.model in config.code_extra_models]
    for task in config.tasks:
        code = task == CODE_TASK
        budgets = config.code_curve_steps if code else config.curve_steps
        ks = config.code_curve_ks if code else config.curve_ks
        depths = (config.code_depth,) if code else config.depths
        runs += [RunSpec(task, "relative", k, depth, seed, steps=steps)
                 for steps in budgets for depth in depths for k in ks
                 for seed in config.curve_seeds]
    return runs


def _code_runs(config: ExperimentConfig, seed: int) -> list[RunSpec]:
    """Every ``pysrc`` model of the sweep at ``seed``."""
    d = config.code_depth
    runs = [RunSpec(CODE_TASK, "relative", k, d, seed) for k in config.code_ks]
    if config.code_unclipped:
        runs.append(RunSpec(CODE_TASK, "relative", config.unclipped_k, d, seed, True))
    return runs + [RunSpec(CODE_TASK, b, 0, d, seed) for b in config.code_baselines]


def budget(spec: RunSpec, config: ExperimentConfig) -> int:
    """The training steps of ``spec``: its learning-curve budget or the sweep's."""
    if spec.steps:
        return spec.steps
    return config.code_steps if spec.task == CODE_TASK else config.steps


def _model_config(spec: RunSpec, task: Task, config: ExperimentConfig) -> Any:
    from relpos.models import ModelConfig

    relative = spec.positions == "relative"
    code = spec.task == CODE_TASK
    lengths = config.code_eval_lengths if code else (*config.eval_lengths, config.train_length)
    return ModelConfig(
        vocab_size=task.vocab_size,
        d_model=config.d_model,
        num_layers=spec.depth,
        num_heads=config.num_heads,
        max_distance=spec.k,
        relative_keys=relative,
        relative_values=relative,
        positions=spec.positions,
        max_length=max(lengths),
        causal=True,
    )


def _train_config(spec: RunSpec, config: ExperimentConfig) -> TrainConfig:
    if spec.task == CODE_TASK:
        # The code model's evaluation is evaluate_code's; train() evaluates one sequence.
        return TrainConfig(
            steps=budget(spec, config), batch_size=config.code_batch_size,
            length=config.code_train_length, lr=config.code_lr, warmup=config.warmup,
            seed=spec.seed, eval_lengths=(config.code_train_length,), eval_tokens=1,
        )
    return TrainConfig(
        steps=budget(spec, config), batch_size=config.batch_size, length=config.train_length,
        lr=config.lr, warmup=config.warmup, seed=spec.seed,
        eval_lengths=config.eval_lengths, eval_tokens=config.eval_tokens,
    )


def bucket_label(low: int, high: int) -> str:
    return f"{low}-{high}"


@torch.no_grad()
def evaluate_code(
    model: torch.nn.Module, task: Task, *, seed: int, length: int, eval_tokens: int,
    batch_tokens: int = 8192,
) -> dict[str, Any]:
    """Bits per character and closing-bracket accuracy of a code model at one length.

    Returns:
        ``{"length", "bpc", "bpc_sd", "bpc_per_sequence", "sequences", "characters",
        "brackets"}``: ``bpc`` the mean over all scored characters, ``bpc_sd`` the standard
        deviation of the sequences' means (listed, 4 digits, in ``bpc_per_sequence``, so
        two models evaluated on the same windows can be compared sequence by sequence);
        ``brackets`` maps an opener-distance bucket ``"lo-hi"`` (and the
        seed's ``"10-20"``) to ``{"count", "hits", "type_hits"}``: closers whose opener is
        in the window, how many the model predicts exactly (argmax over all characters),
        and how many it ranks above the other two closers (the bracket type).
    """
    from relpos.training.experiment.corpus import closer_ids

    was_training = model.training
    model.eval()
    sequences = max(1, math.ceil(eval_tokens / length))
    per_batch = max(1, batch_tokens // length)
    closers = closer_ids()
    seq_bpc: list[float] = []
    total = 0.0
    chars = 0
    ranges = [*BUCKETS, SEED_RANGE]
    tallies = {bucket_label(*r): [0, 0, 0] for r in ranges}
    for index, start in enumerate(range(0, sequences, per_batch)):
        size = min(per_batch, sequences - start)
        batch = task.batch(seed=seed, step=index, batch_size=size, length=length, split="eval")
        logits = model(batch.ids).float()  # (B, L, V)
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch.targets.flatten(), reduction="none"
        ).view_as(batch.targets).double()  # (B, L)
        bits = ce / math.log(2)
        seq_bpc += bits.mean(1).tolist()
        total += float(bits.sum())
        chars += bits.numel()
        dist = batch.meta["distance"]
        scored = dist > 0
        if not bool(scored.any()):
            continue
        d = dist[scored]
        target = batch.targets[scored]
        picked = logits[scored]  # (N, V)
        hit = picked.argmax(-1) == target
        among = closers[picked[:, closers].argmax(-1)]
        type_hit = among == target
        for low, high in ranges:
            inside = (d >= low) & (d <= high)
            t = tallies[bucket_label(low, high)]
            t[0] += int(inside.sum())
            t[1] += int((hit & inside).sum())
            t[2] += int((type_hit & inside).sum())
    model.train(was_training)
    mean = total / max(chars, 1)
    sd = (math.sqrt(sum((b - sum(seq_bpc) / len(seq_bpc)) ** 2 for b in seq_bpc)
                    / (len(seq_bpc) - 1)) if len(seq_bpc) > 1 else math.nan)
    return {
        "length": length,
        "bpc": mean,
        "bpc_sd": sd,
        "bpc_per_sequence": [float(f"{b:.4g}") for b in seq_bpc],
        "sequences": len(seq_bpc),
        "characters": chars,
        "brackets": {k: {"count": c, "hits": h, "type_hits": th}
                     for k, (c, h, th) in tallies.items() if c},
    }


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


# Relative cost of one run: training tokens x depth, evaluation tokens x depth / 3 (no
# backward), and an attention term that grows with the length (and the unclipped table).
def _cost(spec: RunSpec, config: ExperimentConfig) -> float:
    if spec.task == CODE_TASK:
        n = config.code_train_length
        train_tokens = budget(spec, config) * config.code_batch_size * n * (1 + n / 256)
        evals = sum(config.code_eval_tokens * (1 + m / 256) for m in config.code_eval_lengths)
        # The unclipped table: a wider band at the longer evaluation lengths.
        extra = 1.1 if spec.unclipped else 1.0
    else:
        n = config.train_length
        train_tokens = budget(spec, config) * config.batch_size * n * (1 + n / 256)
        evals = sum(config.eval_tokens * (1 + m / 256) for m in config.eval_lengths)
        extra = 1.0
    return spec.depth * (train_tokens + evals / 3) * extra


def _calibrate(config: ExperimentConfig, tasks: dict[str, Task]) -> float:
    """Seconds per unit of :func:`_cost`, from a few timed steps of a small model."""
    from relpos.models import build_model

    name = config.tasks[0]
    code = name == CODE_TASK
    spec = RunSpec(name, "relative", 16, config.code_depth if code else config.depths[0])
    task = tasks[name]
    model = build_model(_model_config(spec, task, config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tc = _train_config(spec, config)
    batch = task.batch(seed=0, step=0, batch_size=tc.batch_size, length=tc.length,
                       split="train")
    times = []
    for _ in range(5):
        tick = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(batch.ids).flatten(0, 1),
                                                 batch.targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - tick)
    per_step = sorted(times[2:])[1]  # the median once warm
    n = tc.length
    unit = spec.depth * tc.batch_size * n * (1 + n / 256)
    # Data generation, evaluation bookkeeping and Python overheads: measured ~1.3x.
    return 1.3 * per_step / unit


def _record(spec: RunSpec, metrics: dict[str, Any], evals: list[dict[str, Any]],
            signal: dict[str, Any] | None) -> dict[str, Any]:
    record = {
        "spec": {**asdict(spec), "label": spec.model},
        "model_label": spec.model,
        "task": metrics["task"],
        "model": metrics["model"],
        "train": metrics["train"],
        "parameters": metrics["parameters"],
        "final_train_loss": metrics["final_train_loss"],
        "final_train_accuracy": metrics["final_train_accuracy"],
        "train_seconds": metrics["train_seconds"],
        "eval": evals,
    }
    if signal is not None:
        record["signal"] = signal
    return record


def _build_tasks(config: ExperimentConfig) -> dict[str, Task]:
    tasks: dict[str, Task] = {}
    for name in config.tasks:
        if name == CODE_TASK:
            from relpos.training.experiment.corpus import PythonSourceLM, SourceCorpus

            tasks[name] = PythonSourceLM(SourceCorpus(config.corpus_root))
        else:
            tasks[name] = build_task(name)
    return tasks


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
        log: where to print the estimate, the report and what was removed (None = stdout).
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
        tasks = _build_tasks(config)
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
    costs = [max(1, round(_cost(s, config))) for s in specs]
    started = time.perf_counter()
    reused = retrained = 0
    records: list[dict[str, Any] | None] = [None] * len(specs)
    todo = []
    # ``runs/`` is not committed: a sweep cloned with its results document alone is
    # extended from the run records in it (each written back to ``runs/``).
    found = results_path(out) if reuse else None
    before = _earlier_document(found)
    # A plain results.json is replaced by results.json.gz only if it was the one read.
    legacy = found is not None and found.name == LEGACY_RESULTS_FILE
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
    bar = None
    estimate = math.nan
    if progress:
        from tqdm.auto import tqdm

        left = [costs[number] for number in todo]
        estimate = 0.0
        if left:
            unit = _calibrate(config, tasks)
            jobs = max(1, min(config.jobs, len(left),
                              (os.cpu_count() or 1) // config.threads))
            # Runs share out over the jobs; none finishes before its own longest run.
            estimate = unit * max(sum(left) / jobs, max(left))
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
            _train_parallel(config, specs, todo, finished, bar)
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
    earlier = _earlier_seconds(before) if reused else 0.0
    env = environment(config.threads)
    invocations = [*(_earlier_invocations(before) if reused else []),
                   {"cpu": env["cpu"], "seconds": elapsed, "trained_runs": len(todo)}]
    results: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "config": config.to_dict(),
        "command": command or default_command(config),
        "chance": {name: _chance(task) for name, task in tasks.items()},
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
    say(report)
    if reuse:
        if reused or retrained:
            say(f"reused {reused} finished run(s) of {out}; retrained {retrained} whose "
                "settings differ")
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
    return results


def _earlier_document(path: Path | None) -> dict[str, Any] | None:
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


def _earlier_seconds(old: dict[str, Any] | None) -> float:
    """The wall time of the invocations whose runs this one reuses (from the results
    document they left; 0 if there is none)."""
    try:
        old = old or {}
        return float(old.get("sweep_seconds", 0.0)) + float(old.get("earlier_seconds", 0.0))
    except (ValueError, TypeError):
        return 0.0


def _earlier_invocations(old: dict[str, Any] | None) -> list[dict[str, Any]]:
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
    return (old.get("model") == _model_config(spec, task, config).to_dict()
            and old.get("train") == _train_config(spec, config).to_dict()
            and old.get("task") == task.config()
            and old.get("eval_settings") == _eval_settings(spec, config))


def train_run(spec: RunSpec, config: ExperimentConfig, task: Task) -> dict[str, Any]:
    """Train and evaluate one run of the sweep; returns its record (``runs/<name>.json``)."""
    from relpos.training.experiment.row_signal import RowSignal

    code = spec.task == CODE_TASK
    recorder = (RowSignal(spec.k, config.code_train_length, config.code_batch_size)
                if code and spec.positions == "relative" else None)
    model, metrics = train(
        _model_config(spec, task, config), task, _train_config(spec, config), progress=False,
        on_backward=recorder.on_backward if recorder else None,
    )
    if code:
        evals = [evaluate_code(model, task, seed=EVAL_SEED, length=n,
                               eval_tokens=config.code_eval_tokens)
                 for n in config.code_eval_lengths]
    else:
        evals = metrics["eval"]
    record = _record(spec, metrics, evals, recorder.finish(model) if recorder else None)
    record["eval_settings"] = _eval_settings(spec, config)
    return record


# --- parallel runs: one process per job, each with config.threads torch threads ----------

_WORKER: dict[str, Any] = {}


def _worker_start(config: dict[str, Any]) -> None:
    cfg = ExperimentConfig.from_dict(config)
    torch.set_num_threads(cfg.threads)
    _WORKER["config"] = cfg
    _WORKER["tasks"] = {}


def _worker_run(spec: dict[str, Any]) -> dict[str, Any]:
    cfg: ExperimentConfig = _WORKER["config"]
    run_spec = RunSpec(**spec)
    tasks = _WORKER["tasks"]
    if run_spec.task not in tasks:
        tasks.update(_build_tasks(replace(cfg, tasks=(run_spec.task,))))
    return train_run(run_spec, cfg, tasks[run_spec.task])


def _train_parallel(config: ExperimentConfig, specs: list[RunSpec], todo: list[int],
                    finished: Callable[[int, dict[str, Any]], None], bar: Any) -> None:
    """Train the runs ``todo`` (indices of ``specs``) in ``config.jobs`` processes; each
    result goes to ``finished`` as it arrives. A run trains the same in a worker as in
    this process (its own seed, ``config.threads`` threads), so the numbers do not depend
    on ``jobs``. The first failure stops the sweep (runs already finished are kept)."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    # Spawned, not forked: a fork of a process whose OpenMP pool is running can hang.
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=min(config.jobs, len(todo)), mp_context=context,
                               initializer=_worker_start, initargs=(config.to_dict(),))
    try:
        # The longest runs first, so the last ones to finish are short.
        order = sorted(todo, key=lambda i: -_cost(specs[i], config))
        futures = {pool.submit(_worker_run, asdict(specs[i])): i for i in order}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                finished(futures[future], future.result())
            if bar is not None:
                bar.set_postfix_str(f"{len(futures) - len(pending)}/{len(futures)} runs "
                                    f"trained, {config.jobs} jobs")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _eval_settings(spec: RunSpec, config: ExperimentConfig) -> dict[str, Any]:
    if spec.task == CODE_TASK:
        return {"lengths": list(config.code_eval_lengths), "tokens": config.code_eval_tokens,
                "buckets": [list(b) for b in BUCKETS]}
    return {"lengths": list(config.eval_lengths), "tokens": config.eval_tokens}


def default_command(config: ExperimentConfig) -> str:
    """The ``relpos experiment`` command of a preset (custom sweeps: the preset's name)."""
    flag = {"full": " --full", "quick": " --quick", "long": " --long"}.get(config.preset, "")
    preset = {"full": ExperimentConfig.full, "quick": ExperimentConfig.quick,
              "long": ExperimentConfig.long}.get(config.preset, ExperimentConfig)()
    seeds = ""
    if config.seeds != preset.seeds:
        seeds = f" --seeds {','.join(map(str, config.seeds))}"
    if config.code_seeds is not None and config.code_seeds != preset.code_seeds:
        seeds += f" --code-seeds {','.join(map(str, config.code_seeds))}"
    if config.code_extra_seeds and config.code_extra_seeds != preset.code_extra_seeds:
        seeds += f" --code-extra-seeds {','.join(map(str, config.code_extra_seeds))}"
    if config.code_extra_models != preset.code_extra_models:
        seeds += f" --code-extra-models {','.join(config.code_extra_models) or 'none'}"
    return f"relpos experiment{flag}{seeds}"


def _chance(task: Task) -> float:
    if task.name == "recall":
        return 1.0 / task.num_symbols  # type: ignore[attr-defined]
    if task.name == "agree":
        return 0.5
    return float("nan")
