"""``relative_attention``: the public function. Validates the call once, then runs a backend.

:func:`validate_call` turns the user's arguments into one frozen
:class:`~relpos.ops.call.AttentionCall`; backend selection, :func:`select_backend`,
:func:`explain_backends` and every backend read that same object.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
K clip distance (``max_distance``), R = 2K + 1 table rows.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import ParamSpec, TypeVar

import torch
from torch import Tensor

from relpos.ops import (
    BACKENDS,
    BackendReasons,
    Implementation,
    bucketed,
    check_implementation,
    decode,
    flash_regions,
    native,
    reference,
)
from relpos.ops import triton as triton_backend
from relpos.ops.call import AttentionCall, Reason
from relpos.positions import check_window, resolve_query_start

__all__ = [
    "AttentionCall",
    "Implementation",
    "available_backends",
    "explain_backends",
    "relative_attention",
    "relative_attention_with_weights",
    "select_backend",
    "validate_call",
    "why_not_fused",
]

_MODULES: dict[str, ModuleType] = {
    "reference": reference, "bucketed": bucketed, "flash_regions": flash_regions, "decode": decode,
    "native": native, "triton": triton_backend,
}
assert set(_MODULES) == set(BACKENDS)


def available_backends() -> tuple[str, ...]:
    """Names of the backends, in auto-selection order."""
    return BACKENDS


# ----------------------------------------------------------------------------------------------
# Validation: once, at the public boundary


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


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_table(
    name: str, table: object, *, window: tuple[int, int], dim: int, dim_name: str, heads: int,
    ref: Tensor,
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
    left, right = window
    rows = left + right + 1
    if t.shape[1] != rows:
        need = (f"max_distance={left} needs 2K+1 = {rows}" if left == right else
                f"max_distance=({left}, {right}) needs left + right + 1 = {rows}")
        raise ValueError(f"{name} has {t.shape[1]} rows (shape {given}), but {need}")
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


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
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
    shapes = f"(shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)})"
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"batch sizes differ: query {q.shape[0]}, key {k.shape[0]}, value {v.shape[0]} "
            + shapes
        )
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(
            f"head counts differ: query {q.shape[1]}, key {k.shape[1]}, value {v.shape[1]} "
            + shapes
        )
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"key head dim {k.shape[3]} != query head dim {q.shape[3]}")
    if q.shape[3] == 0:
        raise ValueError(f"query head dim D must be >= 1, got shape {tuple(q.shape)}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"value has {v.shape[2]} positions but key has {k.shape[2]}")


def _check_scalars(is_causal: object, dropout_p: object, scale: object, D: int) -> tuple[
    float, float
]:
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    if scale is None:
        return p, 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    sc = float(scale)
    if not math.isfinite(sc):
        raise ValueError(f"scale must be finite, got {sc}")
    return p, sc


def _check_masks(
    attn_mask: object, key_mask: object, q: Tensor, B: int, H: int, L: int, S: int
) -> tuple[Tensor | None, Tensor | None]:
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
            if mask.dim() > 4 or torch.broadcast_shapes(
                tuple(mask.shape), (B, H, L, S)
            ) != (B, H, L, S):
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
    return mask, kmask


def validate_call(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    max_distance: int | tuple[int, int],
    rel_keys: Tensor | None = None,
    rel_values: Tensor | None = None,
    attn_mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    query_start: int | None = None,
    implementation: Implementation | None = None,
) -> AttentionCall:
    """Check the arguments of :func:`relative_attention` and return them as one call object.

    Under autocast, float32 inputs and tables are cast to the autocast dtype here (as for a
    matmul), so every backend sees one dtype. Tables come back 3-D, ``(Hr, R, D)``.

    Raises:
        TypeError, ValueError: on bad input, naming what was received and what is allowed.
    """
    q = _check_tensor("query", query)
    k = _check_tensor("key", key)
    v = _check_tensor("value", value)
    low = _autocast_dtype(q.device.type)
    if low is not None:
        q, k, v = (_to_autocast(t, low) for t in (q, k, v))  # type: ignore[assignment]
        rel_keys, rel_values, attn_mask = (  # type: ignore[assignment]
            _to_autocast(t, low) for t in (rel_keys, rel_values, attn_mask)
        )
    _check_qkv(q, k, v)
    B, H, L, D = q.shape
    S, Dv = k.shape[2], v.shape[3]
    left, right = check_window(max_distance)
    window = (left, right)
    ak = _check_table("rel_keys", rel_keys, window=window, dim=D, dim_name="D", heads=H, ref=q)
    av = _check_table("rel_values", rel_values, window=window, dim=Dv, dim_name="Dv", heads=H,
                      ref=q)
    p, sc = _check_scalars(is_causal, dropout_p, scale, D)
    mask, kmask = _check_masks(attn_mask, key_mask, q, B, H, L, S)
    backend = check_implementation(implementation)
    positional = ak is not None or av is not None or is_causal
    # Without relative positions query_start has no effect, but a given one is still checked.
    start = resolve_query_start(L, S, query_start) if positional or query_start is not None else 0
    # Offsets j - p_i lie in [-(start + L - 1), S - 1 - start]: a wider window clips nothing
    # there, and the tables' outer rows are never read. Serve it as the narrowest window that
    # clips nothing, so no backend builds anything of its size (K = 10**9 over 7 keys is
    # legal). Not under torch.compile or torch.export: one graph serves many lengths, and
    # comparing a length with the window would compile one graph per side of its edge.
    reach_left, reach_right = max(start + L - 1, 0), max(S - 1 - start, 0)
    tracing = torch.compiler.is_compiling() or torch.compiler.is_exporting()
    if not tracing and (reach_left < left or reach_right < right):
        new_left, new_right = min(left, reach_left), min(right, reach_right)
        rows = slice(left - new_left, left + new_right + 1)
        ak = None if ak is None else ak[:, rows]
        av = None if av is None else av[:, rows]
        left, right = new_left, new_right
    return AttentionCall(
        query=q, key=k, value=v, left=left, right=right, rel_keys=ak, rel_values=av, attn_mask=mask,
        key_mask=kmask, is_causal=is_causal, dropout_p=p, scale=sc, query_start=start,
        implementation=backend,
    )


_P = ParamSpec("_P")
_R = TypeVar("_R")
_C = TypeVar("_C")


def _with_arguments_of(
    template: Callable[_P, _C],
) -> Callable[[Callable[[_C], _R]], Callable[_P, _R]]:
    """Give ``body(call)`` the public arguments of ``template`` (:func:`validate_call`, or
    :func:`relpos.varlen.validate_varlen_call`): the
    wrapper validates them into one call object and hands that over, so the
    argument list is written once. ``help()`` and the API reference show the full signature."""

    def decorate(body: Callable[[_C], _R]) -> Callable[_P, _R]:
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            return body(template(*args, **kwargs))

        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(wrapper, attr, getattr(body, attr))
        wrapper.__signature__ = inspect.signature(template).replace(  # type: ignore[attr-defined]
            return_annotation=inspect.signature(body).return_annotation
        )
        return wrapper

    return decorate


# ----------------------------------------------------------------------------------------------
# Backend selection


def _auto_reason(name: str, call: AttentionCall) -> Reason | str | None:
    """Why auto-selection passes backend ``name`` by: its ``auto_reason`` (hard limits and
    speed) if it has one, else its ``unsupported_reason``."""
    backend = _MODULES[name]
    check = getattr(backend, "auto_reason", backend.unsupported_reason)
    return check(call)


def _explain(call: AttentionCall) -> BackendReasons:
    """Every backend, in :data:`~relpos.ops.BACKENDS` order, with why the call would not run
    it (None: it would serve the call); the first None is what :func:`_backend_for` picks."""
    reasons: dict[str, Reason | str | None]
    if call.implementation is not None:
        reasons = dict.fromkeys(BACKENDS, f"implementation={call.implementation!r} was asked for")
        reasons[call.implementation] = _MODULES[call.implementation].unsupported_reason(call)
    elif torch.compiler.is_exporting():
        reasons = dict.fromkeys(BACKENDS, "under torch.export the bucketed backend serves every "
                                "call (one graph for every length)")
        reasons["bucketed"] = None
    else:
        reasons = {name: _auto_reason(name, call) for name in BACKENDS}
    return BackendReasons(
        (name, None if reason is None else str(reason)) for name, reason in reasons.items())


def _unsupported_reasons(call: AttentionCall, names: Iterable[str]) -> dict[str, str | None]:
    """Why each backend of ``names`` cannot serve ``call`` when asked for by name (its
    ``unsupported_reason``: hard limits only), or None. For callers that ask about calls they
    build themselves (:mod:`relpos.varlen`'s padded groups of sequences)."""
    reasons = {name: _MODULES[name].unsupported_reason(call) for name in names}
    return {name: None if reason is None else str(reason) for name, reason in reasons.items()}


def _backend_for(call: AttentionCall) -> str:
    """The backend that runs ``call``: the one asked for (if it can serve the call) or the
    first in :data:`~relpos.ops.BACKENDS` order whose auto-selection check passes."""
    if call.implementation is not None:
        reason = _MODULES[call.implementation].unsupported_reason(call)
        if reason is not None:
            raise RuntimeError(
                f"implementation {call.implementation!r} cannot serve this call: {reason}"
            )
        return call.implementation
    if torch.compiler.is_exporting():
        # One exported graph serves every length, so the choice cannot depend on the lengths;
        # the bucketed backend is plain ATen operations (what ONNX and other exporters take).
        return "bucketed"
    for name in BACKENDS:
        if _auto_reason(name, call) is None:
            return name
    raise AssertionError("the reference backend serves every call")


def _run(fn: Callable[[AttentionCall], _R], call: AttentionCall) -> _R:
    """Run a backend function. Under autocast the inputs were already cast (see
    :func:`validate_call`); the backend then runs as in native half precision (its own float32
    statistics), not with autocast re-casting its internal float32 accumulators."""
    device_type = call.query.device.type
    if _autocast_dtype(device_type) is None:
        return fn(call)
    with torch.autocast(device_type, enabled=False):
        return fn(call)


# ----------------------------------------------------------------------------------------------
# Public functions


@_with_arguments_of(validate_call)
def relative_attention(call: AttentionCall) -> Tensor:
    r"""Scaled dot-product attention with clipped relative positions (Shaw et al., 2018).

    For query ``i`` at position ``p_i`` and key ``j``, with ``r = clip(j - p_i, -K, K)``
    (``clip(j - p_i, -left, right)`` for a window, and ``left`` for ``K`` below)::

        s_ij  = scale * q_i . (k_j + rel_keys[r + K])      (+ attn_mask)
        out_i = sum_j softmax_j(s_i)_j * (v_j + rel_values[r + K])

    Positions are bottom-right aligned: ``p_i = query_start + i`` with ``query_start``
    defaulting to ``S - L`` (queries aligned to the end of the keys, as in a KV cache). With
    ``is_causal`` key ``j`` is visible to query ``i`` iff ``j <= p_i``; for L = 2, S = 4::

        key j:    0 1 2 3
        query 0   1 1 1 0      (p_0 = 2)
        query 1   1 1 1 1      (p_1 = 3)

    Non-finite values propagate predictably: a NaN or infinity in query row ``i`` gives a non-finite
    output row ``i`` and leaves every other row unchanged; a NaN or infinity in key or value ``j``
    makes non-finite every row that can see ``j`` (masks do not sanitize: a hidden non-finite value
    may still reach other rows, through ``0 * inf`` in the value product, and through hidden keys in
    the flash_regions backend). A NaN or infinity in table row ``r`` makes non-finite every row that
    sees a key at offset ``r`` and leaves the rows with no key at that offset unchanged, except in
    backends that multiply per-row value buckets by the whole ``rel_values`` table (bucketed,
    decode, native): there a non-finite ``rel_values`` row reaches every row. ``-inf`` in a float
    ``attn_mask`` means masked, exactly like ``False`` in a bool mask; ``+inf`` or NaN in it makes
    that row NaN. Rows that see no key return zeros with zero gradients, never NaN.

    Half precision (``float16``/``bfloat16``, native or under ``torch.autocast``) keeps the
    softmax statistics in float32. Under autocast, float32 inputs and tables are cast to the
    autocast dtype (as for a matmul) and the backend runs in that dtype.

    Args:
        query: ``(B, H, L, D)``.
        key: ``(B, H, S, D)``.
        value: ``(B, H, S, Dv)``.
        max_distance: K >= 0, the clip distance; tables have ``2K + 1`` rows. Or a window
            ``(left, right)``: offsets clipped to ``[-left, +right]``, tables of
            ``left + right + 1`` rows, row ``r + left`` holding offset ``r``.
        rel_keys: ``(R, D)`` shared by all heads or ``(H, R, D)`` per head; None = off.
        rel_values: ``(R, Dv)`` or ``(H, R, Dv)``; None = off.
        attn_mask: bool (True = may attend) or float (added to the scores) tensor
            broadcastable to ``(B, H, L, S)``.
        key_mask: ``(B, S)`` bool, True = real token (padding without an L x S mask).
        is_causal: hide keys after each query's position.
        dropout_p: dropout on the attention probabilities, in ``[0, 1)``.
        scale: multiplies the content and the relative key term alike; default ``1/sqrt(D)``.
        query_start: position of query 0, ``0 <= query_start <= S - L``; default ``S - L``.
        implementation: ``"reference"`` (the definition, O(L·S·D) memory), ``"bucketed"``
            (O(B·H·L·(2K+1)) extra), ``"flash_regions"`` (exact region decomposition over
            torch's flash kernels, O(n) extra memory; ``"fused"`` is its deprecated old name),
            ``"decode"`` (KV-cache steps), ``"native"`` (the C++ CPU kernels, one fused pass
            per direction, O(L·R) extra; compiled on first use), ``"triton"`` (the fused
            kernel on CUDA GPUs) or None for the best backend that serves the call
            (:func:`select_backend` names it).

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
    return _run(_MODULES[_backend_for(call)].attention, call)


@_with_arguments_of(validate_call)
def select_backend(call: AttentionCall) -> str:
    """The name of the backend :func:`relative_attention` runs for these arguments.

    Takes the same arguments as :func:`relative_attention`. With ``implementation`` named it
    returns that name, or raises ``RuntimeError`` with the reason it cannot serve the call.

    Example:
        >>> q = torch.randn(1, 2, 5, 8)
        >>> name = select_backend(q, q, q, max_distance=2, rel_keys=torch.randn(5, 8))
        >>> name in available_backends()  # "native" where the C++ kernels build
        True
        >>> reasons = explain_backends(q, q, q, max_distance=2, rel_keys=torch.randn(5, 8))
        >>> name == next(n for n, why in reasons.items() if why is None)
        True
    """
    return _backend_for(call)


@_with_arguments_of(validate_call)
def explain_backends(call: AttentionCall) -> BackendReasons:
    """Why :func:`relative_attention` would or would not run each backend for these arguments.

    Takes the same arguments as :func:`relative_attention` and returns every backend name, in
    auto-selection order (:data:`relpos.ops.BACKENDS`), mapped to the reason it would not serve
    this call (a string, like ``nn.MultiheadAttention``'s fast-path reasons) or None if it
    would. The first name mapped to None is what :func:`select_backend` returns; with
    ``implementation`` named, every other backend's reason says so, and if the named one
    cannot serve the call none is None (:func:`relative_attention` raises with its reason).

    Example:
        >>> q = torch.randn(1, 2, 5, 8)
        >>> reasons = explain_backends(q, q, q, max_distance=2, dropout_p=0.1)
        >>> list(reasons) == list(available_backends())
        True
        >>> reasons["flash_regions"]
        'dropout_p=0.1 > 0: the flash_regions backend has no attention dropout (the bucketed ...'
    """
    return _explain(call)


@_with_arguments_of(validate_call)
def why_not_fused(call: AttentionCall) -> str | None:
    """Deprecated: use :func:`explain_backends`, which gives every backend's reason.

    Why :func:`relative_attention` would not run the flash_regions backend (named ``"fused"``
    when this function was written) for these arguments: None when the call goes to it, else
    one reason (a backend picked before it, or its own).
    """
    warnings.warn("relpos.why_not_fused is deprecated; use relpos.explain_backends",
                  DeprecationWarning, stacklevel=3)
    reasons = _explain(call)
    if call.implementation is None:
        first = next(name for name, reason in reasons.items() if reason is None)
        if BACKENDS.index(first) < BACKENDS.index("flash_regions"):
            if first == "native":
                return ("the native CPU kernels serve this call and are picked first "
                        "(RELPOS_NATIVE=0 turns them off)")
            return (f"the {first} backend is picked first for L={call.query_len} queries over "
                    f"S={call.key_len} keys")
    return reasons["flash_regions"]


@_with_arguments_of(validate_call)
def relative_attention_with_weights(call: AttentionCall) -> tuple[Tensor, Tensor]:
    """:func:`relative_attention` that also returns the attention probabilities.

    Takes the same arguments as :func:`relative_attention`. Materializes the ``(B, H, L, S)``
    probabilities, so it always runs the bucketed backend.

    Returns:
        ``(out, weights)``: ``(B, H, L, Dv)`` and ``(B, H, L, S)`` (before dropout; rows that see
        no key are zeros).
    """
    if call.implementation not in (None, "bucketed"):
        raise ValueError(
            f"relative_attention_with_weights always runs the bucketed backend, got "
            f"implementation={call.implementation!r} (allowed: None or 'bucketed')"
        )
    return _run(bucketed.attention_and_weights, call)
