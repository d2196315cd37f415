"""The settings of one training run (:class:`TrainConfig`) and its learning-rate schedule
(:func:`lr_at`: linear warmup, then cosine decay to a floor)."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["TrainConfig", "lr_at"]


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
        pad: train and evaluate variable-length batches (a task with
            ``variable_length``, e.g. ``TextLM(unit="line")``) padded, with a key mask,
            instead of packed (the default: the real tokens end to end, no compute on
            padding); the losses agree to float tolerance, so this is for comparing the two.
            Fixed-length tasks have no padding and refuse it.
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
    pad: bool = False

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
        if not isinstance(self.pad, bool):
            raise TypeError(f"pad must be a bool, got {self.pad!r}")
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
        if not d["pad"]:  # the same
            del d["pad"]
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
