"""The sweep's time estimates: the relative cost of each run (:func:`cost`), seconds per unit
of it on this machine from a few timed training steps (:func:`calibrate`), and every stated
time of a sweep, its time on the reference machine (:func:`reference_seconds`, written by
:func:`time_claim`): ``relpos experiment --help``, the report and the README say that. A
preset's time is its measured one (:data:`relpos._timings.EXPERIMENT`, the one source of the
measured times), scaled by the cost model where it was measured with other jobs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from relpos._sysinfo import usable_cores
from relpos._timings import EXPERIMENT, REFERENCE_CORES, Measured, duration_text
from relpos.training.experiment.config import CODE_TASK, ExperimentConfig
from relpos.training.experiment.sweep import RunSpec, budget, model_config, plan, train_config
from relpos.training.tasks import Task

__all__ = [
    "REFERENCE_CORES",
    "REFERENCE_UNIT",
    "calibrate",
    "cost",
    "default_jobs",
    "duration_text",
    "measured",
    "reference_jobs",
    "reference_seconds",
    "sweep_seconds",
    "time_claim",
    "usable_cores",
]

#: Seconds per unit of :func:`cost` for one job on the reference machine. Measured by the
#: committed long study (``benchmarks/experiment-long``: the whole ``--long`` preset, 470
#: runs, 2 jobs of one thread on 2-core x86 VMs with AVX-512, an Intel Xeon and an AMD EPYC,
#: nothing else running): 385.3 min of wall time, times its 2 jobs, over the preset's
#: 5.17e9 units of cost.
REFERENCE_UNIT = 8.9e-6
#: Seconds of a sweep outside its runs: reading the corpus, the calibration steps, the
#: figures and the report.
REFERENCE_OVERHEAD = 15.0


def cost(spec: RunSpec, config: ExperimentConfig) -> float:
    """The relative cost of one run: training tokens x depth, evaluation tokens x depth / 3
    (no backward), and an attention term that grows with the length (and the unclipped
    table)."""
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


def sweep_seconds(costs: Sequence[float], unit: float, jobs: int) -> float:
    """Seconds to train runs of ``costs`` at ``unit`` seconds per unit of cost, ``jobs`` at
    once: the runs share out over the jobs, and none finishes before its own longest run."""
    if not costs:
        return 0.0
    return unit * max(sum(costs) / max(1, min(jobs, len(costs))), max(costs))


def default_jobs(threads: int, cores: int | None = None) -> int:
    """The jobs ``relpos experiment`` runs without ``--jobs``: one per ``threads`` of the
    ``cores`` (None: :func:`usable_cores`), at least one."""
    return max(1, (usable_cores() if cores is None else cores) // max(1, threads))


def reference_jobs(config: ExperimentConfig, jobs: int | None = None) -> int:
    """The jobs of a sweep on the reference machine: ``jobs`` (None: ``relpos experiment``'s
    default there, :func:`default_jobs`), at most one per core's worth of threads."""
    most = default_jobs(config.threads, REFERENCE_CORES)
    return most if jobs is None else max(1, min(jobs, most))


def _model_seconds(config: ExperimentConfig, jobs: int) -> float:
    costs = [cost(spec, config) for spec in plan(config)]
    return REFERENCE_OVERHEAD + sweep_seconds(costs, REFERENCE_UNIT, jobs)


def measured(config: ExperimentConfig) -> Measured | None:
    """The measured time of ``config``'s preset (:data:`relpos._timings.EXPERIMENT`) when
    ``config`` is that preset (with any jobs), else None."""
    presets = {"default": ExperimentConfig, "quick": ExperimentConfig.quick,
               "full": ExperimentConfig.full, "long": ExperimentConfig.long}
    if config.preset not in presets or config.preset not in EXPERIMENT:
        return None
    if replace(config, jobs=1) != replace(presets[config.preset](), jobs=1):
        return None
    return EXPERIMENT[config.preset]


def reference_seconds(config: ExperimentConfig, jobs: int | None = None) -> float:
    """Seconds the sweep ``config`` takes on the reference machine (:data:`REFERENCE_CORES`
    cores, one torch thread per job, nothing else running) with ``jobs`` jobs (None: one a
    core, as ``relpos experiment`` runs there; see :func:`reference_jobs`), the kernels'
    first compile not included. A preset's is its measured time (:func:`measured`), scaled
    by the cost model (:data:`REFERENCE_UNIT` seconds a unit of :func:`cost`, plus
    :data:`REFERENCE_OVERHEAD`) from the jobs it was measured with; another sweep's is the
    cost model's."""
    jobs = reference_jobs(config, jobs)
    found = measured(config)
    if found is None:
        return _model_seconds(config, jobs)
    if found.jobs == jobs:
        return found.sweep
    return found.sweep * _model_seconds(config, jobs) / _model_seconds(config, found.jobs)


def time_claim(config: ExperimentConfig) -> str:
    """How long the sweep takes, as every stated time of it says it (``relpos experiment
    --help``, the report, the README): ``about 5 minutes on 2 CPU cores``, from
    :func:`reference_seconds` with ``relpos experiment``'s default jobs (one a core)."""
    return f"{duration_text(reference_seconds(config))} on {REFERENCE_CORES} CPU cores"


def calibrate(config: ExperimentConfig, tasks: dict[str, Task]) -> float:
    """Seconds per unit of :func:`cost`, from a few timed steps of a small model."""
    from relpos.models import build_model

    name = config.tasks[0]
    code = name == CODE_TASK
    spec = RunSpec(name, "relative", 16, config.code_depth if code else config.depths[0])
    task = tasks[name]
    model = build_model(model_config(spec, task, config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tc = train_config(spec, config)
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
