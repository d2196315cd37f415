"""Training loop: AdamW with linear warmup and cosine decay, periodic evaluation,
crash-safe checkpoints, exact resume and data-parallel training.

Determinism: the batch of step ``s`` is a pure function of ``(seed, s)`` (see
:mod:`relpos.training.tasks`), the learning rate a pure function of ``s``, and the checkpoint holds
the weights, the optimizer state and the torch RNG states, so a run resumed from a
checkpoint ends with the same weights as an uninterrupted one.

Variable-length batches (a task with ``variable_length``, e.g. ``TextLM(unit="line")``) are
trained padding-free: each rank packs its rows (:meth:`~relpos.training.tasks.Batch.packed`)
and calls ``model(ids, cu_seqlens=cu)``, so no compute is spent on padding;
``TrainConfig(pad=True)`` runs them padded with a key mask instead, to compare. Either way
the loss is normalised by the global number of scored tokens, so the two give the same loss
curve to float tolerance.

Output directory: ``checkpoints/`` and ``metrics.json``. :func:`train` refuses a directory
that already holds a run unless it resumes it or is told to replace it (``overwrite``).

:func:`train` is here, as a sequence of steps; the pieces it uses have their own modules:
:mod:`~relpos.training.config` (:class:`TrainConfig`, :func:`lr_at`),
:mod:`~relpos.training.rundir` (the output directory), :mod:`~relpos.training.resume`
(:func:`read_saved_run`, restoring a checkpoint) and :mod:`~relpos.training.evaluation`
(:func:`evaluate`, :func:`summarize`). Their names are importable from here as before.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from relpos._sysinfo import environment
from relpos.training.checkpoint import atomic_write_json, rng_state, save_checkpoint
from relpos.training.config import TrainConfig, lr_at
from relpos.training.data_parallel import DistContext, rank_share, rank_slice
from relpos.training.evaluation import evaluate, forward, masked_stats, nats
from relpos.training.evaluation import summarize as summarize
from relpos.training.mesh_parallel import (
    Layout,
    Parallelism,
    fresh_rng,
    full_state,
    full_weights,
    layout,
    load_optimizer_state,
    parallelize,
    shard_batch,
)
from relpos.training.resume import SavedRun, read_saved_run, restore
from relpos.training.rundir import CHECKPOINT_DIR as CHECKPOINT_DIR
from relpos.training.rundir import METRICS_FILE, clear_run, prepare_out_dir, previous_run
from relpos.training.rundir import load_metrics as load_metrics
from relpos.training.tasks import Batch, Task

__all__ = [
    "METRICS_FILE",
    "SavedRun",
    "TrainConfig",
    "clear_run",
    "evaluate",
    "lr_at",
    "previous_run",
    "read_saved_run",
    "train",
]


def train(
    model_config: Any,
    task: Task,
    config: TrainConfig,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    ctx: DistContext | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    overwrite: bool = False,
    on_backward: Callable[[int, nn.Module], None] | None = None,
    log: Callable[[str], None] | None = None,
    parallel: Parallelism | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train a model on a task; returns the (unwrapped) model and the metrics document.

    Args:
        model_config: a :class:`relpos.models.ModelConfig` (its vocabulary must cover the
            task's).
        task: the data.
        config: optimisation and evaluation settings.
        out_dir: where checkpoints (``checkpoints/``) and ``metrics.json`` go (None = no
            files).
        resume: continue from the latest checkpoint in ``out_dir``. ``config.steps`` may
            differ from the saved run's (to stop earlier or train longer) when
            ``config.schedule`` equals its schedule; everything else that shapes the
            weights must be the same.
        progress: show a progress bar (rank 0 only).
        ctx: the distributed context (None = one process on CPU).
        on_step: called on every rank as ``on_step(step, stats)`` after each step (and its
            checkpoint) with the global ``loss``/``accuracy`` of that step.
        overwrite: replace a run already in ``out_dir`` (its ``checkpoints/`` and
            ``metrics.json``); without it (and without ``resume``) such a directory is
            refused, so the files of two runs never mix.
        on_backward: called as ``on_backward(step, model)`` (0-based step, the unwrapped
            model) after each backward pass, before gradient clipping and the optimizer
            step, so the raw gradients can be read (the K study's per-row signal).
        log: where the periodic evaluation lines go without a progress bar (rank 0 only;
            None = nowhere). With one they are written above it.
        parallel: context parallelism, FSDP2 and activation checkpointing (see
            :mod:`relpos.training.mesh_parallel`); None = data parallelism (DDP) alone. Under
            context parallelism or FSDP the returned model is a plain copy of the trained
            weights (on rank 0; the others get the sharded model).

    Losses are cross-entropies in nats per scored position (divide by ln 2 for bits).

    Returns:
        ``(model, metrics)``; ``metrics`` is also written to ``out_dir/metrics.json``.

    Raises:
        ValueError: on an inconsistent setup, a missing or incompatible checkpoint, or an
            ``out_dir`` holding another run.
        relpos.training.CheckpointError: (a ValueError) on a damaged checkpoint.
    """
    ctx = ctx or DistContext()
    par = parallel or Parallelism()
    check_setup(model_config, task, config)
    par.check(ctx.world_size)
    if par.context_parallel > 1 and task.variable_length and not config.pad:
        raise ValueError(
            f"context parallelism shards padded batches; task {task.name!r} has rows of "
            "different lengths, trained packed: train them padded (pad=True, --pad)"
        )
    lay = layout(ctx, par, causal=model_config.causal)
    rank_slice(config.batch_size, lay.dp)  # the global batch must split over the dp ranks
    out = prepare_out_dir(out_dir, is_main=ctx.is_main, resume=resume, overwrite=overwrite)
    run = _new_run(model_config, task, config, ctx, out)
    run.lay, run.par = lay, par
    if resume:
        _resume(run)
    _parallelize(run)
    if out is not None and ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
    seconds = _train_steps(run, progress=progress, on_step=on_step, on_backward=on_backward,
                           log=log)
    metrics = _final_metrics(run, seconds, resumed=resume)
    return (run.eval_model or run.model), metrics


