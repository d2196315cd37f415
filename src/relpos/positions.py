"""Clipped relative positions.

Shape legend used throughout relpos: B batch, H heads, L queries, S keys, D head dim,
Dv value head dim, E model dim, K clip distance (``max_distance``), R = 2K + 1 table rows
(``left + right + 1`` for a window).

Convention (one, everywhere): the offset of key ``j`` seen from query ``i`` is ``j - p_i``
(key minus query; negative = the key is before the query), clipped to ``[-K, K]`` and
shifted by ``K`` to index a table of ``2K + 1`` rows (row 0 = "far backward", row ``K`` =
"same position", row ``2K`` = "far forward"). With fewer queries than keys the queries are
aligned to the END of the keys, ``p_i = i + (S - L)`` ("bottom-right", as tensor2tensor and
FlashAttention). For L = 3 queries over S = 5 keys and K = 1 the index matrix is::

            key j:  0  1  2  3  4
    query 0 (p=2)   0  0  1  2  2
    query 1 (p=3)   0  0  0  1  2
    query 2 (p=4)   0  0  0  0  1

A window ``max_distance=(left, right)`` clips to ``[-left, +right]`` instead (w2v-BERT 2.0 and
SeamlessM4T use ``(64, 8)``): the table has ``left + right + 1`` rows and row ``r + left`` holds
offset ``r``; ``K`` is the same as ``(K, K)``.
"""

from __future__ import annotations

import operator

import torch

_MAX_ROW = 2**63 - 1  # the largest torch.long

__all__ = [
    "check_int",
    "check_max_distance",
    "check_window",
    "clip_relative_position",
    "relative_position_index",
    "resolve_query_start",
]


def check_int(value: object, name: str, allowed: str = "an int") -> int:
    """``value`` as a Python ``int`` if it is integer-like, as PyTorch and NumPy take one:
    anything with ``__index__`` (``int``, NumPy's integer scalars, an integer tensor of one
    element), but not a bool (nor a NumPy or tensor bool) and not a float. A ``torch.SymInt``
    (a size under ``torch.compile`` or ``torch.export``) is returned as it is: converting it
    would specialize the graph to one length. The one check of every int argument of relpos.

    Raises:
        TypeError: naming ``name``, what was received and what is ``allowed``.

    Example:
        >>> import numpy as np
        >>> check_int(np.int64(240), "max_seqlen_q")
        240
    """
    if isinstance(value, torch.SymInt):
        return value  # type: ignore[return-value]
    if isinstance(value, int) and not isinstance(value, bool):
        # (Under torch.compile a symbolic size is an int here: __index__ would specialize it.)
        return value
    boolean = isinstance(value, bool) or type(value).__name__ in ("bool", "bool_") or (
        isinstance(value, torch.Tensor) and value.dtype == torch.bool)
    if not boolean:
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise TypeError(f"{name} must be {allowed}, got {value!r} of type {type(value).__name__}")


def check_max_distance(max_distance: object, name: str = "max_distance") -> int:
    """Return ``max_distance`` as an ``int`` after checking it is a non-negative integer.

    Raises:
        TypeError: if it is a bool or not an integer.
        ValueError: if it is negative.
    """
    value = check_int(max_distance, name, "a non-negative int (the clip distance K)")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int (the clip distance K), got {value}")
    return value


def check_window(max_distance: object, name: str = "max_distance") -> tuple[int, int]:
    """``(left, right)`` of a clip distance ``K`` (``(K, K)``) or a window ``(left, right)``.

    Raises:
        TypeError: if it is not a non-negative int or a pair of them.
        ValueError: if a bound is negative.
    """
    if isinstance(max_distance, (tuple, list)):
        if len(max_distance) != 2:
            raise ValueError(
                f"{name} must be an int K or a pair (left, right), got {len(max_distance)} "
                f"values: {tuple(max_distance)!r}"
            )
        return (check_max_distance(max_distance[0], f"{name}[0] (left)"),
                check_max_distance(max_distance[1], f"{name}[1] (right)"))
    check_int(max_distance, name, "a non-negative int K or a pair (left, right) of them")
    k = check_max_distance(max_distance, name)
    return k, k


