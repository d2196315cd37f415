"""Packed variable-length batches: exact clipped relative attention over concatenated sequences
(``cu_seqlens``, as flash-attention's varlen functions), and the helpers that go between the
padded and the packed form.

A packed batch lays the sequences end to end: ``q (Tq, H, D)`` holds sequence ``s``'s queries
in rows ``[cu_seqlens_q[s], cu_seqlens_q[s + 1])`` and ``k``, ``v`` its keys in rows
``[cu_seqlens_k[s], cu_seqlens_k[s + 1])``. Offsets are measured inside a sequence and pairs
across sequences are not attended, so no attention work or memory is spent on padding.
Within sequence ``s`` the queries align to the end of its keys (query ``i`` at position
``S_s - L_s + i``, relpos's KV-cache convention), so one packed call also serves a batch of
decode or prefill steps over caches of different lengths. With ``seqused_k``
(flash-attention's) sequence ``s`` uses only the first ``seqused_k[s]`` rows of its key region,
so a packed KV cache can keep one region of fixed capacity per sequence and attention reads
only the filled part.

Backends: the native CPU kernels take the sequence boundaries directly (one call, tasks over
(sequence, head, query block), the custom op ``relpos::native_attention_varlen``, traced by
``torch.compile`` without recompiling per batch); so do the Triton kernels (one launch per
kernel, programs over (query or key block of a sequence, head), the custom op
``relpos::triton_attention_varlen``) wherever the padded triton backend serves the sequences;
every other backend serves a packed call one sequence at a time through
:func:`relpos.relative_attention`.

Shape legend: Tq, Tk total queries and keys, N sequences, H heads, D head dim, Dv value head
dim, R = left + right + 1 table rows.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from relpos.functional import (
    Implementation,
    _check_scalars,
    _check_table,
    _check_tensor,
    _with_arguments_of,
    relative_attention,
)
from relpos.ops import BACKENDS
from relpos.positions import check_window

__all__ = [
    "VarlenCall",
    "cu_seqlens_from_lengths",
    "explain_backends_varlen",
    "pack",
    "relative_attention_varlen",
    "select_backend_varlen",
    "unpack",
    "validate_varlen_call",
]

_NATIVE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class VarlenCall:
    """One validated call of :func:`relative_attention_varlen`.

    Attributes:
        query: ``(Tq, H, D)``. key: ``(Tk, H, D)``. value: ``(Tk, H, Dv)``.
        cu_seqlens_q, cu_seqlens_k: ``(N + 1,)`` int64 on the CPU (``cu_seqlens_k``: the key
            regions, as given).
        lengths_q, lengths_k: the N lengths, read once from ``cu_seqlens_*`` (None under
            ``torch.compile``, which reads no tensor's values); ``lengths_k`` are the keys each
            sequence *uses*: ``seqused_k`` when given, else its region's length.
        left, right: the clip window; rel_keys ``(Hr, R, D)`` and rel_values ``(Hr, R, Dv)``
            or None.
        is_causal, dropout_p, scale, implementation: as in :func:`relpos.relative_attention`.
        seqused_k: ``(N,)`` int64 on the CPU, or None: the keys each sequence uses, the first
            rows of its region.
        regions_k: the N key regions' lengths, from ``cu_seqlens_k`` (None under
            ``torch.compile``; None also stands for ``lengths_k`` when there is no
            ``seqused_k``).
    """

    query: Tensor
    key: Tensor
    value: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    lengths_q: tuple[int, ...] | None
    lengths_k: tuple[int, ...] | None
    left: int
    right: int
    rel_keys: Tensor | None
    rel_values: Tensor | None
    is_causal: bool
    dropout_p: float
    scale: float
    implementation: str | None = None
    seqused_k: Tensor | None = None
    regions_k: tuple[int, ...] | None = None

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    @functools.cached_property
    def _starts(self) -> tuple[list[int], list[int]]:
        assert self.lengths_q is not None and self.lengths_k is not None
        regions = self.lengths_k if self.regions_k is None else self.regions_k
        return ([0, *itertools.accumulate(self.lengths_q)],
                [0, *itertools.accumulate(regions)])

    def sequence(self, s: int) -> tuple[Tensor, Tensor, Tensor]:
        """Sequence ``s``'s query, key and value as ``(1, H, L_s, D)`` views (the padded API's
        layout): the keys and values it uses, the first ``S_s`` rows of its key region."""
        assert self.lengths_q is not None and self.lengths_k is not None
        q0, k0 = self._starts[0][s], self._starts[1][s]
        L, S = self.lengths_q[s], self.lengths_k[s]
        return (self.query[q0:q0 + L].transpose(0, 1).unsqueeze(0),
                self.key[k0:k0 + S].transpose(0, 1).unsqueeze(0),
                self.value[k0:k0 + S].transpose(0, 1).unsqueeze(0))


def _check_packed(name: str, t: Tensor, letter: str) -> None:
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D ({letter}, H, {'Dv' if name == 'value' else 'D'}) "
                         f"for a packed call, got a {t.dim()}-D tensor of shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating point tensor, got dtype {t.dtype}")


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    _check_packed("query", q, "Tq")
    _check_packed("key", k, "Tk")
    _check_packed("value", v, "Tk")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"query, key and value must share one dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"query, key and value must be on one device, got {q.device}, "
                         f"{k.device}, {v.device}")
    shapes = f"(shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)})"
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"head counts differ: query {q.shape[1]}, key {k.shape[1]}, value "
                         f"{v.shape[1]} " + shapes)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"key head dim {k.shape[2]} != query head dim {q.shape[2]} " + shapes)
    if q.shape[2] == 0:
        raise ValueError(f"query head dim D must be >= 1, got shape {tuple(q.shape)}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"value has {v.shape[0]} rows but key has {k.shape[0]} " + shapes)


def _check_cu_seqlens(name: str, cu: object, total: int, tracing: bool
                      ) -> tuple[Tensor, tuple[int, ...] | None]:
    """``cu`` as int64 on the CPU and its N lengths (None when ``tracing``)."""
    t = _check_tensor(name, cu)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64 (cumulative sequence lengths), got "
                        f"dtype {t.dtype}")
    if t.dim() != 1 or t.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with N + 1 >= 1 entries (0, then each sequence's "
                         f"end), got shape {tuple(t.shape)}")
    t = t.to("cpu", torch.int64)
    if tracing:
        return t, None
    values = t.tolist()  # the one read of the boundaries
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]} (first entries "
                         f"{values[:4]})")
    for s in range(len(values) - 1):
        if values[s + 1] < values[s]:
            raise ValueError(f"{name} must not decrease, got {values[s]} then {values[s + 1]} "
                             f"at entries {s} and {s + 1}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {values[-1]}")
    return t, tuple(b - a for a, b in itertools.pairwise(values))


def _check_seqused_k(seqused_k: object, n: int, regions: tuple[int, ...] | None
                     ) -> tuple[Tensor | None, tuple[int, ...] | None]:
    """``seqused_k`` as int64 on the CPU and its N values (None when ``regions`` is: under
    torch.compile only its type, dtype and shape are checked)."""
    if seqused_k is None:
        return None, regions
    t = _check_tensor("seqused_k", seqused_k)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"seqused_k must be int32 or int64 (the keys each sequence uses), got "
                        f"dtype {t.dtype}")
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"seqused_k must be 1-D with one entry per sequence (N = {n}, "
                         f"cu_seqlens_k has N + 1 = {n + 1}), got shape {tuple(t.shape)}")
    t = t.to("cpu", torch.int64)
    if regions is None:
        return t, None
    used = tuple(t.tolist())  # the one read of the used lengths
    for s, (u, region) in enumerate(zip(used, regions, strict=True)):
        if not 0 <= u <= region:
            raise ValueError(f"seqused_k[{s}] = {u} is outside [0, {region}]: each sequence "
                             f"uses between 0 and all the rows of its key region "
                             f"(cu_seqlens_k[{s + 1}] - cu_seqlens_k[{s}] = {region})")
    return t, used


def _check_max_seqlen(name: str, given: object, lengths: tuple[int, ...] | None) -> None:
    if given is None:
        return
    if isinstance(given, bool) or not isinstance(given, int):
        raise TypeError(f"{name} must be an int or None, got {given!r}")
    longest = max(lengths, default=0) if lengths is not None else None
    if longest is not None and given < longest:
        raise ValueError(f"{name}={given} is smaller than the longest sequence, {longest}")


def validate_varlen_call(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    max_distance: int | tuple[int, int],
    seqused_k: Tensor | None = None,
    rel_keys: Tensor | None = None,
    rel_values: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    implementation: Implementation | None = None,
) -> VarlenCall:
    """Check the arguments of :func:`relative_attention_varlen`; the call as one object.

    Raises:
        TypeError, ValueError: on bad input, naming what was received and what is allowed.
    """
    q = _check_tensor("query", query)
    k = _check_tensor("key", key)
    v = _check_tensor("value", value)
    _check_qkv(q, k, v)
    H, D, Dv = q.shape[1], q.shape[2], v.shape[2]
    tracing = torch.compiler.is_compiling() or torch.compiler.is_exporting()
    cu_q, lengths_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], tracing)
    cu_k, regions_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], tracing)
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {cu_q.shape[0] - 1} and {cu_k.shape[0] - 1}")
    used_k, lengths_k = _check_seqused_k(seqused_k, cu_k.shape[0] - 1, regions_k)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, lengths_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, lengths_k)
    left, right = check_window(max_distance)
    ak = _check_table("rel_keys", rel_keys, window=(left, right), dim=D, dim_name="D",
                      heads=H, ref=q)
    av = _check_table("rel_values", rel_values, window=(left, right), dim=Dv, dim_name="Dv",
                      heads=H, ref=q)
    p, sc = _check_scalars(is_causal, dropout_p, scale, D)
    if lengths_q is not None and lengths_k is not None and (
            is_causal or ak is not None or av is not None):
        for s, (L, S) in enumerate(zip(lengths_q, lengths_k, strict=True)):
            if L > S:
                keys = f"uses {S} keys (seqused_k)" if used_k is not None else f"{S} keys"
                raise ValueError(
                    f"sequence {s} has {L} queries but {keys}: relative positions align the "
                    f"queries to the end of their keys and need L <= S in every sequence")
    if implementation is not None and implementation not in BACKENDS:
        raise ValueError(f"unknown implementation {implementation!r}; allowed: None (auto), "
                         + ", ".join(repr(b) for b in reversed(BACKENDS)))
    return VarlenCall(
        query=q, key=k, value=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, lengths_q=lengths_q,
        lengths_k=lengths_k, left=left, right=right, rel_keys=ak, rel_values=av,
        is_causal=is_causal, dropout_p=p, scale=sc, implementation=implementation,
        seqused_k=used_k, regions_k=regions_k,
    )


# ------------------------------------------------------------------------------------------
# Backends


def _native_reason(call: VarlenCall) -> str | None:
    """Why the native kernels do not serve the packed call: they cannot, or, picking by
    itself (``implementation=None``), they have no vector code and a sequence has more than
    ``native.SCALAR_MAX_KEYS`` keys, and the other backends can take the call one sequence at
    a time (not under torch.compile)."""
    from relpos.ops import native

    if call.query.device.type != "cpu":
        return (f"device {call.query.device} is not supported by the native CPU kernels "
                "(allowed: cpu)")
    if call.query.dtype not in _NATIVE_DTYPES:
        return f"dtype {call.query.dtype} is not supported (allowed: {_NATIVE_DTYPES})"
    state = native._state()
    if state or call.implementation is not None or call.lengths_k is None:
        return state or None
    longest = max(call.lengths_k, default=0)
    if native._scalar_rows() and longest > native.SCALAR_MAX_KEYS:
        return native.SCALAR_REASON.format(S=longest)
    return None


def _longest(call: VarlenCall) -> int:
    """The sequence with the most query-key pairs (what a per-sequence backend is asked
    about)."""
    assert call.lengths_q is not None and call.lengths_k is not None
    pairs = [L * S for L, S in zip(call.lengths_q, call.lengths_k, strict=True)]
    return max(range(len(pairs)), key=pairs.__getitem__) if pairs else -1


def _per_sequence_reasons(call: VarlenCall) -> dict[str, str | None]:
    """Every backend with why it would not serve the packed call one sequence at a time
    (asked about its longest sequence, as auto-selection or as the implementation asked
    for), or None."""
    if call.lengths_q is None:
        reason = ("under torch.compile only the native kernels serve a packed call (one op; "
                  "the others would read the sequence lengths)")
        return dict.fromkeys(BACKENDS, reason)
    s = _longest(call)
    assert call.lengths_k is not None
    if s < 0 or call.lengths_q[s] == 0 or call.lengths_k[s] == 0:  # nothing to attend
        return dict.fromkeys(BACKENDS, None)
    from relpos.functional import explain_backends

    q, k, v = call.sequence(s)
    return explain_backends(q, k, v, **_padded_kwargs(call),  # type: ignore[arg-type]
                            implementation=cast(Implementation | None, call.implementation))


def _padded_kwargs(call: VarlenCall) -> dict[str, object]:
    return dict(max_distance=(call.left, call.right), rel_keys=call.rel_keys,
                rel_values=call.rel_values, is_causal=call.is_causal,
                dropout_p=call.dropout_p, scale=call.scale)


def _triton_one_call(call: VarlenCall) -> bool:
    """Whether the triton backend, serving the call, takes it in one call
    (``relpos::triton_attention_varlen``) rather than one sequence at a time: whenever some
    sequence has a (query, key) pair (else the per-sequence path gives the zeros, no kernel)."""
    s = _longest(call)
    assert call.lengths_q is not None and call.lengths_k is not None
    return s >= 0 and call.lengths_q[s] > 0 and call.lengths_k[s] > 0


def _explain(call: VarlenCall) -> dict[str, str | None]:
    """Every backend, native first, with why it would not serve the packed call (None: it
    would); auto-selection takes the first None. The triton backend is asked what it would be
    asked for the longest sequence (its reasons hold for every sequence) and takes the packed
    call in one call."""
    per_sequence = _per_sequence_reasons(call)
    reasons = {"native": _native_reason(call)}
    for name in BACKENDS:
        if name != "native":
            reason = per_sequence[name]
            how = ("asked about the longest sequence; it takes a packed call in one call"
                   if name == "triton" and call.lengths_q is not None
                   else "asked one sequence at a time")
            reasons[name] = None if reason is None else f"{reason} ({how})"
    if call.implementation is not None:
        asked = call.implementation
        return {name: reasons[name] if name == asked else
                f"implementation={asked!r} was asked for" for name in reasons}
    return reasons


def _backend_for(call: VarlenCall) -> str:
    if call.implementation in (None, "native") and _native_reason(call) is None:
        return "native"  # the other backends need not be asked (a decoding step's cost)
    reasons = _explain(call)
    if call.implementation is not None:
        reason = reasons[call.implementation]
        if reason is not None:
            raise RuntimeError(f"implementation {call.implementation!r} cannot serve this "
                               f"packed call: {reason}")
        return call.implementation
    for name, reason in reasons.items():
        if reason is None:
            return name
    raise RuntimeError("no backend serves this packed call: "
                       + "; ".join(f"{n}: {r}" for n, r in reasons.items()))


def _native(call: VarlenCall) -> Tensor:
    from relpos.ops.native import draw_seed, op

    seed = draw_seed() if call.dropout_p > 0.0 else None
    tables = call.rel_keys is not None or call.rel_values is not None
    left, right = (call.left, call.right) if tables else (0, 0)  # no table: no window
    args = (call.query, call.key, call.value, call.rel_keys, call.rel_values,
            call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k, seed)
    options = dict(left=left, right=right, is_causal=call.is_causal, scale=call.scale,
                   dropout_p=call.dropout_p)
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (call.query, call.key, call.value, call.rel_keys, call.rel_values))
    if not grads and not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
        return op.forward_varlen(*args, **options)[0]  # type: ignore[arg-type]
    return torch.ops.relpos.native_attention_varlen(*args, **options)[0]


def _triton(call: VarlenCall) -> Tensor:
    """The packed call in one call of ``relpos::triton_attention_varlen``; ``(Tq, H, Dv)``."""
    from relpos.ops.triton import op  # noqa: F401  (registers the op; imports no Triton)

    tables = call.rel_keys is not None or call.rel_values is not None
    left, right = (call.left, call.right) if tables else (0, 0)  # no table: no window
    return torch.ops.relpos.triton_attention_varlen(
        call.query, call.key, call.value, call.rel_keys, call.rel_values, call.cu_seqlens_q,
        call.cu_seqlens_k, call.seqused_k, left=left, right=right, is_causal=call.is_causal,
        scale=call.scale,
    )[0]


def _per_sequence(call: VarlenCall, backend: str) -> Tensor:
    """One :func:`relpos.relative_attention` call per sequence; ``(Tq, H, Dv)``."""
    assert call.lengths_q is not None and call.lengths_k is not None
    Tq, H, _ = call.query.shape
    Dv = call.value.shape[2]
    outs = []
    for s, (L, S) in enumerate(zip(call.lengths_q, call.lengths_k, strict=True)):
        if L == 0:
            continue
        q, k, v = call.sequence(s)
        if S == 0:  # no key: zeros (with zero gradients through the graph)
            outs.append(q.new_zeros(L, H, Dv) + 0 * q[0].transpose(0, 1).sum())
            continue
        out = relative_attention(q, k, v, **_padded_kwargs(call),  # type: ignore[arg-type]
                                 implementation=cast(Implementation, backend))
        outs.append(out[0].transpose(0, 1))  # (L, H, Dv)
    if not outs:
        return call.query.new_zeros(Tq, H, Dv)
    return torch.cat(outs, dim=0)


def _run(call: VarlenCall) -> Tensor:
    backend = _backend_for(call)
    if backend == "native":
        return _native(call)
    if backend == "triton" and _triton_one_call(call):
        return _triton(call)
    return _per_sequence(call, backend)


# ------------------------------------------------------------------------------------------
# Public functions


@_with_arguments_of(validate_varlen_call)
def relative_attention_varlen(call: VarlenCall) -> Tensor:
    r"""Clipped relative attention over a packed batch of sequences of different lengths.

    :func:`relpos.relative_attention` for each sequence, without padding: sequence ``s`` has
    queries ``query[cu_seqlens_q[s]:cu_seqlens_q[s + 1]]`` and keys and values
    ``key[cu_seqlens_k[s]:cu_seqlens_k[s + 1]]``; its query ``i`` sits at position
    ``S_s - L_s + i`` (aligned to the end of its keys) and attends only to its own keys, at
    offsets clipped to ``[-K, K]`` (or the window ``(left, right)``).

    Args:
        query: ``(Tq, H, D)``, the sequences' queries end to end.
        key: ``(Tk, H, D)``.
        value: ``(Tk, H, Dv)``.
        cu_seqlens_q: ``(N + 1,)`` int32 or int64: 0, then each sequence's end in ``query``.
        cu_seqlens_k: ``(N + 1,)``: the same in ``key``/``value`` (often the same tensor).
        max_seqlen_q, max_seqlen_k: the longest sequence (as flash-attention takes them;
            ``max_seqlen_k`` counts the keys used); optional, checked when given.
        seqused_k: ``(N,)`` int32 or int64, or None (flash-attention's
            ``flash_attn_varlen_func(..., seqused_k=...)``): sequence ``s`` uses only the
            keys and values ``key[cu_seqlens_k[s]:cu_seqlens_k[s] + seqused_k[s]]``, so
            ``S_s = seqused_k[s]`` (``0 <= S_s <= cu_seqlens_k[s + 1] - cu_seqlens_k[s]``) and
            its queries align to the end of the keys it uses. The rest of its region is spare
            capacity (a packed KV cache of fixed capacity per sequence): never read, its
            gradient zero. None: every sequence uses its whole region.
        max_distance, rel_keys, rel_values, is_causal, dropout_p, scale: as in
            :func:`relpos.relative_attention`. With tables or ``is_causal`` every sequence
            needs ``L_s <= S_s``; sequences of length 0 are legal.
        implementation: a backend by name, or None: the native CPU kernels where they serve
            the call (one call for the whole batch), else the padded call's choice (the
            triton kernels on CUDA, in one call; the others one sequence at a time;
            :func:`explain_backends_varlen` says why).

    Returns:
        ``(Tq, H, Dv)``; rows that see no key are zeros.

    Raises:
        TypeError, ValueError: on bad input, naming what was received and what is allowed.
        RuntimeError: if the named ``implementation`` cannot serve the call.

    Example:
        >>> q = k = v = torch.randn(10, 2, 8)           # sequences of 3 and 7 tokens
        >>> cu = torch.tensor([0, 3, 10])
        >>> table = torch.randn(2 * 4 + 1, 8)
        >>> relative_attention_varlen(q, k, v, cu, cu, max_distance=4, rel_keys=table).shape
        torch.Size([10, 2, 8])
    """
    return _run(call)


@_with_arguments_of(validate_varlen_call)
def explain_backends_varlen(call: VarlenCall) -> dict[str, str | None]:
    """For the arguments of :func:`relative_attention_varlen`: each backend, in the order
    auto-selection tries them (native first), with why it would not serve the call, or None.
    The first None is what :func:`select_backend_varlen` names."""
    return _explain(call)


@_with_arguments_of(validate_varlen_call)
def select_backend_varlen(call: VarlenCall) -> str:
    """The backend :func:`relative_attention_varlen` runs for these arguments."""
    return _backend_for(call)


# ------------------------------------------------------------------------------------------
# Between the padded and the packed form


def cu_seqlens_from_lengths(lengths: Sequence[int] | Tensor, *,
                            dtype: torch.dtype = torch.int32) -> Tensor:
    """``(N + 1,)`` cumulative lengths: 0, then each sequence's end.

    Example:
        >>> cu_seqlens_from_lengths([3, 0, 7])
        tensor([ 0,  3,  3, 10], dtype=torch.int32)
    """
    t = torch.as_tensor(lengths)
    if t.dim() != 1 or (t.numel() and (t.is_floating_point() or bool((t < 0).any()))):
        raise ValueError(f"lengths must be N >= 0 non-negative integers, got {lengths!r}")
    return torch.cat([t.new_zeros(1), t.cumsum(0)]).to(dtype)


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
    order, end to end ``(T, ...)``, and ``cu_seqlens (B + 1,)`` int32.

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
        return x.reshape(B * L, *x.shape[2:]), cu_seqlens_from_lengths([L] * B)
    real = ~_padding("key_padding_mask", key_padding_mask, B, L, x.device)
    return x[real], cu_seqlens_from_lengths(real.sum(1).cpu())


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
    elif max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest sequence, "
                         f"{longest}")
    positions = torch.arange(max_seqlen, device=packed.device)
    real = positions < torch.tensor(lengths, device=packed.device).view(B, 1)
    out = packed.new_full((B, max_seqlen, *packed.shape[1:]), padding_value)
    return out.index_put((real,), packed)

