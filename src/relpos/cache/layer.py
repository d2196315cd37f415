"""One attention layer's keys and values, padded batch: :class:`LayerCache` (see
:mod:`relpos.cache`)."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from relpos.cache._common import (
    _DEFAULT_CAPACITY,
    _VERSIONS,
    _check_capacity,
    _check_indices,
    _rollback_on_error,
)

__all__ = ["LayerCache"]


class LayerCache:
    """Keys and values of one attention layer, ``(B, H, S, D)`` and ``(B, H, S, Dv)``.

    The batch size, heads, head dims, dtype and device are fixed by the first
    :meth:`append` (or by :meth:`reorder`, for the batch size) and checked on every later one.
    Every method validates its input completely before changing anything: a refused call
    leaves the cache as it was.

    Args:
        capacity: positions to preallocate; None = a small default that grows.
        growable: double the storage when an append does not fit (True), or refuse it
            with a ValueError (False; then ``capacity`` is the maximum length).
    """

    def __init__(self, *, capacity: int | None = None, growable: bool = True) -> None:
        cap, grow = _check_capacity(capacity, growable)
        if cap is None and not grow:
            raise ValueError("a fixed-size cache (growable=False) needs a capacity, got None")
        self._initial_capacity = cap
        self.growable = grow
        self._keys: Tensor | None = None  # (B, H, capacity, D)
        self._values: Tensor | None = None  # (B, H, capacity, Dv)
        self._key_mask: Tensor | None = None  # (B, capacity) bool, True = real token
        self._length = 0
        self._version = next(_VERSIONS)

    # ------------------------------------------------------------------ properties
    @property
    def length(self) -> int:
        """Number of cached positions ``S``."""
        return self._length

    def __len__(self) -> int:
        return self._length

    @property
    def version(self) -> int:
        """A number that every change of the cache renews (append, step, growth, truncate,
        reorder, reset), unique across caches: what an object holding storage derived from
        the cache (:class:`relpos.models.decoding.StepDecoder`) compares to know it is still
        in sync."""
        return self._version

    @property
    def capacity(self) -> int:
        """Positions the storage holds now (0 before the first append)."""
        return 0 if self._keys is None else int(self._keys.shape[2])

    @property
    def max_length(self) -> int | None:
        """Largest length the cache accepts: ``capacity`` if fixed, None if growable."""
        return None if self.growable else self._initial_capacity

    @property
    def batch_size(self) -> int | None:
        """B, or None before the first append."""
        return None if self._keys is None else int(self._keys.shape[0])

    @property
    def keys(self) -> Tensor | None:
        """Cached keys ``(B, H, S, D)`` (a view of the storage), or None if never filled."""
        return None if self._keys is None else self._keys[:, :, : self._length]

    @property
    def values(self) -> Tensor | None:
        """Cached values ``(B, H, S, Dv)`` (a view of the storage), or None if never filled."""
        return None if self._values is None else self._values[:, :, : self._length]

    @property
    def key_mask(self) -> Tensor | None:
        """``(B, S)`` bool (True = real token), or None when every cached key is real."""
        return None if self._key_mask is None else self._key_mask[:, : self._length]

    def nbytes(self) -> int:
        """Bytes held by the storage (keys, values and key mask)."""
        return sum(
            t.numel() * t.element_size()
            for t in (self._keys, self._values, self._key_mask)
            if t is not None
        )

    # ------------------------------------------------------------------ mutation
    def check_append(self, key: Tensor, value: Tensor, key_mask: Tensor | None = None) -> None:
        """Raise (TypeError, ValueError) if :meth:`append` would refuse these tensors."""
        for name, x in (("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 4:
                raise ValueError(f"{name} must be 4-D (B, H, t, D), got shape {tuple(x.shape)}")
            if not x.is_floating_point():
                raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
        if key.shape[:3] != value.shape[:3]:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} disagree on (B, H, t)"
            )
        if key.dtype != value.dtype or key.device != value.device:
            raise TypeError(
                f"key and value must share dtype and device, got {key.dtype} on {key.device} "
                f"and {value.dtype} on {value.device}"
            )
        B, H, t, D = key.shape
        if t < 1:
            raise ValueError(
                f"an append needs t >= 1 new positions, got key shape {tuple(key.shape)}"
            )
        if self._keys is not None:
            assert self._values is not None
            cached = (self._keys.shape[0], self._keys.shape[1], self._keys.shape[3],
                      self._values.shape[3])
            got = (B, H, D, value.shape[3])
            for what, want, have in zip(("batch size", "heads", "key head dim",
                                         "value head dim"), cached, got, strict=True):
                if want != have:
                    raise ValueError(
                        f"{what} mismatch: the cache holds {want}, the appended tensors have "
                        f"{have} (key {tuple(key.shape)}, value {tuple(value.shape)})"
                    )
            if key.dtype != self._keys.dtype:
                raise TypeError(
                    f"dtype mismatch: the cache holds {self._keys.dtype}, got {key.dtype}"
                )
            if key.device != self._keys.device:
                raise ValueError(
                    f"device mismatch: the cache is on {self._keys.device}, got {key.device}"
                )
        if key_mask is not None:
            if not isinstance(key_mask, Tensor):
                raise TypeError(f"key_mask must be a torch.Tensor, got {type(key_mask).__name__}")
            if key_mask.dtype != torch.bool:
                raise TypeError(f"key_mask must be bool (True = real token), got {key_mask.dtype}")
            if tuple(key_mask.shape) != (B, t):
                raise ValueError(
                    f"key_mask of an append must have shape (B, t) = {(B, t)}, "
                    f"got {tuple(key_mask.shape)}"
                )
            if key_mask.device != key.device:
                raise ValueError(f"key_mask is on {key_mask.device}, but key is on {key.device}")
        self.check_room(t)

    def check_room(self, t: int) -> None:
        """Raise ValueError if ``t`` more positions do not fit a fixed-size cache."""
        limit = self.max_length
        if limit is not None and self._length + t > limit:
            raise ValueError(
                f"cannot append {t} positions to a cache of length {self._length}: a fixed "
                f"capacity of {limit} allows at most {limit - self._length} more "
                f"(use growable=True or a larger capacity)"
            )

    def append(
        self, key: Tensor, value: Tensor, key_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Append ``t`` positions and return everything cached.

        Args:
            key: ``(B, H, t, D)`` new keys.
            value: ``(B, H, t, Dv)`` new values.
            key_mask: ``(B, t)`` bool, True = real token (e.g. False for left padding of
                batched prompts); None = all real.

        Returns:
            ``(keys, values, key_mask)``: ``(B, H, S, D)``, ``(B, H, S, Dv)`` views of the
            storage with ``S = length`` after the append, and the ``(B, S)`` key mask or None
            if every cached position is real.

        Raises:
            TypeError, ValueError: on a shape/dtype/device mismatch or when a fixed-size cache
                is full; the cache is unchanged.
        """
        self.check_append(key, value, key_mask)
        B, H, t, D = key.shape
        needed = self._length + t
        if self._keys is None:
            cap = self._initial_capacity or _DEFAULT_CAPACITY
            while cap < needed:
                cap *= 2
            self._keys = key.new_empty(B, H, cap, D)
            self._values = value.new_empty(B, H, cap, value.shape[3])
        elif needed > self.capacity:
            cap = self.capacity
            while cap < needed:
                cap *= 2
            self._resize(cap)
        assert self._keys is not None and self._values is not None
        if key_mask is not None and self._key_mask is None:
            self._key_mask = torch.ones(B, self.capacity, dtype=torch.bool, device=key.device)
        self._keys[:, :, self._length : needed] = key.detach()
        self._values[:, :, self._length : needed] = value.detach()
        if self._key_mask is not None:
            self._key_mask[:, self._length : needed] = True if key_mask is None else key_mask
        self._length = needed
        self._version = next(_VERSIONS)
        return self.keys, self.values, self.key_mask  # type: ignore[return-value]

    def reserve_step(self, batch_size: int, heads: int, head_dim: int) -> tuple[
        Tensor, Tensor, Tensor | None
    ]:
        """Room for one more position, written in place by a decode step.

        Returns views ``(keys, values, key_mask)`` of the storage covering ``S = length + 1``
        positions (``key_mask`` None when every position is real); the caller writes
        position ``length`` of ``keys`` and ``values`` and then calls :meth:`advance`.
        Used by :class:`relpos.models.decoding.StepDecoder`.

        Raises:
            ValueError: if the cache is empty, holds another batch size or head shape, or is
                full and fixed-size.
        """
        if self._keys is None or self._values is None:
            raise ValueError("reserve_step needs a filled cache (prefill the prompt first)")
        B, H, _, D = self._keys.shape
        if (batch_size, heads, head_dim) != (B, H, D):
            raise ValueError(
                f"the cache holds (B, H, D) = {(B, H, D)}, the step has "
                f"{(batch_size, heads, head_dim)}"
            )
        self.check_room(1)
        if self._length + 1 > self.capacity:
            cap = self.capacity
            self._resize(cap * 2)
        S = self._length + 1
        self._version = next(_VERSIONS)
        mask = None
        if self._key_mask is not None:
            self._key_mask[:, self._length] = True
            mask = self._key_mask[:, :S]
        return self._keys[:, :, :S], self._values[:, :, :S], mask

    def advance(self, t: int) -> None:
        """Count ``t`` positions written in place after :meth:`reserve_step`."""
        if not 0 < self._length + t <= self.capacity:
            raise ValueError(
                f"cannot advance by {t}: length {self._length}, capacity {self.capacity}"
            )
        self._length += t
        self._version = next(_VERSIONS)

    def _resize(self, capacity: int) -> None:
        assert self._keys is not None and self._values is not None
        keys = self._keys.new_empty(*self._keys.shape[:2], capacity, self._keys.shape[3])
        values = self._values.new_empty(*self._values.shape[:2], capacity, self._values.shape[3])
        self._version = next(_VERSIONS)
        keys[:, :, : self._length] = self._keys[:, :, : self._length]
        values[:, :, : self._length] = self._values[:, :, : self._length]
        self._keys, self._values = keys, values
        if self._key_mask is not None:
            mask = torch.ones(
                self._key_mask.shape[0], capacity, dtype=torch.bool, device=keys.device
            )
            mask[:, : self._length] = self._key_mask[:, : self._length]
            self._key_mask = mask

    def reset(self) -> None:
        """Forget every cached position and the shapes; keeps capacity settings."""
        self._keys = self._values = self._key_mask = None
        self._length = 0
        self._version = next(_VERSIONS)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (e.g. reject speculative tokens).

        Raises:
            TypeError, ValueError: if ``length`` is not an int in ``[0, self.length]``.
        """
        if isinstance(length, bool) or not isinstance(length, numbers.Integral):
            raise TypeError(f"length must be an int, got {length!r}")
        if not 0 <= int(length) <= self._length:
            raise ValueError(
                f"cannot truncate to length {length}: allowed 0 <= length <= {self._length}"
            )
        self._length = int(length)
        self._version = next(_VERSIONS)

    @contextlib.contextmanager
    def rollback_on_error(self) -> Iterator[LayerCache]:
        """Undo whatever the ``with`` block appended if it raises, then re-raise.

        A step that appends and then fails (e.g. attention refuses a mask) leaves the cache as
        it was: a cache that was empty forgets the shapes the append fixed, a filled one is
        truncated back to its length.

        Example:
            >>> cache = LayerCache()
            >>> try:
            ...     with cache.rollback_on_error():
            ...         _ = cache.append(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
            ...         raise RuntimeError("refused")
            ... except RuntimeError:
            ...     pass
            >>> cache.length, cache.keys is None
            (0, True)
        """
        with _rollback_on_error([self]):
            yield self

    def _mark(self) -> tuple[bool, int]:
        """What :meth:`_rollback` restores: (never filled, length)."""
        return self._keys is None, self._length

    def _rollback(self, mark: tuple[bool, int]) -> None:
        was_empty, length = mark
        if was_empty:
            self.reset()
        elif self._length > length:
            self.truncate(length)

    def reorder(self, batch_indices: Tensor | Sequence[int]) -> None:
        """Select batch rows, e.g. surviving beams: row ``b`` becomes old row ``batch_indices[b]``.

        The new batch size is ``len(batch_indices)`` (rows may repeat, e.g. to expand one
        prompt into several beams).

        Raises:
            TypeError, ValueError: if ``batch_indices`` is not a 1-D integer sequence/tensor.
            IndexError: if an index is outside ``[0, B)``.
        """
        if self._keys is None:
            raise ValueError("cannot reorder an empty cache (nothing has been appended)")
        idx = _check_indices(batch_indices, self._keys.shape[0], self._keys.device)
        self._apply_indices(idx)

    def _apply_indices(self, idx: Tensor) -> None:
        assert self._keys is not None and self._values is not None
        self._version = next(_VERSIONS)
        self._keys = self._keys.index_select(0, idx)
        self._values = self._values.index_select(0, idx)
        if self._key_mask is not None:
            self._key_mask = self._key_mask.index_select(0, idx)

    def __repr__(self) -> str:
        shape = None if self._keys is None else tuple(self._keys.shape)
        return (
            f"LayerCache(length={self._length}, capacity={self.capacity}, "
            f"growable={self.growable}, storage={shape})"
        )
