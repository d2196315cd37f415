"""Resuming a run: the configuration saved with its latest checkpoint
(:func:`read_saved_run`), whether that run is the one asked for, and restoring the weights,
the optimizer state and the RNG states from the checkpoint (:func:`restore`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from relpos.training.checkpoint import (
    MANIFEST,
    CheckpointError,
    check_model_state,
    check_optimizer_state,
    has_checkpoint,
    load_checkpoint,
    read_state,
    set_rng_state,
)
from relpos.training.config import TrainConfig
from relpos.training.rundir import CHECKPOINT_DIR, METRICS_FILE

__all__ = ["SavedRun", "finished", "read_saved_run", "restore"]


def _as_saved(value: Any) -> Any:
    """``value`` as it reads back from the checkpoint's JSON (tuples are lists there)."""
    if isinstance(value, (tuple, list)):
        return [_as_saved(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_saved(v) for k, v in value.items()}
    return value


def _compare(saved: dict[str, Any], wanted: dict[str, Any], prefix: str) -> list[str]:
    diffs = []
    for name in sorted(set(saved) | set(wanted)):
        a, b = saved.get(name), wanted.get(name)
        if _as_saved(a) != _as_saved(b):
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


def finished(out_dir: str | Path, saved: SavedRun, steps: int) -> bool:
    """Whether the run in ``out_dir``, whose latest checkpoint is ``saved``, already finished
    ``steps`` steps: its checkpoint is at that step and its ``metrics.json`` reports that
    many steps. A run stopped after its last checkpoint and before its metrics has not
    finished (resuming it writes them)."""
    if saved.step != steps:
        return False
    try:
        metrics = json.loads((Path(out_dir) / METRICS_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(metrics, dict) and metrics.get("steps") == steps



def restore(
    ckpt_dir: Path | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    model_cfg: dict[str, Any],
    task_cfg: dict[str, Any],
    train_cfg: dict[str, Any],
) -> tuple[int, dict[str, list[Any]]]:
    """Load the latest checkpoint in ``ckpt_dir`` into ``model``, ``optimizer`` and the torch
    RNGs, after checking that it is the run described by ``model_cfg``, ``task_cfg`` and
    ``train_cfg`` (up to the settings that may differ, see :class:`TrainConfig`) at a step
    of at most ``steps``.

    Returns:
        ``(step, history)``: the checkpoint's step and its history (``train`` and ``eval``
        lists; empty ones if it has none).

    Raises:
        ValueError: no checkpoint, another configuration, or a step beyond ``steps``.
        CheckpointError: (a ValueError) a damaged checkpoint, or one of an earlier layout.
    """
    if ckpt_dir is None or not has_checkpoint(ckpt_dir):
        raise ValueError(f"--resume: no checkpoint in {str(ckpt_dir)!r}")
    ckpt = load_checkpoint(ckpt_dir)
    _check_sections(ckpt.state, str(ckpt.path))
    _check_compatible(ckpt.state, model_cfg, task_cfg, train_cfg)
    if ckpt.step > steps:
        raise ValueError(
            f"cannot resume: the checkpoint is at step {ckpt.step}, beyond the "
            f"{steps} steps asked for"
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
    return ckpt.step, ckpt.state.get("history", {"train": [], "eval": []})
