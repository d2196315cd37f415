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
every other backend serves a packed call in padded groups of sequences of similar lengths, one
:func:`relpos.relative_attention` call per group (:mod:`relpos.varlen.running`), and
auto-selection picks only a backend that serves every sequence
(:mod:`relpos.varlen.selection`).

The package's parts: :mod:`~relpos.varlen.call` (the validated call), ``selection``,
``running`` and :mod:`~relpos.varlen.packing` (:func:`pack`, :func:`unpack`,
:func:`cu_seqlens_from_lengths`); every public name is importable from ``relpos.varlen``.

Shape legend: Tq, Tk total queries and keys, N sequences, H heads, D head dim, Dv value head
dim, R = left + right + 1 table rows.
"""

from __future__ import annotations

from torch import Tensor

from relpos._deprecated import module_getattr, moved
from relpos.functional import _with_arguments_of
from relpos.ops import BackendReasons
from relpos.varlen import running, selection
from relpos.varlen.call import (
    PackedAttentionCall,
    _check_cu_seqlens,  # noqa: F401  (relpos.models reads packed ids)
    validate_varlen_call,
)
from relpos.varlen.packing import cu_seqlens_from_lengths, pack, unpack

__all__ = [
    "PackedAttentionCall",
    "cu_seqlens_from_lengths",
    "explain_backends_varlen",
    "pack",
    "relative_attention_varlen",
    "select_backend_varlen",
    "unpack",
    "validate_varlen_call",
]


def _per_sequence(call: PackedAttentionCall, plan: selection.Plan) -> Tensor:
    """The sequences through a backend without a packed kernel: one padded call per group of
    sequences of similar lengths; ``(Tq, H, Dv)``."""
    return running.grouped(call, plan.backend, plan.groups)


def _run(call: PackedAttentionCall) -> Tensor:
    plan = selection.plan(call)
    if plan.backend == "native":
        return running.native(call)
    if plan.backend == "triton" and running.triton_one_call(call):
        return running.triton(call)
    return _per_sequence(call, plan)


# ------------------------------------------------------------------------------------------
# Public functions


@_with_arguments_of(validate_varlen_call)
def relative_attention_varlen(call: PackedAttentionCall) -> Tensor:
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
            the call (one call for the whole batch), else the first backend that serves every
            sequence, with the padded call's preference for the sequence with the most
            query-key pairs (the triton kernels on CUDA, in one call; the others in padded
            groups of sequences of similar lengths, one call per group;
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
def explain_backends_varlen(call: PackedAttentionCall) -> BackendReasons:
    """For the arguments of :func:`relative_attention_varlen`: each backend, in the order
    auto-selection tries them (native first), with why it would not serve the call, or None.
    The first None is what :func:`select_backend_varlen` names: a backend whose reason is None
    serves every sequence of the call."""
    return selection.explain(call)


@_with_arguments_of(validate_varlen_call)
def select_backend_varlen(call: PackedAttentionCall) -> str:
    """The backend :func:`relative_attention_varlen` runs for these arguments (for every
    sequence)."""
    return selection.plan(call).backend


# Renamed in 0.1 (the C++ kernels' VarlenCall is another thing).
__getattr__ = module_getattr(
    __name__,
    {
        "VarlenCall": moved("relpos.varlen.PackedAttentionCall"),
    },
)