@dataclass
class _Run:
    """One run as :func:`train` advances it: what it trains, where it writes, how far it is."""

    task: Task
    config: TrainConfig
    ctx: DistContext
    out: Path | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    #: The configurations as saved with checkpoints and metrics.
    model_cfg: dict[str, Any]
    task_cfg: dict[str, Any]
    train_cfg: dict[str, Any]
    first_step: int = 0
    #: ``train``: ``[step, loss, accuracy]`` rows; ``eval``: the periodic evaluations.
    history: dict[str, list[Any]] = field(default_factory=lambda: {"train": [], "eval": []})
    lay: Layout | None = None
    par: Parallelism = field(default_factory=Parallelism)
    #: What runs the training step (the model, or DDP around it).
    net: nn.Module | None = None
    #: Parameter names by optimizer index (the checkpoint's numbering).
    names: list[str] = field(default_factory=list)
    #: A plain copy of the weights that rank 0 evaluates when the model spans ranks.
    eval_model: nn.Module | None = None

    @property
    def ckpt_dir(self) -> Path | None:
        return self.out / CHECKPOINT_DIR if self.out is not None else None


def check_setup(model_config: Any, task: Task, config: TrainConfig) -> None:
    """Refuse a model that cannot learn ``task`` at the lengths of ``config``, and ``pad``
    where there is no padding."""
    if config.pad and not task.variable_length:
        raise ValueError(
            f"pad=True trains variable-length batches padded instead of packed; task "
            f"{task.name!r} has fixed-length rows, with no padding (allowed: pad=False, or a "
            "variable-length task such as TextLM(path, unit='line'))"
        )
    if task.causal_only and not model_config.causal:
        raise ValueError(
            f"task {task.name!r} predicts next tokens, so a bidirectional model would see "
            "the answer; use a causal model"
        )
    if model_config.vocab_size < task.vocab_size:
        raise ValueError(
            f"model vocab_size {model_config.vocab_size} < task vocab_size {task.vocab_size}"
        )
    lengths = (config.length, *config.eval_lengths)
    for n in lengths:
        if n < task.min_length():
            raise ValueError(f"task {task.name!r} needs length >= {task.min_length()}, got {n}")
    if model_config.positions == "learned" and max(lengths) > model_config.max_length:
        raise ValueError(
            f"learned positions cover max_length={model_config.max_length} positions, "
            f"but length {max(lengths)} was asked for"
        )


