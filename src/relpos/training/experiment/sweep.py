"""The runs of the K sweep: :func:`plan` (which runs, seed by seed, then the learning-curve
runs), the model, training and evaluation settings of each, and :func:`train_run`, which
trains and evaluates one and returns its record (``runs/<name>.json``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from relpos.training.experiment.code_metrics import EVAL_SEED, evaluate_code
from relpos.training.experiment.config import CODE_TASK, ExperimentConfig
from relpos.training.experiment.results import BUCKETS
from relpos.training.tasks import Task, build_task
from relpos.training.trainer import TrainConfig, train

__all__ = [
    "RunSpec",
    "budget",
    "build_tasks",
    "eval_settings",
    "model_config",
    "plan",
    "train_config",
    "train_run",
]


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


def model_config(spec: RunSpec, task: Task, config: ExperimentConfig) -> Any:
    """The :class:`~relpos.models.ModelConfig` of ``spec`` (long enough for every evaluated
    length)."""
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


def train_config(spec: RunSpec, config: ExperimentConfig) -> TrainConfig:
    """The :class:`~relpos.training.trainer.TrainConfig` of ``spec``."""
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


def eval_settings(spec: RunSpec, config: ExperimentConfig) -> dict[str, Any]:
    """How ``spec`` is evaluated (lengths, tokens, buckets), as its record keeps it."""
    if spec.task == CODE_TASK:
        return {"lengths": list(config.code_eval_lengths), "tokens": config.code_eval_tokens,
                "buckets": [list(b) for b in BUCKETS]}
    return {"lengths": list(config.eval_lengths), "tokens": config.eval_tokens}


def build_tasks(config: ExperimentConfig) -> dict[str, Task]:
    """The tasks of the sweep by name (``pysrc`` reads its corpus here)."""
    tasks: dict[str, Task] = {}
    for name in config.tasks:
        if name == CODE_TASK:
            from relpos.training.experiment.corpus import PythonSourceLM, SourceCorpus

            tasks[name] = PythonSourceLM(SourceCorpus(config.corpus_root))
        else:
            tasks[name] = build_task(name)
    return tasks


def train_run(spec: RunSpec, config: ExperimentConfig, task: Task) -> dict[str, Any]:
    """Train and evaluate one run of the sweep; returns its record (``runs/<name>.json``)."""
    from relpos.training.experiment.row_signal import RowSignal

    code = spec.task == CODE_TASK
    recorder = (RowSignal(spec.k, config.code_train_length, config.code_batch_size)
                if code and spec.positions == "relative" else None)
    model, metrics = train(
        model_config(spec, task, config), task, train_config(spec, config), progress=False,
        on_backward=recorder.on_backward if recorder else None,
    )
    if code:
        evals = [evaluate_code(model, task, seed=EVAL_SEED, length=n,
                               eval_tokens=config.code_eval_tokens)
                 for n in config.code_eval_lengths]
    else:
        evals = metrics["eval"]
    record = _record(spec, metrics, evals, recorder.finish(model) if recorder else None)
    record["eval_settings"] = eval_settings(spec, config)
    return record


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