def clip_relative_position(j: int, i: int, max_distance: int | tuple[int, int]) -> int:
    """Clipped relative position of key ``j`` seen from query ``i``: ``clip(j - i, -K, K)``,
    or ``clip(j - i, -left, right)`` for a window.

    Args:
        j: key/value position.
        i: query position.
        max_distance: the clip distance K (>= 0), or a window ``(left, right)``.

    Returns:
        The clipped offset, in ``[-left, right]``.

    Example:
        >>> [clip_relative_position(j, 5, 4) for j in range(10)]
        [-4, -4, -3, -2, -1, 0, 1, 2, 3, 4]
    """
    left, right = check_window(max_distance)
    rel = check_int(j, "j", "an int position") - check_int(i, "i", "an int position")
    return max(-left, min(right, rel))


def resolve_query_start(query_len: int, key_len: int, query_start: int | None) -> int:
    """Position of the first query: ``query_start`` or, by default, ``key_len - query_len``.

    Raises:
        ValueError: if a query would lie outside the keys
            (allowed: ``0 <= query_start <= key_len - query_len``).
    """
    if query_start is None:
        if query_len > key_len:
            raise ValueError(
                f"cannot align {query_len} queries to the end of {key_len} keys: relative "
                f"positions need query_len <= key_len (got L={query_len}, S={key_len})"
            )
        return key_len - query_len
    start = check_int(query_start, "query_start", "an int or None")
    if start < 0 or start + query_len > key_len:
        raise ValueError(
            f"query_start={start} puts queries at positions {start}..{start + query_len - 1}, "
            f"outside the {key_len} keys; allowed: 0 <= query_start <= {key_len - query_len} "
            f"(S - L with L={query_len}, S={key_len})"
        )
    return start


def relative_position_index(
    query_len: int,
    key_len: int,
    max_distance: int | tuple[int, int],
    *,
    query_start: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Table row index of every (query, key) pair: ``clip(j - p_i, -K, K) + K``, or
    ``clip(j - p_i, -left, right) + left`` for a window.

    Args:
        query_len: L, the number of queries.
        key_len: S, the number of keys.
        max_distance: K, the clip distance (>= 0), or a window ``(left, right)``.
        query_start: position of query 0; default ``S - L`` (queries aligned to the end of
            the keys).
        device: where to build the index.

    Returns:
        A ``torch.long`` tensor of shape ``(L, S)`` with values in ``[0, left + right]``.

    Example:
        >>> relative_position_index(3, 5, 1)
        tensor([[0, 0, 1, 2, 2],
                [0, 0, 0, 1, 2],
                [0, 0, 0, 0, 1]])
        >>> relative_position_index(2, 4, (2, 0))  # offsets clipped to [-2, 0]
        tensor([[0, 1, 2, 2],
                [0, 0, 1, 2]])
    """
    left, right = check_window(max_distance)
    if left + right > _MAX_ROW:
        raise ValueError(
            f"max_distance={max_distance!r} has table rows up to left + right = {left + right}, "
            f"more than a torch.long index holds; allowed: left + right <= {_MAX_ROW}"
        )
    L = check_int(query_len, "query_len", "a non-negative int")
    S = check_int(key_len, "key_len", "a non-negative int")
    for name, v in (("query_len", L), ("key_len", S)):
        if v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    start = resolve_query_start(L, S, query_start)
    pos_q = torch.arange(start, start + L, device=device)  # (L,)
    pos_k = torch.arange(S, device=device)  # (S,)
    return (pos_k[None, :] - pos_q[:, None]).clamp(-left, right) + left  # (L, S)