def _new_run(
    model_config: Any, task: Task, config: TrainConfig, ctx: DistContext, out: Path | None
) -> _Run:
    """The model (seeded by ``config.seed``) and its AdamW optimizer, at step 0."""
    from relpos.models import build_model

    torch.manual_seed(config.seed)
    model = build_model(model_config).to(ctx.device)
    optimizer = _optimizer(model, config)
    return _Run(
        task=task, config=config, ctx=ctx, out=out, model=model, optimizer=optimizer,
        model_cfg=model_config.to_dict(), task_cfg=task.config(), train_cfg=config.to_dict(),
    )


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """The run's AdamW over ``model``'s parameters (weight decay on matrices only)."""
    return torch.optim.AdamW(
        _param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.98), eps=1e-8
    )


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # Matrices decay; biases, norms, embeddings of positions and relative tables do not.
        is_table = "rel" in name or "pos" in name
        (decay if p.dim() >= 2 and not is_table else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _resume(run: _Run) -> None:
    """Continue from the latest checkpoint in the run's directory (see :func:`restore`)."""
    run.first_step, run.history = restore(
        run.ckpt_dir, run.model, run.optimizer, steps=run.config.steps,
        model_cfg=run.model_cfg, task_cfg=run.task_cfg, train_cfg=run.train_cfg,
    )


def _parallelize(run: _Run) -> None:
    """Make ``run.net``: the model under the run's parallelism. FSDP replaces the weights
    with shards, so the optimizer is rebuilt over them and given the state it had."""
    from relpos.training.mesh_parallel import _names

    assert run.lay is not None
    run.names = _names(run.model, run.optimizer.param_groups)
    plain_state = run.optimizer.state_dict()
    run.net = parallelize(run.model, run.ctx, run.lay, run.par)
    if run.par.fsdp and run.ctx.distributed:
        run.optimizer = _optimizer(run.model, run.config)
        if plain_state["state"]:
            load_optimizer_state(run.model, run.optimizer, plain_state, run.names)


def _eval_copy(run: _Run) -> nn.Module:
    """The model rank 0 evaluates: the run's own, or, when it spans ranks (context
    parallelism, FSDP), a plain copy of its weights. Every rank calls it (FSDP gathers)."""
    if not (run.par.spans_ranks and run.ctx.distributed):
        return run.model
    from relpos.models import ModelConfig, build_model

    weights = full_weights(run.model, fsdp=run.par.fsdp)
    if not run.ctx.is_main:
        return run.model
    if run.eval_model is None:  # built once; later evaluations load the new weights into it
        with fresh_rng():
            run.eval_model = build_model(ModelConfig.from_dict(run.model_cfg)).to(
                run.ctx.device)
    run.eval_model.load_state_dict(weights)
    return run.eval_model


def _train_steps(
    run: _Run,
    *,
    progress: bool,
    on_step: Callable[[int, dict[str, float]], None] | None,
    on_backward: Callable[[int, nn.Module], None] | None,
    log: Callable[[str], None] | None,
) -> float:
    """The steps from ``run.first_step`` to ``config.steps``, each followed by its periodic
    evaluation and checkpoint when due, the progress bar and ``on_step``; returns the
    seconds they took."""
    config, ctx = run.config, run.ctx
    net = run.net if run.net is not None else _distributed(run.model, ctx)
    bar = None
    if progress and ctx.is_main and run.first_step < config.steps:
        bar = _progress_bar(config.steps, run.first_step)
    net.train()
    started = time.perf_counter()
    rate = 0.0  # real tokens (not padding) per second, over all ranks
    try:  # an interrupted run leaves the bar where it stopped, on a line of its own
        for step in range(run.first_step, config.steps):
            tick = time.perf_counter()
            stats, tokens = _train_step(run, net, step, on_backward)
            now = tokens / max(time.perf_counter() - tick, 1e-9)
            rate = now if rate == 0 else 0.9 * rate + 0.1 * now
            done = step + 1
            if _due(config.eval_every, done, config.steps):
                evaluated = _eval_copy(run)  # every rank: FSDP gathers the weights
                if ctx.is_main:
                    line = _periodic_evaluation(run, done, evaluated)
                    if bar is not None:
                        bar.write(line)
                    elif log is not None:
                        log(line)
            if _due(config.checkpoint_every, done, config.steps):
                _checkpoint(run, done)
            if bar is not None:
                bar.set_postfix(
                    loss=f"{stats['loss']:.4f}",
                    acc=f"{stats['accuracy']:.3f}",
                    tok_s=f"{rate:,.0f}",
                    refresh=False,
                )
                bar.update(1)
            if on_step is not None:
                on_step(done, stats)
    finally:
        if bar is not None:
            bar.close()
    return time.perf_counter() - started


def _distributed(model: nn.Module, ctx: DistContext) -> nn.Module:
    """``model`` as the training step runs it: wrapped in DDP when there are several ranks."""
    if not ctx.distributed:
        return model
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
    )


