"""The sweep's time estimate: the relative cost of each run (:func:`cost`), and seconds per
unit of it on this machine from a few timed training steps (:func:`calibrate`)."""

from __future__ import annotations

import time

import torch

from relpos.training.experiment.config import CODE_TASK, ExperimentConfig
from relpos.training.experiment.sweep import RunSpec, budget, model_config, train_config
from relpos.training.tasks import Task

__all__ = ["calibrate", "cost"]


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
