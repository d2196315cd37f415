"""Parallel runs of the sweep: one spawned process per job, each with ``config.threads``
torch threads (:func:`train_parallel`). A run trains the same in a worker as in the sweep's
own process, so the numbers do not depend on ``jobs``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch

from relpos.training.experiment.calibrate import cost
from relpos.training.experiment.config import ExperimentConfig
from relpos.training.experiment.sweep import RunSpec, build_tasks, train_run

__all__ = ["train_parallel"]

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
        tasks.update(build_tasks(replace(cfg, tasks=(run_spec.task,))))
    return train_run(run_spec, cfg, tasks[run_spec.task])


def train_parallel(config: ExperimentConfig, specs: list[RunSpec], todo: list[int],
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
        order = sorted(todo, key=lambda i: -cost(specs[i], config))
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
