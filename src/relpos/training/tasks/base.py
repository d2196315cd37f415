"""What every task shares: :class:`Batch`, the :class:`Task` interface, the splits and the
deterministic seeds of each batch (see :mod:`relpos.training.tasks`)."""


from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = ["SPLITS", "Batch", "Task"]


#: Data splits; each draws from its own independent stream.
SPLITS = ("train", "eval")



@dataclass
class Batch:
    """One batch of a task.

    Attributes:
        ids: (B, L) long, the input tokens (0 on padding).
        targets: (B, L) long, the token to predict at each position (0 where unscored).
        mask: (B, L) bool, True where the position is scored (never on padding).
        meta: name -> (B, L) long, per-position metadata of scored positions (-1 elsewhere).
        key_mask: (B, L) bool, True = real token, for rows of different lengths padded on
            the right to the longest; None = every position is real (fixed-length rows).

    :meth:`packed` gives the same batch as (T,) tensors, the real tokens end to end.
    """

    ids: Tensor
    targets: Tensor
    mask: Tensor
    meta: dict[str, Tensor] = field(default_factory=dict)
    key_mask: Tensor | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def tokens(self) -> int:
        """The number of real tokens: True entries of ``key_mask``, or every position."""
        if self.key_mask is None:
            return int(self.ids.numel())
        return int(self.key_mask.sum())

    def slice(self, start: int, stop: int) -> Batch:
        """Examples ``start..stop-1`` (a rank's share of a global batch)."""
        return Batch(
            self.ids[start:stop],
            self.targets[start:stop],
            self.mask[start:stop],
            {k: v[start:stop] for k, v in self.meta.items()},
            None if self.key_mask is None else self.key_mask[start:stop],
        )

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.ids.to(device),
            self.targets.to(device),
            self.mask.to(device),
            {k: v.to(device) for k, v in self.meta.items()},
            None if self.key_mask is None else self.key_mask.to(device),
        )

    def packed(self) -> tuple[Batch, Tensor]:
        """The batch without padding, as :func:`relpos.pack` lays it out.

        Returns:
            ``(packed, cu_seqlens)``: a :class:`Batch` of (T,) tensors (``ids``,
            ``targets``, ``mask`` and ``meta``; ``key_mask`` None), the real tokens of every
            row end to end (T = :attr:`tokens`), and ``cu_seqlens`` (B + 1,) int32, the
            rows' boundaries (what ``model(ids, cu_seqlens=...)`` takes).
        """
        from relpos.varlen import pack

        padding = None if self.key_mask is None else ~self.key_mask
        ids, cu = pack(self.ids, padding)
        return Batch(
            ids,
            pack(self.targets, padding)[0],
            pack(self.mask, padding)[0],
            {k: pack(v, padding)[0] for k, v in self.meta.items()},
        ), cu


def _stream_seed(*parts: object) -> int:
    """A 63-bit seed that depends only on ``parts`` (stable across runs and platforms)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _check_distances(distances: Sequence[int], name: str) -> tuple[int, ...]:
    values = tuple(distances)
    if not values:
        raise ValueError(f"{name}: need at least one distance, got {list(values)!r}")
    for d in values:
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"{name}: distances must be ints >= 1, got {list(values)!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name}: distances must be distinct, got {list(values)!r}")
    return tuple(sorted(values))


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class Task(ABC):
    """A source of batches, a pure function of ``(seed, split, step, length)``."""

    #: Registry name (``--task``).
    name: str = ""
    #: Targets are next tokens, so a bidirectional model would see the answer.
    causal_only: bool = False
    #: The meta key accuracy is broken down by, if any.
    breakdown: str | None = None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct token ids."""

    @abstractmethod
    def min_length(self) -> int:
        """The shortest sequence length the task can fill."""

    @property
    def variable_length(self) -> bool:
        """Whether the rows of a batch have different lengths (padded, with a ``key_mask``;
        :meth:`batch`'s ``batch_size * length`` is then a token budget)."""
        return False

    #: The constructor arguments :meth:`config` records, read from the attributes of the
    #: same names (tuples as lists).
    config_fields: ClassVar[tuple[str, ...]] = ()

    def config(self) -> dict[str, Any]:
        """JSON-able parameters; ``task_from_config(task.config())`` rebuilds the task."""
        values = {k: getattr(self, k) for k in self.config_fields}
        return {"name": self.name, **{k: list(v) if isinstance(v, tuple) else v
                                      for k, v in values.items()}}

    @abstractmethod
    def _example(
        self, rng: random.Random, length: int, split: str
    ) -> tuple[list[int], list[int], list[bool], dict[str, list[int]]]:
        """One example: ids, targets, mask and meta lists of ``length`` items."""

    def batch(self, *, seed: int, step: int, batch_size: int, length: int, split: str) -> Batch:
        """The batch of ``batch_size`` examples for ``(seed, split, step, length)``.

        Args:
            seed: the run's seed.
            step: the step (training) or batch index (evaluation).
            batch_size: B, the number of examples (the global batch in distributed runs).
            length: L, the sequence length.
            split: ``"train"`` or ``"eval"``.

        Returns:
            A :class:`Batch` of (B, L) tensors.

        Raises:
            ValueError: on an unknown split or a length below :meth:`min_length`.
        """
        self._check_request(batch_size=batch_size, length=length, split=split)
        rng = random.Random(_stream_seed(self.name, seed, split, step, length))
        rows = [self._example(rng, length, split) for _ in range(batch_size)]
        ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
        targets = torch.tensor([r[1] for r in rows], dtype=torch.long)
        mask = torch.tensor([r[2] for r in rows], dtype=torch.bool)
        keys = rows[0][3].keys()
        meta = {k: torch.tensor([r[3][k] for r in rows], dtype=torch.long) for k in keys}
        return Batch(ids, targets, mask, meta)

    def _check_request(self, *, batch_size: int, length: int, split: str) -> None:
        """Refuse an unknown split, a batch size below 1 or a length below
        :meth:`min_length`."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        _check_int(batch_size, "batch_size", 1)
        _check_int(length, "length", 1)
        if length < self.min_length():
            raise ValueError(
                f"task {self.name!r} needs sequences of length >= {self.min_length()}, got {length}"
            )
