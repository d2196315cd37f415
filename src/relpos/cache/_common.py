"""What the caches share: capacity checks, versions, batch indices and the rollback of a step
that fails part-way (see :mod:`relpos.cache`)."""

from __future__ import annotations

import contextlib
import itertools
import numbers
from collections.abc import Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import Tensor

__all__: list[str] = []

_DEFAULT_CAPACITY = 64
# Versions are unique across caches: equal versions mean the same cache in the same state.
_VERSIONS = itertools.count()


def _check_capacity(capacity: object, growable: object) -> tuple[int | None, bool]:
    if not isinstance(growable, bool):
        raise TypeError(f"growable must be a bool, got {growable!r}")
    if capacity is None:
        return None, growable
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
        raise TypeError(f"capacity must be a positive int or None, got {capacity!r}")
    if int(capacity) <= 0:
        raise ValueError(f"capacity must be a positive int or None, got {capacity}")
    return int(capacity), growable


_Layer = TypeVar("_Layer")


class _LayerStack(Generic[_Layer]):
    """What :class:`~relpos.cache.KVCache` and :class:`~relpos.cache.PackedKVCache` share: one
    cache per attention layer in ``layers``, read by layer (``cache[i]``, ``len``, ``iter``)."""

    layers: list[_Layer]

    def __len__(self) -> int:
        """Number of layers (not the cached length)."""
        return len(self.layers)

    def __getitem__(self, layer: int) -> _Layer:
        return self.layers[layer]

    def __iter__(self) -> Iterator[_Layer]:
        return iter(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)


class _Transactional(Protocol):
    def _mark(self) -> Any: ...
    def _rollback(self, mark: Any) -> None: ...


@contextlib.contextmanager
def _rollback_on_error(caches: Sequence[_Transactional]) -> Iterator[None]:
    """Restore every cache to its state on entry if the ``with`` block raises, then re-raise."""
    marks = [cache._mark() for cache in caches]
    try:
        yield
    except Exception:
        for cache, mark in zip(caches, marks, strict=True):
            cache._rollback(mark)
        raise


def _check_indices(batch_indices: object, batch_size: int, device: torch.device) -> Tensor:
    """Validate beam-search indices: a 1-D integer sequence/tensor with values in [0, B)."""
    if isinstance(batch_indices, Tensor):
        idx = batch_indices
    elif isinstance(batch_indices, Sequence) and all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in batch_indices
    ):
        idx = torch.tensor(list(batch_indices), dtype=torch.long)
    else:
        raise TypeError(
            f"batch_indices must be a 1-D integer tensor or a sequence of ints, "
            f"got {type(batch_indices).__name__}"
        )
    if idx.dtype in (torch.bool,) or idx.is_floating_point() or idx.is_complex():
        raise TypeError(f"batch_indices must have an integer dtype, got {idx.dtype}")
    if idx.dim() != 1 or idx.numel() == 0:
        raise ValueError(
            f"batch_indices must be a non-empty 1-D tensor, got shape {tuple(idx.shape)}"
        )
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= batch_size:
        bad = lo if lo < 0 else hi
        raise IndexError(
            f"batch_indices contains {bad}, allowed: 0 <= index < batch size {batch_size}"
        )
    return idx.to(device=device, dtype=torch.long)
