"""Packed batches of sequences of different lengths: :class:`PackedLayerCache` and
:class:`PackedKVCache` (see :mod:`relpos.cache`)."""

from __future__ import annotations

import contextlib
import itertools
import numbers
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from relpos.cache._common import (
    _DEFAULT_CAPACITY,
    _check_capacity,
    _LayerStack,
    _rollback_on_error,
)

__all__ = ["PackedKVCache", "PackedLayerCache"]


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


class PackedKVCache(_LayerStack[PackedLayerCache]):
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
