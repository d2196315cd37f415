"""One :class:`~relpos.cache.LayerCache` per layer: :class:`KVCache` (see :mod:`relpos.cache`)."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator, Sequence

from torch import Tensor

from relpos.cache._common import (
    _check_capacity,
    _check_indices,
    _LayerStack,
    _rollback_on_error,
)
from relpos.cache.layer import LayerCache

__all__ = ["KVCache"]


class KVCache(_LayerStack[LayerCache]):
    """One :class:`LayerCache` per layer, indexed by layer: ``cache[i]``.

    Args:
        num_layers: number of attention layers.
        capacity: positions to preallocate per layer; None = small, growing.
        growable: double the storage when full (True) or refuse appends past ``capacity``.

    Example:
        >>> cache = KVCache(num_layers=2, capacity=16, growable=False)
        >>> len(cache), cache.length, cache.capacity
        (2, 0, 0)
    """

    def __init__(
        self, num_layers: int, *, capacity: int | None = None, growable: bool = True
    ) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral):
            raise TypeError(f"num_layers must be a positive int, got {num_layers!r}")
        if int(num_layers) <= 0:
            raise ValueError(f"num_layers must be a positive int, got {num_layers}")
        _check_capacity(capacity, growable)
        self.layers: list[LayerCache] = [
            LayerCache(capacity=capacity, growable=growable) for _ in range(int(num_layers))
        ]

    @property
    def length(self) -> int:
        """Cached positions (the same in every layer between steps)."""
        return self.layers[0].length

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    @property
    def max_length(self) -> int | None:
        return self.layers[0].max_length

    @property
    def batch_size(self) -> int | None:
        return self.layers[0].batch_size

    def nbytes(self) -> int:
        """Bytes held by all layers' storage."""
        return sum(layer.nbytes() for layer in self.layers)

    def advance(self, t: int) -> None:
        """Count ``t`` positions written in place in every layer (see
        :meth:`LayerCache.reserve_step`)."""
        for layer in self.layers:
            layer.advance(t)

    def check_step(self, batch_size: int, t: int) -> None:
        """Raise ValueError if a step of ``t`` tokens for ``batch_size`` rows would be refused.

        Lets a model validate a step before any layer changes its cache.
        """
        lengths = {layer.length for layer in self.layers}
        if len(lengths) != 1:
            raise ValueError(f"the layers of this cache hold different lengths {sorted(lengths)}")
        b = self.batch_size
        if b is not None and b != batch_size:
            raise ValueError(
                f"batch size mismatch: the cache holds {b} rows, the step has {batch_size}"
            )
        self.layers[0].check_room(t)

    def reset(self) -> None:
        """Empty every layer."""
        for layer in self.layers:
            layer.reset()

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions in every layer (see :meth:`LayerCache.truncate`)."""
        for layer in self.layers:  # validate everywhere first: all or nothing
            if isinstance(length, bool) or not isinstance(length, numbers.Integral):
                raise TypeError(f"length must be an int, got {length!r}")
            if not 0 <= int(length) <= layer.length:
                raise ValueError(
                    f"cannot truncate to length {length}: allowed 0 <= length <= {layer.length}"
                )
        for layer in self.layers:
            layer.truncate(length)

    @contextlib.contextmanager
    def rollback_on_error(self) -> Iterator[KVCache]:
        """Undo whatever the ``with`` block appended to any layer if it raises, then re-raise.

        A model step that fails part-way (after some layers appended) leaves every layer as it
        was; see :meth:`LayerCache.rollback_on_error`.
        """
        with _rollback_on_error(self.layers):
            yield self

    def reorder(self, batch_indices: Tensor | Sequence[int]) -> None:
        """Select batch rows in every layer (beam search); see :meth:`LayerCache.reorder`."""
        filled = [layer for layer in self.layers if layer._keys is not None]
        if not filled:
            raise ValueError("cannot reorder an empty cache (nothing has been appended)")
        sizes = {layer._keys.shape[0] for layer in filled}  # type: ignore[union-attr]
        if len(sizes) != 1:
            raise ValueError(f"the layers of this cache hold different batch sizes {sorted(sizes)}")
        device = filled[0]._keys.device  # type: ignore[union-attr]
        idx = _check_indices(batch_indices, sizes.pop(), device)
        for layer in filled:
            layer._apply_indices(idx)

    def __repr__(self) -> str:
        return (
            f"KVCache(num_layers={self.num_layers}, length={self.length}, "
            f"capacity={self.capacity}, growable={self.layers[0].growable})"
        )
