"""Running a packed call: the native kernels' op, the triton kernels' op, or padded groups of
sequences through :func:`relpos.relative_attention`.

A group of n sequences becomes one padded call ``(n, H, Lp, D)`` over ``(n, H, Sp, D)`` keys,
each sequence's queries and keys placed at the *end* of its rows: query ``i`` of sequence
``s`` in row ``Lp - L_s + i``, at position ``Sp - Lp + (Lp - L_s + i)`` (the padded call's
bottom-right alignment), and its key ``j`` at position ``Sp - S_s + j``, so every offset is
the sequence's own ``j - (S_s - L_s + i)``, causality and windows included. A key mask hides
the keys in front of a shorter sequence's (they hold zeros); the query rows in front of its
queries are computed and dropped (their gradient is zero, so they add nothing to the
gradients of the keys, values and tables). One call per group instead of one per sequence:
a batch of short sequences costs about one padded call, not N calls. Where the sequences of a
group fill their rows and lie evenly spaced (equal lengths, or one sequence) the padded
tensors are views of the packed ones; else they are gathered, which is why a sequence too
long to be worth copying (:data:`~relpos.varlen.selection.GATHER_MOST`) runs alone or beside
its equals.

Shape legend: Tq, Tk total queries and keys, N sequences, H heads, D head dim, Dv value head
dim; L_s, S_s the queries and the keys sequence s uses.
"""

from __future__ import annotations

import itertools
import warnings

import torch
from torch import Tensor

from relpos.functional import _unsupported_reasons, relative_attention
from relpos.varlen.call import VarlenCall
from relpos.varlen.selection import Group, _native_reason, group_call, longest

__all__ = ["grouped", "native", "triton", "triton_one_call", "zeros"]

MANY_CALLS = 64
"""Sequences run one call each (a backend that serves no key mask) beyond which a packed call
warns, once per process: each call's fixed cost then adds up."""

_warned = False


def native(call: VarlenCall) -> Tensor:
    """The packed call in one call of ``relpos::native_attention_varlen``; ``(Tq, H, Dv)``."""
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
    tracing = torch.compiler.is_compiling() or torch.compiler.is_exporting()
    if not grads and not tracing:
        return op.forward_varlen(*args, **options)[0]  # type: ignore[arg-type]
    if tracing and (tables or call.is_causal):  # L_s <= S_s, checked when the graph runs
        fit = op.varlen_queries_fit(call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_k)
        args = (*args[:5], fit, *args[6:])
    return torch.ops.relpos.native_attention_varlen(*args, **options)[0]


def triton_one_call(call: VarlenCall) -> bool:
    """Whether the triton backend, serving the call, takes it in one call
    (``relpos::triton_attention_varlen``) rather than in padded groups: whenever some sequence
    has a (query, key) pair (else the groups give the zeros, no kernel)."""
    s = longest(call)
    assert call.lengths_q is not None and call.lengths_k is not None
    return s >= 0 and call.lengths_q[s] > 0 and call.lengths_k[s] > 0


def triton(call: VarlenCall) -> Tensor:
    """The packed call in one call of ``relpos::triton_attention_varlen``; ``(Tq, H, Dv)``."""
    from relpos.ops.triton import op  # noqa: F401  (registers the op; imports no Triton)

    tables = call.rel_keys is not None or call.rel_values is not None
    left, right = (call.left, call.right) if tables else (0, 0)  # no table: no window
    return torch.ops.relpos.triton_attention_varlen(
        call.query, call.key, call.value, call.rel_keys, call.rel_values, call.cu_seqlens_q,
        call.cu_seqlens_k, call.seqused_k, left=left, right=right, is_causal=call.is_causal,
        scale=call.scale,
    )[0]


def zeros(call: VarlenCall) -> Tensor:
    """``(Tq, H, Dv)`` zeros that stay in the autograd graph of every input (zero gradients,
    as the native op gives): the result of a call in which no query sees a key. Joined
    through empty slices, so a non-finite input cannot reach the zeros."""
    Tq, H, _ = call.query.shape
    out = call.query.new_zeros(Tq, H, call.value.shape[2])
    inputs = [t for t in (call.query, call.key, call.value, call.rel_keys, call.rel_values)
              if t is not None]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return out
    nothing = torch.cat([t.reshape(-1)[:0] for t in inputs]).sum()  # 0, from every input
    return out + nothing


def _parts(call: VarlenCall, group: Group, backend: str) -> tuple[list[Group], str | None]:
    """``group`` as the padded calls that run it: itself, or, where ``backend`` serves no key
    mask (the fused backend on CUDA), one call per sequence, with the reason."""
    if not group.masked:
        return [group], None
    reason = _unsupported_reasons(group_call(call, group, masked=True), [backend])[backend]
    if reason is None:
        return [group], None
    assert call.lengths_q is not None and call.lengths_k is not None
    return [Group((s,), call.lengths_q[s], call.lengths_k[s], False)
            for s in group.members], reason


