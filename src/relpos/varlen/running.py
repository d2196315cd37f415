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
tensors are views of the packed ones, all cut by one split (so the backward builds each
input's gradient once, not once a group); else they are gathered, which is why a sequence too
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
from relpos.varlen.call import PackedAttentionCall
from relpos.varlen.selection import Group, _native_reason, group_call, longest

__all__ = ["grouped", "native", "triton", "triton_one_call", "zeros"]

MANY_CALLS = 64
"""Sequences run one call each (a backend that serves no key mask) beyond which a packed call
warns, once per process: each call's fixed cost then adds up."""

_warned = False


def native(call: PackedAttentionCall) -> Tensor:
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


def triton_one_call(call: PackedAttentionCall) -> bool:
    """Whether the triton backend, serving the call, takes it in one call
    (``relpos::triton_attention_varlen``) rather than in padded groups: whenever some sequence
    has a (query, key) pair (else the groups give the zeros, no kernel)."""
    s = longest(call)
    assert call.lengths_q is not None and call.lengths_k is not None
    return s >= 0 and call.lengths_q[s] > 0 and call.lengths_k[s] > 0


def triton(call: PackedAttentionCall) -> Tensor:
    """The packed call in one call of ``relpos::triton_attention_varlen``; ``(Tq, H, Dv)``."""
    from relpos.ops.triton import op  # noqa: F401  (registers the op; imports no Triton)

    tables = call.rel_keys is not None or call.rel_values is not None
    left, right = (call.left, call.right) if tables else (0, 0)  # no table: no window
    return torch.ops.relpos.triton_attention_varlen(
        call.query, call.key, call.value, call.rel_keys, call.rel_values, call.cu_seqlens_q,
        call.cu_seqlens_k, call.seqused_k, left=left, right=right, is_causal=call.is_causal,
        scale=call.scale,
    )[0]


def zeros(call: PackedAttentionCall) -> Tensor:
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


def _parts(call: PackedAttentionCall, group: Group, backend: str) -> tuple[list[Group], str | None]:
    """``group`` as the padded calls that run it: itself, or, where ``backend`` serves no key
    mask (the flash_regions backend on CUDA), one call per sequence, with the reason."""
    if not group.masked:
        return [group], None
    reason = _unsupported_reasons(group_call(call, group, masked=True), [backend])[backend]
    if reason is None:
        return [group], None
    assert call.lengths_q is not None and call.lengths_k is not None
    return [Group((s,), call.lengths_q[s], call.lengths_k[s], False)
            for s in group.members], reason


def _block(first: list[int], count: list[int], ends: list[int], P: int
           ) -> tuple[int, int] | None:
    """``(start, step)`` where the rows of n side-by-side sequences (``count[i]`` rows from row
    ``first[i]``, in a region ending at row ``ends[i]``) can be a view: each fills its ``P``
    rows, and the regions are evenly spaced, ``step >= P`` rows apart, so that rows
    ``[start, start + n * step)`` seen as ``(n, step)`` hold them; else None."""
    if any(c != P for c in count):
        return None
    step = ends[0] - first[0]
    if any(e - f != step for f, e in zip(first, ends, strict=True)) or any(
            b != e for b, e in zip(first[1:], ends, strict=False)):
        return None
    return first[0], step


def _gathered(x: Tensor, first: list[int], count: list[int], P: int) -> tuple[Tensor, Tensor]:
    """Rows of n sequences, ``count[i]`` rows of ``x (T, H, E)`` from row ``first[i]``, each
    copied to the end of its ``P`` padded rows: ``(n, P, H, E)`` with zeros in front (never
    another sequence's values), and the ``(n, P)`` bool mask of the real rows."""
    n, (_, H, E) = len(first), x.shape
    starts, counts = torch.tensor(first), torch.tensor(count)
    front = (P - counts)[:, None]  # (n, 1): padded rows before the sequence's
    rows = torch.arange(P)[None, :]
    real = rows >= front  # (n, P)
    index = torch.where(real, starts[:, None] + rows - front, 0).flatten()
    padded = x.index_select(0, index.to(x.device))
    padded = padded.index_fill_(0, (~real).flatten().nonzero().squeeze(1).to(x.device), 0)
    return padded.view(n, P, H, E), real


class _Layout:
    """Where one padded call's queries, keys and values come from: blocks of the packed
    tensors seen as ``(n, step)`` rows (views, cut by one split for every call), or gathered
    rows."""

    def __init__(self, call: PackedAttentionCall, group: Group) -> None:
        assert call.lengths_q is not None and call.lengths_k is not None
        members = group.members
        regions = call.lengths_k if call.regions_k is None else call.regions_k
        self.group = group
        self.q0 = [call.starts[0][s] for s in members]
        self.k0 = [call.starts[1][s] for s in members]
        self.L = [call.lengths_q[s] for s in members]
        self.S = [call.lengths_k[s] for s in members]
        side_by_side = all(b == a + 1 for a, b in itertools.pairwise(members))
        q_ends = [f + n for f, n in zip(self.q0, self.L, strict=True)]
        k_ends = [f + regions[s] for f, s in zip(self.k0, members, strict=True)]
        if len(members) == 1:  # one sequence: the keys it uses
            k_ends = [self.k0[0] + self.S[0]]
        self.q_block = _block(self.q0, self.L, q_ends, group.queries) if side_by_side else None
        self.k_block = _block(self.k0, self.S, k_ends, group.keys) if side_by_side else None

    def query_rows(self) -> Tensor:
        """The packed rows of the group's queries, in order (int64, CPU)."""
        if self.q_block is not None:
            return torch.arange(self.q0[0], self.q0[-1] + self.L[-1])
        return torch.cat([torch.arange(f, f + c) for f, c in zip(self.q0, self.L, strict=True)])


def _pieces(x: Tensor, blocks: dict[int, tuple[int, int]]) -> dict[int, Tensor]:
    """``x``'s row ranges ``{key: (start, length)}`` (disjoint) as views from one split, so
    that the backward assembles ``x``'s gradient once, not once a range."""
    if not blocks:
        return {}
    sizes: list[int] = []
    keys: list[int | None] = []
    at = 0
    for key, (start, length) in sorted(blocks.items(), key=lambda kv: kv[1][0]):
        assert start >= at, "overlapping blocks"
        if start > at:
            sizes.append(start - at)
            keys.append(None)
        sizes.append(length)
        keys.append(key)
        at = start + length
    if at < x.shape[0]:
        sizes.append(x.shape[0] - at)
        keys.append(None)
    return {key: piece for key, piece in zip(keys, torch.split(x, sizes), strict=True)
            if key is not None}


def _run_group(call: PackedAttentionCall, layout: _Layout, backend: str,
               pieces: tuple[Tensor | None, Tensor | None, Tensor | None]) -> Tensor:
    """The group's padded call; the outputs ``(rows, H, Dv)`` of its queries, in the order of
    :meth:`_Layout.query_rows`. ``pieces``: its query and key blocks, where views."""
    group = layout.group
    n, H, Dv = len(group.members), call.query.shape[1], call.value.shape[2]
    real_q = real_k = None
    q_piece, k_piece, v_piece = pieces
    if q_piece is not None:
        q = q_piece.view(n, group.queries, H, -1)
    else:
        q, real_q = _gathered(call.query, layout.q0, layout.L, group.queries)
    if k_piece is not None and v_piece is not None and layout.k_block is not None:
        step = layout.k_block[1]
        k = k_piece.view(n, step, H, -1)[:, :group.keys]
        v = v_piece.view(n, step, H, -1)[:, :group.keys]
    else:
        k, real_k = _gathered(call.key, layout.k0, layout.S, group.keys)
        v = _gathered(call.value, layout.k0, layout.S, group.keys)[0]
    key_mask = None if real_k is None else real_k.to(call.query.device)
    out = relative_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             **call.padded_kwargs(),  # type: ignore[arg-type]
                             key_mask=key_mask, implementation=backend)  # type: ignore[arg-type]
    out = out.transpose(1, 2).reshape(-1, H, Dv)  # (n * Lp, H, Dv)
    if real_q is not None:
        kept = real_q.flatten().nonzero().squeeze(1)
        out = out.index_select(0, kept.to(out.device))
    return out


