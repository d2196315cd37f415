"""The sweep's time estimates: the relative cost of each run (:func:`cost`), seconds per unit
of it on this machine from a few timed training steps (:func:`calibrate`), and the one source
of every stated time of a sweep, its time on the reference machine (:func:`reference_seconds`,
written by :func:`time_claim`): ``relpos experiment --help``, the report and the README say
that."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from relpos.training.experiment.config import CODE_TASK, ExperimentConfig
from relpos.training.experiment.sweep import RunSpec, budget, model_config, plan, train_config
from relpos.training.tasks import Task

__all__ = [
    "REFERENCE_CORES",
    "REFERENCE_UNIT",
    "calibrate",
    "cost",
    "duration_text",
    "reference_seconds",
    "sweep_seconds",
    "time_claim",
]

#: The reference machine: this many CPU cores, one torch thread per job, nothing else
#: running.
REFERENCE_CORES = 2
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


def reference_seconds(config: ExperimentConfig) -> float:
    """Seconds the sweep ``config`` takes on the reference machine (:data:`REFERENCE_CORES`
    cores, one torch thread per job, nothing else running): every run of its plan at
    :data:`REFERENCE_UNIT`, in ``jobs`` parallel jobs (at most one per core's worth of
    threads), plus :data:`REFERENCE_OVERHEAD`."""
    jobs = max(1, min(config.jobs, REFERENCE_CORES // max(1, config.threads)))
    costs = [cost(spec, config) for spec in plan(config)]
    return REFERENCE_OVERHEAD + sweep_seconds(costs, REFERENCE_UNIT, jobs)


def duration_text(seconds: float) -> str:
    """A duration as a stated estimate: ``about 1 minute`` (``under a minute`` below 30 s),
    whole minutes below 10 minutes, 5 minutes apart below an hour, then half hours
    (``about 6.5 hours``)."""
    if math.isnan(seconds) or seconds < 30:
        return "under a minute"
    minutes = seconds / 60
    if minutes < 1.5:
        return "about 1 minute"
    if minutes < 9.5:
        return f"about {round(minutes)} minutes"
    if minutes < 57.5:
        return f"about {5 * round(minutes / 5)} minutes"
    hours = round(2 * seconds / 3600) / 2
    return "about 1 hour" if hours == 1 else f"about {hours:g} hours"


def time_claim(config: ExperimentConfig) -> str:
    """How long the sweep takes, as every stated time of it says it (``relpos experiment
    --help``, the report, the README): ``about 6 minutes on 2 CPU cores`` (``... with 2
    jobs`` for a sweep of parallel jobs), from :func:`reference_seconds`."""
    jobs = max(1, min(config.jobs, REFERENCE_CORES // max(1, config.threads)))
    return (f"{duration_text(reference_seconds(config))} on {REFERENCE_CORES} CPU cores"
            + (f" with {jobs} jobs" if jobs > 1 else ""))


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
