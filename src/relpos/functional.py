"""``relative_attention``: the public function. Validates the call, then runs a backend.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
K clip distance (``max_distance``), R = 2K + 1 table rows.
"""

from __future__ import annotations

import importlib
import math
import numbers
from types import ModuleType
from typing import Any, Literal

import torch
from torch import Tensor

from relpos.ops import BACKENDS
from relpos.positions import check_max_distance, resolve_query_start

__all__ = [
    "Implementation",
    "available_backends",
    "relative_attention",
    "select_backend",
    "why_not_fused",
]

Implementation = Literal["reference", "bucketed", "fused", "decode"]

# Tried in this order when ``implementation=None``; the first that serves the call wins.
_AUTO_ORDER: tuple[str, ...] = ("decode", "fused", "bucketed", "reference")


# Backend modules by name (None = not in this build). Filled once at import so that
# ``torch.compile`` traces a dict lookup, not ``importlib`` (which it cannot trace).
_LOADED: dict[str, ModuleType | None] = {}


def _backend(name: str) -> ModuleType | None:
    if name not in _LOADED:
        try:
            _LOADED[name] = importlib.import_module(f"relpos.ops.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"relpos.ops.{name}":
                raise
            _LOADED[name] = None
    return _LOADED[name]


def _auto_reason(backend: ModuleType, args: dict[str, Any]) -> str | None:
    """Why auto-selection skips ``backend``: its ``auto_reason`` (hard limits and speed) if it
    has one, else its ``unsupported_reason``."""
    check = getattr(backend, "auto_reason", backend.unsupported_reason)
    return check(**args)


def available_backends() -> tuple[str, ...]:
    """Names of the backends installed in this build, in auto-selection order."""
    return tuple(n for n in _AUTO_ORDER if _backend(n) is not None)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype if autocast is on for ``device_type``, else None."""
    if device_type in ("cpu", "cuda", "xpu", "mps") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _to_autocast(t: object, dtype: torch.dtype) -> object:
    # As autocast treats matmuls: float32 tensors run in the autocast dtype (so float32
    # parameters meet half-precision activations); float64 and others are left alone.
    if isinstance(t, Tensor) and t.dtype == torch.float32:
        return t.to(dtype)
    return t


def _call(fn: Any, args: dict[str, Any]) -> Any:
    """Run a backend. Under autocast the inputs were already cast (see ``_validate``); the
    backend then runs as in native half precision (its own float32 statistics), not with
    autocast re-casting its internal float32 accumulators."""
    device_type = args["query"].device.type
    if _autocast_dtype(device_type) is None:
        return fn(**args)
    with torch.autocast(device_type, enabled=False):
        return fn(**args)


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_table(
    name: str, table: object, *, rows: int, dim: int, dim_name: str, heads: int, ref: Tensor
) -> Tensor | None:
    if table is None:
        return None
    t = _check_tensor(name, table)
    given = tuple(t.shape)
    if t.dim() == 2:
        t = t.unsqueeze(0)  # (1, R, D): shared by all heads
    elif t.dim() != 3:
        raise ValueError(
            f"{name} must have shape (2K+1, {dim_name}) shared by all heads or "
            f"(H, 2K+1, {dim_name}) per head, got a {t.dim()}-D tensor of shape {tuple(t.shape)}"
        )
    if t.shape[0] not in (1, heads):
        raise ValueError(
            f"{name} has {t.shape[0]} heads (shape {given}), "
            f"allowed: shared (2-D) or one per head, H={heads}"
        )
    if t.shape[1] != rows:
        raise ValueError(
            f"{name} has {t.shape[1]} rows (shape {given}), "
            f"but max_distance={(rows - 1) // 2} needs 2K+1 = {rows}"
        )
    if t.shape[2] != dim:
        raise ValueError(
            f"{name} has embedding size {t.shape[2]}, but {dim_name} = {dim} "
            f"(shape {given})"
        )
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, but query has dtype {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, but query is on {ref.device}")
    return t


def _validate(
    query: object,
    key: object,
    value: object,
    *,
    max_distance: object,
    rel_keys: object,
    rel_values: object,
    attn_mask: object,
    key_mask: object,
    is_causal: object,
    dropout_p: object,
    scale: object,
    query_start: object,
) -> dict[str, Any]:
    q = _check_tensor("query", query)
    k = _check_tensor("key", key)
    v = _check_tensor("value", value)
    low = _autocast_dtype(q.device.type)
    if low is not None:
        q, k, v = (_to_autocast(t, low) for t in (q, k, v))  # type: ignore[assignment]
        rel_keys, rel_values, attn_mask = (
            _to_autocast(t, low) for t in (rel_keys, rel_values, attn_mask)
        )
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (B, H, {'L' if name == 'query' else 'S'}, D), "
                f"got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating point tensor, got dtype {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    B, H, L, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"batch sizes differ: query {B}, key {k.shape[0]}, value {v.shape[0]} "
            f"(shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)})"
        )
    if k.shape[1] != H or v.shape[1] != H:
        raise ValueError(
            f"head counts differ: query {H}, key {k.shape[1]}, value {v.shape[1]} "
            f"(shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)})"
        )
    if k.shape[3] != D:
        raise ValueError(f"key head dim {k.shape[3]} != query head dim {D}")
    if D == 0:
        raise ValueError(f"query head dim D must be >= 1, got shape {tuple(q.shape)}")
    S = k.shape[2]
    if v.shape[2] != S:
        raise ValueError(f"value has {v.shape[2]} positions but key has {S}")
    Dv = v.shape[3]

    kk = check_max_distance(max_distance)
    rows = 2 * kk + 1
    ak = _check_table("rel_keys", rel_keys, rows=rows, dim=D, dim_name="D", heads=H, ref=q)
    av = _check_table("rel_values", rel_values, rows=rows, dim=Dv, dim_name="Dv", heads=H, ref=q)

    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    if scale is None:
        sc = 1.0 / math.sqrt(D) if D > 0 else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    else:
        sc = float(scale)
        if not math.isfinite(sc):
            raise ValueError(f"scale must be finite, got {sc}")

    mask = None
    if attn_mask is not None:
        mask = _check_tensor("attn_mask", attn_mask)
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(
                f"attn_mask must be bool (True = may attend) or floating point (added to the "
                f"scores), got dtype {mask.dtype}"
            )
        if mask.is_floating_point() and mask.dtype != q.dtype:
            raise TypeError(f"float attn_mask has dtype {mask.dtype}, but query has {q.dtype}")
        if mask.device != q.device:
            raise ValueError(f"attn_mask is on {mask.device}, but query is on {q.device}")
        try:
            if mask.dim() > 4:
                raise RuntimeError
            torch.broadcast_shapes(tuple(mask.shape), (B, H, L, S))
            if torch.broadcast_shapes(tuple(mask.shape), (B, H, L, S)) != (B, H, L, S):
                raise RuntimeError
        except RuntimeError:
            raise ValueError(
                f"attn_mask of shape {tuple(mask.shape)} does not broadcast to "
                f"(B, H, L, S) = {(B, H, L, S)}"
            ) from None
    kmask = None
    if key_mask is not None:
        kmask = _check_tensor("key_mask", key_mask)
        if kmask.dtype != torch.bool:
            raise TypeError(f"key_mask must be bool (True = real token), got dtype {kmask.dtype}")
        if tuple(kmask.shape) != (B, S):
            raise ValueError(
                f"key_mask must have shape (B, S) = {(B, S)}, got {tuple(kmask.shape)}"
            )
        if kmask.device != q.device:
            raise ValueError(f"key_mask is on {kmask.device}, but query is on {q.device}")

    positional = ak is not None or av is not None or is_causal
    if positional:
        start = resolve_query_start(L, S, query_start)  # type: ignore[arg-type]
    elif query_start is None:
        start = 0
    else:  # no relative positions: query_start has no effect, but is still checked
        start = resolve_query_start(L, S, query_start)  # type: ignore[arg-type]
    return dict(
        query=q, key=k, value=v, rel_keys=ak, rel_values=av, max_distance=kk,
        attn_mask=mask, key_mask=kmask, is_causal=is_causal, dropout_p=p, scale=sc,
        query_start=start,
    )


def relative_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    max_distance: int,
    rel_keys: Tensor | None = None,
    rel_values: Tensor | None = None,
    attn_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    query_start: int | None = None,
    implementation: Implementation | None = None,
) -> Tensor:
    r"""Scaled dot-product attention with clipped relative positions (Shaw et al., 2018).

    For query ``i`` at position ``p_i`` and key ``j``, with ``r = clip(j - p_i, -K, K)``::

        s_ij  = scale * q_i . (k_j + rel_keys[r + K])      (+ attn_mask)
        out_i = sum_j softmax_j(s_i)_j * (v_j + rel_values[r + K])

    Positions are bottom-right aligned: ``p_i = query_start + i`` with ``query_start``
    defaulting to ``S - L`` (queries aligned to the end of the keys, as in a KV cache). With
    ``is_causal`` key ``j`` is visible to query ``i`` iff ``j <= p_i``; for L = 2, S = 4::

        key j:    0 1 2 3
        query 0   1 1 1 0      (p_0 = 2)
        query 1   1 1 1 1      (p_1 = 3)

    Non-finite values propagate predictably: a NaN or infinity in query row ``i`` gives a
    non-finite output row ``i`` and leaves every other row unchanged; a NaN or infinity in key
    or value ``j`` makes non-finite every row that can see ``j`` (masks do not sanitize: a
    hidden non-finite value may still reach other rows, through ``0 * inf`` in the value
    product, and through hidden keys in the fused backend). ``-inf`` in a float ``attn_mask``
    means masked, exactly like ``False`` in a bool mask; ``+inf`` or NaN in it makes that row
    NaN. Rows that see no key return zeros with zero gradients, never NaN.

    Half precision (``float16``/``bfloat16``, native or under ``torch.autocast``) keeps the
    softmax statistics in float32. Under autocast, float32 inputs and tables are cast to the
    autocast dtype (as for a matmul) and the backend runs in that dtype.

    Args:
        query: ``(B, H, L, D)``.
        key: ``(B, H, S, D)``.
        value: ``(B, H, S, Dv)``.
        max_distance: K >= 0, the clip distance; tables have ``2K + 1`` rows.
        rel_keys: ``(2K+1, D)`` shared by all heads or ``(H, 2K+1, D)`` per head; None = off.
        rel_values: ``(2K+1, Dv)`` or ``(H, 2K+1, Dv)``; None = off.
        attn_mask: bool (True = may attend) or float (added to the scores) tensor
            broadcastable to ``(B, H, L, S)``.
        key_mask: ``(B, S)`` bool, True = real token (padding without an L x S mask).
        is_causal: hide keys after each query's position.
        dropout_p: dropout on the attention probabilities, in ``[0, 1)``.
        scale: multiplies the content and the relative key term alike; default ``1/sqrt(D)``.
        query_start: position of query 0, ``0 <= query_start <= S - L``; default ``S - L``.
        implementation: ``"reference"`` (the definition, O(L·S·D) memory), ``"bucketed"``
            (O(B·H·L·(2K+1)) extra), ``"fused"`` (exact region decomposition, O(n) extra
            memory) or None for the best backend that serves the call.

    Returns:
        ``(B, H, L, Dv)``. Query rows that see no key are zeros.

    Raises:
        TypeError, ValueError: on bad input, naming what was received and what is allowed.
        RuntimeError: if the named ``implementation`` cannot serve the call (with the reason).

    Example:
        >>> q = k = v = torch.randn(2, 4, 7, 16)
        >>> table = torch.randn(2 * 3 + 1, 16)
        >>> relative_attention(q, k, v, max_distance=3, rel_keys=table, rel_values=table).shape
        torch.Size([2, 4, 7, 16])
    """
    args = _validate(
        query, key, value, max_distance=max_distance, rel_keys=rel_keys, rel_values=rel_values,
        attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal, dropout_p=dropout_p,
        scale=scale, query_start=query_start,
    )
    if implementation is None:
        for name in _AUTO_ORDER:
            backend = _backend(name)
            if backend is not None and _auto_reason(backend, args) is None:
                return _call(backend.attention, args)
        raise AssertionError("the reference backend serves every call")
    if implementation not in BACKENDS:
        raise ValueError(
            f"unknown implementation {implementation!r}; allowed: None (auto), "
            + ", ".join(repr(b) for b in BACKENDS)
        )
    backend = _backend(implementation)
    if backend is None:
        raise RuntimeError(f"implementation {implementation!r} is not available in this build")
    reason = backend.unsupported_reason(**args)
    if reason is not None:
        raise RuntimeError(f"implementation {implementation!r} cannot serve this call: {reason}")
    return _call(backend.attention, args)


def why_not_fused(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    max_distance: int,
    rel_keys: Tensor | None = None,
    rel_values: Tensor | None = None,
    attn_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    query_start: int | None = None,
) -> str | None:
    """Why ``relative_attention(..., implementation=None)`` would not run the fused backend.

    Takes the same arguments as :func:`relative_attention` and returns None when the call
    goes fused, else one reason (like ``nn.MultiheadAttention``'s fast-path reasons).
    """
    args = _validate(
        query, key, value, max_distance=max_distance, rel_keys=rel_keys, rel_values=rel_values,
        attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal, dropout_p=dropout_p,
        scale=scale, query_start=query_start,
    )
    backend = _backend("fused")
    if backend is None:
        return "the fused backend is not available in this build"
    for name in _AUTO_ORDER[: _AUTO_ORDER.index("fused")]:
        earlier = _backend(name)
        if earlier is not None and _auto_reason(earlier, args) is None:
            L, S = args["query"].shape[-2], args["key"].shape[-2]
            return f"the {name} backend is picked first for L={L} queries over S={S} keys"
    return _auto_reason(backend, args)


def select_backend(query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> str:
    """Name of the backend ``relative_attention(..., implementation=None)`` runs for this call."""
    options: dict[str, Any] = dict(
        rel_keys=None, rel_values=None, attn_mask=None, key_mask=None, is_causal=False,
        dropout_p=0.0, scale=None, query_start=None,
    )
    options.update(kwargs)
    args = _validate(query, key, value, **options)
    for name in _AUTO_ORDER:
        backend = _backend(name)
        if backend is not None and _auto_reason(backend, args) is None:
            return name
    return "reference"


def relative_attention_with_weights(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    max_distance: int,
    rel_keys: Tensor | None = None,
    rel_values: Tensor | None = None,
    attn_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    query_start: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`relative_attention` that also returns the attention probabilities.

    Materializes the ``(B, H, L, S)`` probabilities, so it always runs the bucketed backend.

    Returns:
        ``(out, weights)``: ``(B, H, L, Dv)`` and ``(B, H, L, S)`` (before dropout; rows that see
        no key are zeros).
    """
    from relpos.ops import bucketed

    args = _validate(
        query, key, value, max_distance=max_distance, rel_keys=rel_keys, rel_values=rel_values,
        attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal, dropout_p=dropout_p,
        scale=scale, query_start=query_start,
    )
    return _call(bucketed.attention_and_weights, args)


for _name in _AUTO_ORDER:
    _backend(_name)
