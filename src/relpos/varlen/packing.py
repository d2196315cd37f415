"""Between the padded and the packed form: :func:`pack`, :func:`unpack` and
:func:`cu_seqlens_from_lengths`.

Shape legend: B batch, L padded length, T packed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from relpos.functional import _check_tensor
from relpos.positions import check_int
from relpos.varlen.call import _check_cu_seqlens

__all__ = ["cu_seqlens_from_lengths", "pack", "unpack"]


_MOST = {torch.int32: 2**31 - 1, torch.int64: 2**63 - 1}


def cu_seqlens_from_lengths(lengths: Sequence[int] | Tensor, *,
                            dtype: torch.dtype = torch.int32) -> Tensor:
    """``(N + 1,)`` cumulative lengths: 0, then each sequence's end.

    Args:
        lengths: N non-negative integers (a sequence, or a 1-D integer tensor).
        dtype: ``torch.int32`` (flash-attention's) or ``torch.int64``.

    Raises:
        TypeError: if ``dtype`` is neither.
        ValueError: if ``lengths`` are not N non-negative integers, or their total does not
            fit ``dtype`` (int32 holds 2**31 - 1: pass ``dtype=torch.int64``); never wraps.

    Example:
        >>> cu_seqlens_from_lengths([3, 0, 7])
        tensor([ 0,  3,  3, 10], dtype=torch.int32)
    """
    if dtype not in _MOST:
        raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype!r}")
    try:
        t = torch.as_tensor(lengths)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        t = None
    if t is None or t.dim() != 1 or (t.numel() and (
            t.dtype == torch.bool or t.is_floating_point() or t.is_complex()
            or bool((t < 0).any()))):
        raise ValueError(f"lengths must be N >= 0 non-negative integers, got {lengths!r}")
    # In int64 each step adds less than 2**63 to a non-negative sum, so an overflow shows as a
    # negative end.
    ends = t.to(torch.int64).cumsum(0)
    if ends.numel() and (bool((ends < 0).any()) or int(ends[-1]) > _MOST[dtype]):
        total = sum(int(x) for x in t.tolist())
        hint = "; pass dtype=torch.int64" if dtype == torch.int32 and total <= _MOST[
            torch.int64] else ""
        raise ValueError(f"lengths sum to {total}, more than {dtype} holds "
                         f"({_MOST[dtype]}){hint}")
    return torch.cat([ends.new_zeros(1), ends]).to(dtype)


def _cu_seqlens_of_batch(lengths: Sequence[int] | Tensor, most: int) -> Tensor:
    """:func:`pack`'s ``cu_seqlens``: int32, or int64 where a batch of at most ``most``
    tokens may hold more than int32 does."""
    dtype = torch.int32 if most <= _MOST[torch.int32] else torch.int64
    return cu_seqlens_from_lengths(lengths, dtype=dtype)


def _padding(name: str, mask: object, B: int, L: int, device: torch.device) -> Tensor:
    t = _check_tensor(name, mask)
    if t.dtype != torch.bool:
        raise TypeError(f"{name} must be bool (True = padding, as in torch.nn), got dtype "
                        f"{t.dtype}")
    if tuple(t.shape) != (B, L):
        raise ValueError(f"{name} must have shape (B, L) = {(B, L)}, got {tuple(t.shape)}")
    return t.to(device)


def pack(x: Tensor, key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A padded batch ``x (B, L, ...)`` as a packed one: the real tokens of every row, in
    order, end to end ``(T, ...)``, and ``cu_seqlens (B + 1,)`` int32 (int64 where ``B·L``
    exceeds ``2**31 - 1``, what int32 holds).

    Args:
        x: ``(B, L, ...)``, batch first.
        key_padding_mask: ``(B, L)`` bool, True = padding (torch.nn's meaning); the real
            tokens need not be contiguous (left or right padding, or holes). None: no
            padding.

    Example:
        >>> x = torch.arange(6.).view(2, 3, 1)
        >>> packed, cu = pack(x, torch.tensor([[False, False, True], [False, False, False]]))
        >>> packed.flatten().tolist(), cu.tolist()
        ([0.0, 1.0, 3.0, 4.0, 5.0], [0, 2, 5])
    """
    x = _check_tensor("x", x)
    if x.dim() < 2:
        raise ValueError(f"x must be (B, L, ...), got shape {tuple(x.shape)}")
    B, L = x.shape[:2]
    if key_padding_mask is None:
        return x.reshape(B * L, *x.shape[2:]), _cu_seqlens_of_batch([L] * B, B * L)
    real = ~_padding("key_padding_mask", key_padding_mask, B, L, x.device)
    return x[real], _cu_seqlens_of_batch(real.sum(1).cpu(), B * L)


def unpack(packed: Tensor, cu_seqlens: Tensor, key_padding_mask: Tensor | None = None, *,
           max_seqlen: int | None = None, padding_value: float = 0.0) -> Tensor:
    """The padded batch ``(B, L, ...)`` of a packed one ``(T, ...)``.

    Args:
        packed: ``(T, ...)``, sequences end to end.
        cu_seqlens: ``(B + 1,)``, as :func:`pack` returns it.
        key_padding_mask: the ``(B, L)`` mask given to :func:`pack` (True = padding): the
            tokens go back to where they were. None: each row left-aligned, padded on the
            right to ``max_seqlen`` (default: the longest sequence).
        padding_value: what the padding positions hold.

    Example:
        >>> packed, cu = torch.arange(5.).view(5, 1), torch.tensor([0, 2, 5])
        >>> unpack(packed, cu, padding_value=-1.0).squeeze(-1).tolist()
        [[0.0, 1.0, -1.0], [2.0, 3.0, 4.0]]
    """
    packed = _check_tensor("packed", packed)
    if packed.dim() < 1:
        raise ValueError("packed must be (T, ...), got a 0-D tensor")
    _, lengths = _check_cu_seqlens("cu_seqlens", cu_seqlens, packed.shape[0], tracing=False)
    assert lengths is not None
    B = len(lengths)
    if key_padding_mask is not None:
        L = key_padding_mask.shape[-1] if isinstance(key_padding_mask, Tensor) else 0
        real = ~_padding("key_padding_mask", key_padding_mask, B, L, packed.device)
        counts = real.sum(1).tolist()
        if counts != list(lengths):
            raise ValueError(f"key_padding_mask has {counts} real tokens per row, but "
                             f"cu_seqlens says {list(lengths)}")
        out = packed.new_full((B, L, *packed.shape[1:]), padding_value)
        return out.index_put((real,), packed)
    longest = max(lengths, default=0)
    if max_seqlen is None:
        max_seqlen = longest
    elif check_int(max_seqlen, "max_seqlen", "an int or None") < longest:
        raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest sequence, "
                         f"{longest}")
    max_seqlen = check_int(max_seqlen, "max_seqlen")
    positions = torch.arange(max_seqlen, device=packed.device)
    real = positions < torch.tensor(lengths, device=packed.device).view(B, 1)
    out = packed.new_full((B, max_seqlen, *packed.shape[1:]), padding_value)
    return out.index_put((real,), packed)