def _warn_slow(call: PackedAttentionCall, backend: str, alone: int, reason: str) -> None:
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


def grouped(call: PackedAttentionCall, backend: str, groups: tuple[Group, ...]) -> Tensor:
    """The packed call through ``backend``'s padded calls, one per group; ``(Tq, H, Dv)``.
    Rows of sequences without keys are zeros."""
    if not groups:
        return zeros(call)
    Tq, H, _ = call.query.shape
    layouts: list[_Layout] = []
    alone, why = 0, ""
    for group in groups:
        parts, reason = _parts(call, group, backend)
        if reason is not None:
            alone, why = alone + len(parts), reason
        layouts += [_Layout(call, part) for part in parts]
    if alone > MANY_CALLS:
        _warn_slow(call, backend, alone, why)
    q_blocks = {i: (b[0], len(lay.group.members) * b[1])
                for i, lay in enumerate(layouts) if (b := lay.q_block) is not None}
    k_blocks = {i: (b[0], len(lay.group.members) * b[1])
                for i, lay in enumerate(layouts) if (b := lay.k_block) is not None}
    q_pieces = _pieces(call.query, q_blocks)
    k_pieces, v_pieces = _pieces(call.key, k_blocks), _pieces(call.value, k_blocks)
    outputs = [_run_group(call, lay, backend, (q_pieces.get(i), k_pieces.get(i),
                                               v_pieces.get(i)))
               for i, lay in enumerate(layouts)]
    dest = torch.cat([lay.query_rows() for lay in layouts])
    rows = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    if dest.shape[0] == Tq and bool((dest == torch.arange(Tq)).all()):
        return rows  # every query, in order: no scatter
    out = rows.new_zeros(Tq, H, rows.shape[2])
    return out.index_put((dest.to(rows.device),), rows)
