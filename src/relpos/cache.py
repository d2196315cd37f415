"""Key/value cache for incremental decoding with relative attention.

Shape legend: B batch, H heads, t new tokens in one step, S cached keys (after the step),
D key head dim, Dv value head dim.

A step appends ``t >= 1`` new keys/values (one token, a prefill chunk or a speculative
block) and attends with the ``t`` new queries over all ``S = c + t`` keys, ``c`` being the
cache length before the step. Queries are aligned to the END of the keys (bottom-right,
the default of :func:`relpos.relative_attention`): query ``i`` of the step is at position
``c + i``. Decoding token by token, in chunks of any sizes or in one causal pass gives the
same outputs.

A :class:`KVCache` holds one :class:`LayerCache` per layer. Storage is preallocated
(``capacity``) and, if ``growable``, doubles when full, so memory stays at most twice the
cached length (linear in the length).

Example:
    >>> cache = KVCache(num_layers=1, capacity=8)
    >>> k = v = torch.randn(2, 4, 3, 16)          # (B, H, t, D)
    >>> keys, values, key_mask = cache[0].append(k, v)
    >>> keys.shape, cache.length
    (torch.Size([2, 4, 3, 16]), 3)
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["KVCache", "LayerCache", "PackedKVCache", "PackedLayerCache"]

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


class KVCache:
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

    def __len__(self) -> int:
        """Number of layers (the cached length is :attr:`length`)."""
        return len(self.layers)

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]

    def __iter__(self) -> Iterator[LayerCache]:
        return iter(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

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


class PackedLayerCache:
    """Keys and values of one attention layer for ``N`` sequences of different lengths,
    without padding.

    Storage is one key and one value buffer per layer, head-major ``(H, N * capacity, D)``
    (the layout the native kernels read without a copy), with a region of ``capacity`` rows
    for each sequence. Each sequence remembers its own filled length. A
    packed step appends ``t_s >= 0`` tokens to sequence ``s`` and attends over exactly its
    ``c_s + t_s`` filled rows. Those rows are handed to
    :func:`relpos.relative_attention_varlen` as ``cu_seqlens_k`` (the regions) plus
    ``seqused_k`` (the filled lengths): nothing is copied per step, and no padding is read
    or computed. When a sequence outgrows its region and the cache is ``growable``, every
    region doubles.

    Args:
        num_sequences: N.
        capacity: rows per sequence to preallocate; None = a small default that grows.
        growable: double the regions when an append does not fit (True), or refuse it with a
            ValueError (False).
    """

    def __init__(self, num_sequences: int, *, capacity: int | None = None,
                 growable: bool = True) -> None:
        if isinstance(num_sequences, bool) or not isinstance(num_sequences, numbers.Integral) \
                or num_sequences < 1:
            raise ValueError(f"num_sequences must be an int >= 1, got {num_sequences!r}")
        cap, grow = _check_capacity(capacity, growable)
        if cap is None and not grow:
            raise ValueError("a fixed-size cache (growable=False) needs a capacity, got None")
        self.num_sequences: int = int(num_sequences)
        self.growable: bool = grow
        self._capacity: int = cap or _DEFAULT_CAPACITY
        self._keys: Tensor | None = None  # (H, N * capacity, D)
        self._values: Tensor | None = None  # (H, N * capacity, Dv)
        self._lengths: list[int] = [0] * self.num_sequences

    @property
    def lengths(self) -> tuple[int, ...]:
        """The filled length of every sequence."""
        return tuple(self._lengths)

    @property
    def capacity(self) -> int:
        """Rows per sequence (its region)."""
        return self._capacity

    @property
    def storage(self) -> tuple[Tensor, Tensor] | None:
        """The key and value storage as ``(H, N, capacity, D)`` and ``(H, N, capacity, Dv)``
        views (sequence ``s`` fills ``[:, s, :lengths[s]]``), or None before the first append."""
        if self._keys is None or self._values is None:
            return None
        N, C = self.num_sequences, self._capacity
        return (self._keys.unflatten(1, (N, C)), self._values.unflatten(1, (N, C)))

    def _step_lengths(self, key: Tensor, value: Tensor, cu_seqlens: Tensor) -> list[int]:
        """The new tokens per sequence of a valid append (checked before anything changes)."""
        for name, x in (("key", key), ("value", value), ("cu_seqlens", cu_seqlens)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if name != "cu_seqlens" and not x.is_floating_point():
                raise TypeError(f"{name} must be a floating point tensor, got dtype {x.dtype}")
        if key.dtype != value.dtype or key.device != value.device:
            raise TypeError(f"key and value must share dtype and device, got {key.dtype} on "
                            f"{key.device} and {value.dtype} on {value.device}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be int32 or int64 (cumulative sequence lengths), "
                            f"got dtype {cu_seqlens.dtype}")
        if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2]:
            raise ValueError(f"a packed append takes key (T, H, D) and value (T, H, Dv), got "
                             f"{tuple(key.shape)} and {tuple(value.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] != self.num_sequences + 1:
            raise ValueError(f"cu_seqlens must be ({self.num_sequences + 1},), one entry per "
                             f"cached sequence and a leading 0, got {tuple(cu_seqlens.shape)}")
        bounds = cu_seqlens.tolist()
        new = [b - a for a, b in itertools.pairwise(bounds)]
        if bounds[0] != 0 or min(new) < 0 or bounds[-1] != key.shape[0]:
            raise ValueError(f"cu_seqlens must start at 0, not decrease and end at "
                             f"{key.shape[0]} (the new tokens), got {bounds}")
        if self._keys is not None:
            if key.dtype != self._keys.dtype:
                raise TypeError(f"dtype mismatch: the cache holds {self._keys.dtype}, got "
                                f"{key.dtype}")
            held = (self._keys.transpose(0, 1).shape[1:],
                    self._values.transpose(0, 1).shape[1:],  # type: ignore[union-attr]
                    self._keys.device)
            given = (key.shape[1:], value.shape[1:], key.device)
            if held != given:
                raise ValueError(f"the cache holds (H, D), (H, Dv), device = {held}; "
                                 f"the append has {given}")
        self.check_room(new)
        return new

    def check_room(self, new: Sequence[int]) -> None:
        """Raise ValueError if ``new[s]`` more tokens for each sequence ``s`` do not fit a
        fixed-size cache."""
        need = max(c + t for c, t in zip(self._lengths, new, strict=True))
        if need > self._capacity and not self.growable:
            raise ValueError(f"the fixed-size cache holds {self._capacity} positions per "
                             f"sequence; this step needs {need}")

    @contextlib.contextmanager
    def rollback_on_error(self) -> Iterator[PackedLayerCache]:
        """Undo whatever the ``with`` block appended if it raises, then re-raise (as
        :meth:`LayerCache.rollback_on_error`: a cache that was empty forgets the shapes and
        dtype the append fixed, a filled one keeps its regions and its earlier lengths)."""
        with _rollback_on_error([self]):
            yield self

    def _mark(self) -> tuple[bool, tuple[int, ...], int]:
        return self._keys is None, tuple(self._lengths), self._capacity

    def _rollback(self, mark: tuple[bool, tuple[int, ...], int]) -> None:
        was_empty, lengths, capacity = mark
        if was_empty:
            self._keys = self._values = None
            self._capacity = capacity
        self._lengths = list(lengths)

    def append(self, key: Tensor, value: Tensor, cu_seqlens: Tensor
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Append each sequence's new keys and values and return what attention reads.

        Args:
            key: ``(T, H, D)``: the new keys of every sequence, end to end.
            value: ``(T, H, Dv)``.
            cu_seqlens: ``(N + 1,)``: where each sequence's new tokens are in ``key``
                (a sequence may have none this step).

        Returns:
            ``(keys, values, cu_seqlens_k, seqused_k)``: the storage as ``(N * capacity, H,
            D)`` and ``(N * capacity, H, Dv)`` views (of head-major memory), the regions
            ``(N + 1,)`` and the filled lengths ``(N,)`` after the append (int64), as
            :func:`relpos.relative_attention_varlen` takes them.

        Raises:
            TypeError: on a dtype that is not floating point (key, value), differs between
                them or from the cache's, or is not int32/int64 (cu_seqlens); the cache is
                unchanged.
            ValueError: on a mismatched shape or device, or when a fixed-size cache is
                full; the cache is unchanged.
        """
        new = self._step_lengths(key, value, cu_seqlens)
        N = self.num_sequences
        need = max(c + t for c, t in zip(self._lengths, new, strict=True))
        if self._keys is None:
            while self._capacity < need:
                self._capacity *= 2
            self._keys = key.new_empty(key.shape[1], N * self._capacity, key.shape[2])
            self._values = value.new_empty(value.shape[1], N * self._capacity, value.shape[2])
        elif need > self._capacity:
            self._grow(need)
        assert self._keys is not None and self._values is not None
        starts = torch.tensor([s * self._capacity + c for s, c in enumerate(self._lengths)])
        counts = torch.tensor(new)
        offsets = torch.arange(key.shape[0]) - torch.repeat_interleave(
            cu_seqlens[:-1].to("cpu", torch.int64), counts)
        rows = (torch.repeat_interleave(starts, counts) + offsets).to(key.device)
        self._keys.index_copy_(1, rows, key.detach().transpose(0, 1))
        self._values.index_copy_(1, rows, value.detach().transpose(0, 1))
        self._lengths = [c + t for c, t in zip(self._lengths, new, strict=True)]
        regions = torch.arange(N + 1, dtype=torch.int64) * self._capacity
        return (self._keys.transpose(0, 1), self._values.transpose(0, 1), regions,
                torch.tensor(self._lengths))

    def _grow(self, need: int) -> None:
        assert self._keys is not None and self._values is not None
        old = self._capacity
        while self._capacity < need:
            self._capacity *= 2
        N = self.num_sequences
        for name in ("_keys", "_values"):
            buf: Tensor = getattr(self, name)  # (H, N * old, D)
            H, _, D = buf.shape
            grown = buf.new_empty(H, N * self._capacity, D)
            grown.view(H, N, self._capacity, D)[:, :, :old] = buf.view(H, N, old, D)
            setattr(self, name, grown)

    def __repr__(self) -> str:
        return (f"PackedLayerCache(num_sequences={self.num_sequences}, "
                f"lengths={list(self._lengths)}, capacity={self._capacity})")