def _at_the_end(x: Tensor, first: list[int], count: list[int], P: int
                ) -> tuple[Tensor, Tensor | None]:
    """Rows of n sequences, ``count[i]`` rows of ``x (T, H, E)`` from row ``first[i]``, each
    at the end of ``P`` padded rows: ``(n, H, P, E)`` (zeros in front; a view of ``x`` where
    the sequences fill their rows and lie evenly spaced), and the ``(n, P)`` bool mask of the
    real rows (None: every row is real)."""
    n, (_, H, E) = len(first), x.shape
    step = first[1] - first[0] if n > 1 else P
    if (all(c == P for c in count) and step >= P and first[0] + n * step <= x.shape[0]
            and all(b - a == step for a, b in itertools.pairwise(first))):
        padded = x.narrow(0, first[0], n * step).reshape(n, step, H, E)[:, :P]
        return padded.transpose(1, 2), None
    starts, counts = torch.tensor(first), torch.tensor(count)
    front = (P - counts)[:, None]  # (n, 1): padded rows before the sequence's
    rows = torch.arange(P)[None, :]
    real = rows >= front  # (n, P)
    index = torch.where(real, starts[:, None] + rows - front, 0).flatten()
    padded = x.index_select(0, index.to(x.device))
    # zeros in front, never another sequence's values
    padded = padded.index_fill_(0, (~real).flatten().nonzero().squeeze(1).to(x.device), 0)
    return padded.view(n, P, H, E).transpose(1, 2), real


def _query_rows(first: list[int], count: list[int]) -> Tensor:
    """The packed rows of the sequences' queries, in order (int64, CPU)."""
    if all(b - a == c for a, b, c in zip(first, first[1:], count, strict=False)):
        return torch.arange(first[0], first[-1] + count[-1])  # side by side
    return torch.cat([torch.arange(f, f + c) for f, c in zip(first, count, strict=True)])


def _run_group(call: VarlenCall, group: Group, backend: str) -> tuple[Tensor, Tensor]:
    """``group``'s padded call: the packed query rows it computes (int64, CPU) and their
    outputs ``(rows, H, Dv)``."""
    assert call.lengths_q is not None and call.lengths_k is not None
    members = group.members
    H, Dv = call.query.shape[1], call.value.shape[2]
    q0 = [call.starts[0][s] for s in members]
    k0 = [call.starts[1][s] for s in members]
    L = [call.lengths_q[s] for s in members]
    S = [call.lengths_k[s] for s in members]
    q, real_q = _at_the_end(call.query, q0, L, group.queries)
    k, real_k = _at_the_end(call.key, k0, S, group.keys)
    v = _at_the_end(call.value, k0, S, group.keys)[0]
    key_mask = None if real_k is None else real_k.to(call.query.device)
    out = relative_attention(q, k, v, **call.padded_kwargs(),  # type: ignore[arg-type]
                             key_mask=key_mask, implementation=backend)  # type: ignore[arg-type]
    out = out.transpose(1, 2).reshape(-1, H, Dv)  # (n * Lp, H, Dv)
    if real_q is not None:
        kept = real_q.flatten().nonzero().squeeze(1)
        out = out.index_select(0, kept.to(out.device))
    return _query_rows(q0, L), out


def _warn_slow(call: VarlenCall, backend: str, alone: int, reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    native = _native_reason(call) or "another backend was asked for"
    warnings.warn(
        f"relative_attention_varlen: {alone} of {call.num_sequences} sequences ran one call "
        f"each, since the {backend} backend cannot pad sequences of different lengths into "
        f"one call ({reason}); the native kernels, which take a packed call in one call, do "
        f"not serve it ({native})", RuntimeWarning, stacklevel=7)


def grouped(call: VarlenCall, backend: str, groups: tuple[Group, ...]) -> Tensor:
    """The packed call through ``backend``'s padded calls, one per group; ``(Tq, H, Dv)``.
    Rows of sequences without keys are zeros."""
    if not groups:
        return zeros(call)
    Tq, H, _ = call.query.shape
    destinations, outputs = [], []
    alone, why = 0, ""
    for group in groups:
        parts, reason = _parts(call, group, backend)
        if reason is not None:
            alone, why = alone + len(parts), reason
        for part in parts:
            dest, rows = _run_group(call, part, backend)
            destinations.append(dest)
            outputs.append(rows)
    if alone > MANY_CALLS:
        _warn_slow(call, backend, alone, why)
    dest = torch.cat(destinations)
    rows = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    if dest.shape[0] == Tq and bool((dest == torch.arange(Tq)).all()):
        return rows  # every query, in order: no scatter
    out = rows.new_zeros(Tq, H, rows.shape[2])
    return out.index_put((dest.to(rows.device),), rows)
