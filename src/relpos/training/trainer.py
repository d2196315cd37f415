"""Training loop: AdamW with linear warmup and cosine decay, periodic evaluation,
crash-safe checkpoints, exact resume and data-parallel training.

Determinism: the batch of step ``s`` is a pure function of ``(seed, s)`` (see
:mod:`relpos.training.tasks`), the learning rate a pure function of ``s``, and the checkpoint holds
the weights, the optimizer state and the torch RNG states, so a run resumed from a
checkpoint ends with the same weights as an uninterrupted one.

Output directory: ``checkpoints/`` and ``metrics.json``. :func:`train` refuses a directory
that already holds a run unless it resumes it or is told to replace it (``overwrite``).
"""

from __future__ import annotations

import json
import math
import numbers
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relpos._sysinfo import environment
from relpos.training.checkpoint import (
    MANIFEST,
    CheckpointError,
    atomic_write_json,
    check_model_state,
    check_optimizer_state,
    has_checkpoint,
    load_checkpoint,
    read_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from relpos.training.distributed import DistContext, rank_slice
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

METRICS_FILE = "metrics.json"
CHECKPOINT_DIR = "checkpoints"


@dataclass
class TrainConfig:
    """Optimisation and evaluation settings of one run.

    Attributes:
        steps: optimizer steps.
        batch_size: global batch (sequences per step, over all processes).
        length: training sequence length L.
        lr: peak learning rate (after warmup).
        min_lr_ratio: final learning rate as a fraction of ``lr`` (cosine floor).
        warmup: linear warmup steps.
        weight_decay: AdamW weight decay on matrices (not on biases, norms or tables).
        grad_clip: clip the gradient norm to this (0 = off).
        seed: seeds the weights and the data stream.
        eval_lengths: lengths evaluated at the end (the first also periodically).
        eval_tokens: about this many tokens are evaluated per length.
        eval_every: evaluate every this many steps (0 = only at the end).
        checkpoint_every: checkpoint every this many steps (0 = only at the end).
        schedule_steps: the learning-rate schedule (warmup, then cosine decay to the floor)
            spans this many steps, the floor holds after them; None = ``steps``. A run
            resumed with more ``steps`` than it was started with keeps its schedule this
            way (``relpos train --resume --steps N`` sets it).
    """

    steps: int = 300
    batch_size: int = 32
    length: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    eval_lengths: tuple[int, ...] = (64,)
    eval_tokens: int = 16384
    eval_every: int = 0
    checkpoint_every: int = 0
    schedule_steps: int | None = None

    #: Fields that do not change the trained weights (may differ on resume).
    NON_DEFINING = ("eval_lengths", "eval_tokens", "eval_every", "checkpoint_every")
    #: Fields that may differ on resume as long as the schedule stays (see ``schedule``).
    LENGTH = ("steps", "schedule_steps")

    def __post_init__(self) -> None:
        self.eval_lengths = tuple(self.eval_lengths) or (self.length,)
        for name in ("steps", "batch_size", "length", "eval_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("warmup", "eval_every", "checkpoint_every", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.seed > 2**64 - 1:
            raise ValueError(f"seed must be an int in 0..2**64 - 1 (torch.manual_seed's range), "
                             f"got {self.seed}")
        if self.schedule_steps is not None:
            value = self.schedule_steps
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"schedule_steps must be an int >= 1 or None, got {value!r}")
            if value == self.steps:
                self.schedule_steps = None
        for name, low, high, closed in (
            ("lr", 0.0, math.inf, False),
            ("min_lr_ratio", 0.0, 1.0, True),
            ("weight_decay", 0.0, math.inf, True),
            ("grad_clip", 0.0, math.inf, True),
        ):
            given = getattr(self, name)
            if isinstance(given, bool) or not isinstance(given, numbers.Real):
                raise TypeError(f"{name} must be a float, got {given!r}")
            value = float(given)
            inside = (low <= value if closed else low < value) and value <= high
            if not (inside and math.isfinite(value)):
                allowed = f"in [{low:g}, {high:g}]" if high < math.inf else (
                    f"finite and {'>=' if closed else '>'} {low:g}"
                )
                raise ValueError(f"{name} must be {allowed}, got {given!r}")
        if any(not isinstance(n, int) or n < 1 for n in self.eval_lengths):
            raise ValueError(f"eval lengths must be ints >= 1, got {list(self.eval_lengths)!r}")

    @property
    def schedule(self) -> int:
        """The steps the learning-rate schedule spans (``schedule_steps`` or ``steps``)."""
        return self.schedule_steps or self.steps

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eval_lengths"] = list(self.eval_lengths)
        if d["schedule_steps"] is None:  # as written before the field existed
            del d["schedule_steps"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if "eval_lengths" in kw:
            kw["eval_lengths"] = tuple(kw["eval_lengths"])
        return cls(**kw)


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of ``step`` (0-based): linear warmup, then cosine to the floor at
    ``config.schedule`` steps, and the floor after."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    span = max(1, config.schedule - config.warmup)
    progress = min(1.0, (step - config.warmup) / span)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


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


def _masked_stats(logits: Tensor, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
    """Per-position CE (B, L), correct (B, L) bool, both only meaningful where mask."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten(), reduction="none")
    ce = ce.view_as(batch.targets)  # (B, L)
    correct = logits.argmax(-1) == batch.targets  # (B, L)
    return ce, correct, batch.mask


@torch.no_grad()
def evaluate(
    model: nn.Module,
    task: Task,
    *,
    seed: int,
    length: int,
    eval_tokens: int = 16384,
    batch_tokens: int = 8192,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Loss and accuracy on the eval split at one length, broken down by the task's meta.

    Args:
        model: maps ids (B, L) to logits (B, L, V).
        task: the task.
        seed: the run's seed (the eval split is a separate stream of it).
        length: L, the sequence length.
        eval_tokens: evaluate ``ceil(eval_tokens / L)`` sequences.
        batch_tokens: sequences per forward pass ``max(1, batch_tokens // L)``.
        device: where the model lives.

    Returns:
        ``{"length", "loss", "accuracy", "count", "by": {key: {value: {"accuracy",
        "count"}}}}`` (``by`` empty when the task has no breakdown).
    """
    was_training = model.training
    model.eval()
    sequences = max(1, math.ceil(eval_tokens / length))
    per_batch = max(1, batch_tokens // length)
    loss_sum = 0.0
    correct_sum = 0
    count = 0
    by: dict[int, list[int]] = {}
    key = task.breakdown
    for index, start in enumerate(range(0, sequences, per_batch)):
        size = min(per_batch, sequences - start)
        batch = task.batch(seed=seed, step=index, batch_size=size, length=length, split="eval").to(
            device
        )
        ce, correct, mask = _masked_stats(model(batch.ids), batch)
        loss_sum += float(ce[mask].double().sum())
        correct_sum += int(correct[mask].sum())
        count += int(mask.sum())
        if key is not None:
            values = batch.meta[key][mask].tolist()
            hits = correct[mask].tolist()
            for v, h in zip(values, hits, strict=True):
                slot = by.setdefault(int(v), [0, 0])
                slot[0] += int(h)
                slot[1] += 1
    model.train(was_training)
    result: dict[str, Any] = {
        "length": length,
        "loss": loss_sum / max(count, 1),
        "accuracy": correct_sum / max(count, 1),
        "count": count,
        "by": {},
    }
    if key is not None:
        result["by"][key] = {
            str(v): {"accuracy": c / n, "count": n} for v, (c, n) in sorted(by.items())
        }
    return result


def _compare(saved: dict[str, Any], wanted: dict[str, Any], prefix: str) -> list[str]:
    diffs = []
    for name in sorted(set(saved) | set(wanted)):
        a, b = saved.get(name), wanted.get(name)
        if a != b:
            diffs.append(f"{prefix}{name} {a!r} (checkpoint) vs {b!r} (now)")
    return diffs


def _check_compatible(state: dict[str, Any], model: dict, task: dict, cfg: dict) -> None:
    diffs = _compare(state["model"], model, "model.")
    diffs += _compare(state["task"], task, "task.")
    skip = (*TrainConfig.NON_DEFINING, *TrainConfig.LENGTH)
    saved_train = {k: v for k, v in state["train"].items() if k not in skip}
    wanted_train = {k: v for k, v in cfg.items() if k not in skip}
    diffs += _compare(saved_train, wanted_train, "")
    saved_schedule = state["train"].get("schedule_steps") or state["train"].get("steps")
    wanted_schedule = cfg.get("schedule_steps") or cfg["steps"]
    if saved_schedule != wanted_schedule:
        diffs.append(
            f"learning-rate schedule over {saved_schedule!r} steps (checkpoint) vs "
            f"{wanted_schedule!r} (now; to train longer keep it: "
            f"TrainConfig(steps={cfg['steps']}, schedule_steps={saved_schedule!r}))"
        )
    if diffs:
        shown = "; ".join(diffs[:4]) + ("; ..." if len(diffs) > 4 else "")
        raise ValueError(f"cannot resume: the checkpoint has a different configuration: {shown}")


def _check_sections(state: dict[str, Any], where: str) -> None:
    """The entries of a training checkpoint's ``state.json`` beyond every checkpoint's."""
    for key in ("model", "task", "train"):
        if not isinstance(state.get(key), dict):
            raise CheckpointError(
                f"damaged checkpoint {where!r}: state.json has no {key!r} configuration "
                f"(got {type(state.get(key)).__name__})"
            )
    history = state.get("history", {"train": [], "eval": []})
    if not (
        isinstance(history, dict)
        and isinstance(history.get("train"), list)
        and isinstance(history.get("eval"), list)
    ):
        raise CheckpointError(
            f"damaged checkpoint {where!r}: state.json 'history' must hold 'train' and "
            "'eval' lists"
        )


@dataclass(frozen=True)
class SavedRun:
    """The configuration of the run whose checkpoint is in an output directory.

    Attributes:
        step: the step of the checkpoint.
        model: the model configuration (a :class:`relpos.models.ModelConfig`).
        task: the task's ``config()`` (see :func:`relpos.training.tasks.task_from_config`).
        train: the :class:`TrainConfig` it was trained with.
    """

    step: int
    model: Any
    task: dict[str, Any]
    train: TrainConfig


def read_saved_run(out_dir: str | Path) -> SavedRun:
    """The configuration saved with the latest checkpoint of the run in ``out_dir``
    (``out_dir/checkpoints``), without reading its tensors.

    Raises:
        CheckpointError: if there is no checkpoint or its configuration is damaged.
    """
    from relpos.models import ModelConfig

    ckpt_dir = Path(out_dir) / CHECKPOINT_DIR
    if not has_checkpoint(ckpt_dir):
        raise CheckpointError(f"no checkpoint in {str(ckpt_dir)!r} (missing {MANIFEST})")
    state = read_state(ckpt_dir)
    _check_sections(state, str(ckpt_dir))
    try:
        model = ModelConfig.from_dict(state["model"])
        train = TrainConfig.from_dict(state["train"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"damaged checkpoint {str(ckpt_dir)!r}: its configuration is invalid: {err}"
        ) from None
    if "name" not in state["task"]:
        raise CheckpointError(f"damaged checkpoint {str(ckpt_dir)!r}: its task has no name")
    return SavedRun(int(state["step"]), model, dict(state["task"]), train)


def previous_run(out_dir: str | Path) -> list[Path]:
    """What a run left in ``out_dir``: its ``checkpoints/`` (if not empty) and
    ``metrics.json``, those present."""
    out = Path(out_dir)
    found = []
    ckpt = out / CHECKPOINT_DIR
    if ckpt.exists() and not (ckpt.is_dir() and not any(ckpt.iterdir())):
        found.append(ckpt)
    if (out / METRICS_FILE).exists():
        found.append(out / METRICS_FILE)
    return found


def _ours(name: str) -> bool:
    """Whether a name in ``checkpoints/`` is one :func:`save_checkpoint` writes."""
    return name == MANIFEST or name.startswith(("step-", ".tmp-")) or (
        name.startswith(".") and name.endswith(".tmp")
    )


def clear_run(out_dir: str | Path) -> list[Path]:
    """Remove what a run left in ``out_dir`` (see :func:`previous_run`); returns it.

    Raises:
        ValueError: if ``checkpoints/`` holds anything a run does not write (nothing is
            removed then).
    """
    found = previous_run(out_dir)
    for path in found:
        if path.name == CHECKPOINT_DIR:
            if not path.is_dir():
                raise ValueError(f"{str(path)!r} is not a checkpoint directory; remove it")
            foreign = sorted(p.name for p in path.iterdir() if not _ours(p.name))
            if foreign:
                raise ValueError(
                    f"{str(path)!r} holds files relpos train does not write "
                    f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                    "remove them or choose another output directory"
                )
        elif path.is_dir():
            raise ValueError(f"{str(path)!r} is a directory, not a metrics file; remove it")
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return found


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

    Losses are cross-entropies in nats per scored position (divide by ln 2 for bits).

    Returns:
        ``(model, metrics)``; ``metrics`` is also written to ``out_dir/metrics.json``.

    Raises:
        ValueError: on an inconsistent setup, a missing or incompatible checkpoint, or an
            ``out_dir`` holding another run.
        relpos.training.CheckpointError: (a ValueError) on a damaged checkpoint.
    """
    from relpos.models import build_model

    ctx = ctx or DistContext()
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
    start, stop = rank_slice(config.batch_size, ctx)
    out = Path(out_dir) if out_dir is not None else None
    ckpt_dir = out / CHECKPOINT_DIR if out is not None else None
    if out is not None and ctx.is_main and not resume:
        found = previous_run(out)
        if found and not overwrite:
            raise ValueError(
                f"{str(out)!r} already holds a run ({', '.join(p.name for p in found)}); "
                "resume=True continues it, overwrite=True replaces it"
            )
        if found:
            clear_run(out)

    torch.manual_seed(config.seed)
    model = build_model(model_config).to(ctx.device)
    optimizer = torch.optim.AdamW(
        _param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.98), eps=1e-8
    )
    history: dict[str, list[Any]] = {"train": [], "eval": []}
    first_step = 0
    task_cfg = task.config()
    model_cfg = model_config.to_dict()
    train_cfg = config.to_dict()
    if resume:
        if ckpt_dir is None or not has_checkpoint(ckpt_dir):
            raise ValueError(f"--resume: no checkpoint in {str(ckpt_dir)!r}")
        ckpt = load_checkpoint(ckpt_dir)
        _check_sections(ckpt.state, str(ckpt.path))
        _check_compatible(ckpt.state, model_cfg, task_cfg, train_cfg)
        if ckpt.step > config.steps:
            raise ValueError(
                f"cannot resume: the checkpoint is at step {ckpt.step}, beyond the "
                f"{config.steps} steps asked for"
            )
        expected = model.state_dict()
        try:  # load_state_dict also converts the states of earlier relpos versions
            model.load_state_dict(ckpt.model_state)
        except RuntimeError as err:
            check_model_state(ckpt, expected)  # raises naming the weights that do not fit
            raise CheckpointError(
                f"damaged checkpoint {str(ckpt.path)!r}: {' '.join(str(err).split())}"
            ) from None
        if set(ckpt.model_state) != set(expected):
            env = ckpt.state.get("environment")
            version = env.get("relpos") if isinstance(env, dict) else None
            raise CheckpointError(
                f"cannot resume from {str(ckpt.path)!r}: its weights use an earlier parameter "
                f"layout (written by relpos {version or '<= 0.1'}); they load (relpos "
                "export-onnx reads them) but its optimizer state does not carry over; start "
                "a new run"
            )
        check_optimizer_state(ckpt, optimizer)
        if "torch" not in ckpt.rng_state:
            raise CheckpointError(
                f"damaged checkpoint {str(ckpt.path)!r}: no torch RNG state (rng.torch)"
            )
        try:
            optimizer.load_state_dict(ckpt.optimizer_state)
            set_rng_state(ckpt.rng_state)
        except (RuntimeError, ValueError, TypeError, KeyError) as err:
            raise CheckpointError(
                f"damaged checkpoint {str(ckpt.path)!r}: cannot restore the optimizer and "
                f"RNG state: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
            ) from None
        history = ckpt.state.get("history", history)
        first_step = ckpt.step
    if out is not None and ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)

    net: nn.Module = model
    if ctx.distributed:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
        )
    num_params = sum(p.numel() for p in model.parameters())

    def checkpoint(step: int) -> None:
        if ckpt_dir is None or not ctx.is_main:
            return
        save_checkpoint(
            ckpt_dir,
            model_state=model.state_dict(),
            optimizer_state=optimizer.state_dict(),
            rng_state=rng_state(),
            state={
                "step": step,
                "model": model_cfg,
                "task": task_cfg,
                "train": train_cfg,
                "history": history,
                "environment": environment(),
            },
        )

    bar = None
    if progress and ctx.is_main and first_step < config.steps:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=config.steps,
            initial=first_step,
            desc="train",
            dynamic_ncols=True,
            file=sys.stderr,
        )
    net.train()
    tokens_per_step = config.batch_size * config.length
    started = time.perf_counter()
    rate = 0.0
    for step in range(first_step, config.steps):
        tick = time.perf_counter()
        lr = lr_at(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        full = task.batch(
            seed=config.seed,
            step=step,
            batch_size=config.batch_size,
            length=config.length,
            split="train",
        )
        # Normalise by the GLOBAL number of scored positions so that DDP's gradient
        # average equals the single-process gradient of the whole batch.
        global_count = max(int(full.mask.sum()), 1)
        batch = full.slice(start, stop).to(ctx.device)
        logits = net(batch.ids)
        ce, correct, mask = _masked_stats(logits, batch)
        loss = (ce * mask).sum() / global_count * ctx.world_size
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
        history["train"].append([step + 1, stats["loss"], stats["accuracy"]])
        elapsed = time.perf_counter() - tick
        now = tokens_per_step / max(elapsed, 1e-9)
        rate = now if rate == 0 else 0.9 * rate + 0.1 * now
        done = step + 1
        periodic = config.eval_every and done % config.eval_every == 0 and done < config.steps
        if periodic and ctx.is_main:
            ev = evaluate(
                model,
                task,
                seed=config.seed,
                length=config.eval_lengths[0],
                eval_tokens=config.eval_tokens,
                device=ctx.device,
            )
            history["eval"].append(
                {
                    "step": done,
                    "length": ev["length"],
                    "loss": ev["loss"],
                    "accuracy": ev["accuracy"],
                }
            )
            line = (f"step {done}: eval loss {_nats(ev['loss'])} accuracy "
                    f"{ev['accuracy']:.4f} (length {ev['length']})")
            if bar is not None:
                bar.write(line)
            elif log is not None:
                log(line)
        if config.checkpoint_every and done % config.checkpoint_every == 0 and done < config.steps:
            checkpoint(done)
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
    if bar is not None:
        bar.close()
    train_seconds = time.perf_counter() - started

    metrics: dict[str, Any] = {"format_version": 1}
    if ctx.is_main:
        evals = [
            evaluate(
                model,
                task,
                seed=config.seed,
                length=n,
                eval_tokens=config.eval_tokens,
                device=ctx.device,
            )
            for n in config.eval_lengths
        ]
        last = history["train"][-1] if history["train"] else [0, float("nan"), float("nan")]
        metrics.update(
            {
                "task": task_cfg,
                "model": model_cfg,
                "train": train_cfg,
                "parameters": num_params,
                "world_size": ctx.world_size,
                "steps": config.steps,
                "resumed_from": first_step if resume else None,
                "final_train_loss": last[1],
                "final_train_accuracy": last[2],
                "eval": evals,
                "history": history,
                "train_seconds": train_seconds,
                "environment": environment(),
            }
        )
        if first_step < config.steps:
            checkpoint(config.steps)
        if out is not None:
            atomic_write_json(out / METRICS_FILE, metrics)
    return model, metrics


def load_metrics(out_dir: str | Path) -> dict[str, Any]:
    """Read ``out_dir/metrics.json``."""
    return json.loads((Path(out_dir) / METRICS_FILE).read_text())


def _nats(loss: float) -> str:
    """A cross-entropy with its unit: nats, and bits beside."""
    return f"{loss:.4f} nats ({loss / math.log(2):.4f} bits)"


def summarize(metrics: dict[str, Any]) -> list[str]:
    """Human-readable lines for the final evaluation (losses in nats per scored position,
    bits beside)."""
    lines = []
    for ev in metrics.get("eval", []):
        lines.append(
            f"length {ev['length']:>5}: loss {_nats(ev['loss'])}  accuracy {ev['accuracy']:.4f}  "
            f"({ev['count']} scored positions)"
        )
        for key, table in ev.get("by", {}).items():
            cells = "  ".join(f"{k}:{v['accuracy']:.2f}" for k, v in table.items())
            lines.append(f"    by {key}: {cells}")
    return lines