class PackedKVCache:
    """A :class:`PackedLayerCache` per layer: incremental decoding of ``N`` sequences of
    different lengths without padding (prompts of any lengths, steps that append any number
    of tokens to each, sequences that have finished simply append none).

    Example:
        >>> cache = PackedKVCache(num_layers=1, num_sequences=2)
        >>> k = v = torch.randn(5, 4, 16)                  # (T, H, D): 2 + 3 new tokens
        >>> keys, values, regions, used = cache[0].append(k, v, torch.tensor([0, 2, 5]))
        >>> cache.lengths, used.tolist()
        ((2, 3), [2, 3])
    """

    def __init__(self, num_layers: int, num_sequences: int, *, capacity: int | None = None,
                 growable: bool = True) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral) \
                or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        self.layers: list[PackedLayerCache] = [
            PackedLayerCache(num_sequences, capacity=capacity, growable=growable)
            for _ in range(int(num_layers))]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> PackedLayerCache:
        return self.layers[layer]

    def __iter__(self) -> Iterator[PackedLayerCache]:
        return iter(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_sequences(self) -> int:
        return self.layers[0].num_sequences

    @property
    def lengths(self) -> tuple[int, ...]:
        """The filled length of every sequence (the same in every layer between steps)."""
        return self.layers[0].lengths

    def check_step(self, new: Sequence[int]) -> None:
        """Raise ValueError if a step bringing ``new[s]`` tokens to each sequence ``s`` would
        be refused (as :meth:`KVCache.check_step`: before any layer changes its cache)."""
        lengths = sorted({layer.lengths for layer in self.layers})
        if len(lengths) != 1:
            raise ValueError(f"the layers of this cache hold different lengths {lengths}")
        if len(new) != self.num_sequences or min(new, default=0) < 0:
            raise ValueError(f"a step brings t >= 0 new tokens to each of the "
                             f"{self.num_sequences} sequences, got {list(new)}")
        self.layers[0].check_room(new)

    @contextlib.contextmanager
    def rollback_on_error(self) -> Iterator[PackedKVCache]:
        """Undo whatever the ``with`` block appended to any layer if it raises, then re-raise:
        a packed step that fails part-way leaves every layer as it was."""
        with _rollback_on_error(self.layers):
            yield self

    def __repr__(self) -> str:
        return (f"PackedKVCache(num_layers={self.num_layers}, "
                f"num_sequences={self.num_sequences}, lengths={list(self.lengths)})")