def _progress_bar(steps: int, first_step: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=steps,
        initial=first_step,
        desc="train",
        dynamic_ncols=True,
        file=sys.stderr,
    )


def _due(every: int, done: int, steps: int) -> bool:
    """Whether a periodic evaluation or checkpoint (``every`` steps, 0 = none) follows step
    ``done``; the last step has the final ones instead."""
    return bool(every) and done % every == 0 and done < steps


def _train_step(
    run: _Run,
    net: nn.Module,
    step: int,
    on_backward: Callable[[int, nn.Module], None] | None,
) -> tuple[dict[str, float], int]:
    """One optimizer step (0-based ``step``) on this rank's rows of the global batch
    (:func:`rank_share`; packed when they have different lengths, see :func:`forward`);
    returns the global ``loss``, ``accuracy`` and ``lr`` of the step (also added to the
    history) and the global batch's real tokens."""
    config, ctx, model, optimizer = run.config, run.ctx, run.model, run.optimizer
    lr = lr_at(step, config)
    for group in optimizer.param_groups:
        group["lr"] = lr
    full = run.task.batch(
        seed=config.seed,
        step=step,
        batch_size=config.batch_size,
        length=config.length,
        split="train",
    )
    # Normalise by the GLOBAL number of scored positions so that DDP's gradient
    # average equals the single-process gradient of the whole batch.
    global_count = max(int(full.mask.sum()), 1)
    lay = run.lay or Layout(dp=ctx)
    batch = shard_batch(full.slice(*rank_share(len(full), lay.dp)), lay).to(ctx.device)
    loss, ce, correct, mask = _rank_loss(net, model, batch, pad=config.pad,
                                         global_count=global_count, world_size=ctx.world_size)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if on_backward is not None:
        on_backward(step, model)
    if config.grad_clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    stats_t = torch.stack(
        [(ce * mask).sum().detach().double(), (correct & mask).sum().double()]
    )
    if ctx.distributed:
        import torch.distributed as dist

        dist.all_reduce(stats_t)
    stats = {
        "loss": float(stats_t[0]) / global_count,
        "accuracy": float(stats_t[1]) / global_count,
        "lr": lr,
    }
    run.history["train"].append([step + 1, stats["loss"], stats["accuracy"]])
    return stats, full.tokens


def _rank_loss(
    net: nn.Module,
    model: nn.Module,
    batch: Batch,
    *,
    pad: bool,
    global_count: int,
    world_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """This rank's loss, the summed cross-entropy of its scored positions over the global
    batch's ``global_count`` scored positions, times ``world_size`` (DDP averages the
    gradients over the ranks), and the per-position ``ce``, ``correct`` and ``mask`` (see
    :func:`masked_stats`).

    ``net`` runs the batch (:func:`forward`); ``model`` is the unwrapped model. A rank
    without rows (a batch of fewer rows than ranks) still joins DDP's gradient all-reduce,
    which waits for a gradient of every weight: its loss is an empty packed batch's plus
    zero times every weight, so each gets a zero gradient.
    """
    logits, scored = forward(net, batch, pad=pad)
    ce, correct, mask = masked_stats(logits, scored)
    loss = (ce * mask).sum() / global_count * world_size
    if not len(batch):
        loss = loss + sum(0.0 * p.sum() for p in model.parameters() if p.requires_grad)
    return loss, ce, correct, mask


def _evaluate(run: _Run, length: int, model: nn.Module | None = None) -> dict[str, Any]:
    """:func:`evaluate` of the run's model (or ``model``) on its task at ``length``."""
    return evaluate(
        run.model if model is None else model,
        run.task,
        seed=run.config.seed,
        length=length,
        eval_tokens=run.config.eval_tokens,
        device=run.ctx.device,
        pad=run.config.pad,
    )


def _periodic_evaluation(run: _Run, done: int, model: nn.Module | None = None) -> str:
    """Evaluate at the first eval length after step ``done``, into the history; returns the
    line that reports it."""
    ev = _evaluate(run, run.config.eval_lengths[0], model)
    run.history["eval"].append(
        {
            "step": done,
            "length": ev["length"],
            "loss": ev["loss"],
            "accuracy": ev["accuracy"],
        }
    )
    return (f"step {done}: eval loss {nats(ev['loss'])} accuracy "
            f"{ev['accuracy']:.4f} (length {ev['length']})")


def _checkpoint(run: _Run, step: int) -> None:
    """Save the run at ``step`` (rank 0, with an output directory; under FSDP every rank
    calls it, to gather the states)."""
    if run.ckpt_dir is None:
        return
    fsdp = run.par.fsdp and run.ctx.distributed
    if not (run.ctx.is_main or fsdp):
        return
    weights, optimizer_state = full_state(run.model, run.optimizer, run.names, fsdp=fsdp)
    if not run.ctx.is_main:
        return
    save_checkpoint(
        run.ckpt_dir,
        model_state=weights,
        optimizer_state=optimizer_state,
        rng_state=rng_state(),
        state={
            "step": step,
            "model": run.model_cfg,
            "task": run.task_cfg,
            "train": run.train_cfg,
            "history": run.history,
            "environment": environment(),
        },
    )


def _final_metrics(run: _Run, train_seconds: float, *, resumed: bool) -> dict[str, Any]:
    """The metrics document (rank 0: the final evaluation at every eval length, the run's
    configuration and history; other ranks: only its format version), after the final
    checkpoint and ``metrics.json`` are written."""
    config, ctx = run.config, run.ctx
    metrics: dict[str, Any] = {"format_version": 1}
    evaluated = _eval_copy(run)  # every rank: FSDP gathers the weights
    if not ctx.is_main:
        if run.first_step < config.steps:
            _checkpoint(run, config.steps)  # FSDP: the ranks take part in the gather
        return metrics
    evals = [_evaluate(run, n, evaluated) for n in config.eval_lengths]
    history = run.history
    last = history["train"][-1] if history["train"] else [0, float("nan"), float("nan")]
    metrics.update(
        {
            "task": run.task_cfg,
            "model": run.model_cfg,
            "train": run.train_cfg,
            "parameters": sum(p.numel() for p in run.model.parameters()),
            "world_size": ctx.world_size,
            "parallelism": dataclasses.asdict(run.par),
            "steps": config.steps,
            "resumed_from": run.first_step if resumed else None,
            "final_train_loss": last[1],
            "final_train_accuracy": last[2],
            "eval": evals,
            "history": history,
            "train_seconds": train_seconds,
            "environment": environment(),
        }
    )
    if run.first_step < config.steps:
        _checkpoint(run, config.steps)
    if run.out is not None:
        atomic_write_json(run.out / METRICS_FILE, metrics)
    return metrics
