"""Exact Shaw attention over one sequence sharded across the ranks of a process group.

:func:`context_parallel_attention` takes each rank's shard ``(B, H, n_local, D)`` of the
queries, keys and values of one self-attention over ``n = P * n_local`` positions and returns
that rank's rows of the single-process :func:`relpos.functional.relative_attention` over the
whole sequence, forward and backward. :func:`shard_sequence` cuts a full tensor into this
rank's shard and :func:`unshard_sequence` puts the shards back together (for outputs, labels,
padding masks: any tensor with the sequence on one dim).

Layouts (P ranks, rank r):

- ``"contiguous"``: the sequence in P equal chunks, rank r holds chunk r.
- ``"head_tail"``: the sequence in 2P equal chunks, rank r holds chunks r and 2P-1-r,
  concatenated (causal attention then costs every rank the same).

Modes: ``"all_gather"`` gathers the keys and values of all ranks in one collective (keys,
values and the key mask concatenated on the last dim, so the backward is one collective too),
then runs one :func:`~relpos.functional.relative_attention` call per local query segment with
its global offset as ``query_start``; a causal segment at offset g reads only keys
``[0, g + L_seg)``. ``"ring"`` keeps one visiting shard (plus the next one in flight) instead
of the whole sequence: the key/value shards travel around the ranks by point-to-point sends
(``batch_isend_irecv``, the next shard posted before this one is computed), each step runs one
native kernel call per (local query chunk, visiting key chunk) at that pair's offset, and the
partial results merge by logsumexp; the backward hands every call the global output and
logsumexp (docs/design.md §3) while the key/value gradients ride a second ring back to their
owners. Chunks are never concatenated, so a far chunk costs plain attention plus one constant
per row (the kernel's far regions), and only neighbouring chunks touch the band.

Dropout is keyed by global (query, key) positions (the kernels' dropout placement), so a run
with a seed equals the single-process run with that seed (rank 0's draw is used everywhere).

Table gradients are this rank's partial sums: nothing here all-reduces them. DDP or FSDP
reduce them like every other weight's gradient (the sum over ranks is the single-process
gradient).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from relpos.distributed._checks import (
    CALL_OPTIONS,
    LAYOUTS,
    MODES,
    _check_device,
    _check_layout,
    _chunks,
    _code,
    _gather_meta,
    _initialized_group,
    _native_for,
    _ranks,
    agree,
    call_values,
    check_arguments,
    meta_device,
)
from relpos.functional import relative_attention
from relpos.ops._lse import merge_rows
from relpos.ops._numerics import accumulation_dtype
from relpos.positions import check_window

__all__ = ["LAYOUTS", "MODES", "context_parallel_attention", "shard_sequence", "unshard_sequence"]

_MAX_DIMS = 10  # dims of a tensor that unshard_sequence checks across ranks


def _local_chunks(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The global chunk indices this rank holds, in the order it holds them."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


class _AllGather(torch.autograd.Function):
    """All ranks' ``x`` stacked on a new dim 0; backward: the summed gradient of this rank's
    slice (a reduce-scatter where the backend has one, else an all-reduce and a slice)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, rank: int, world: int) -> Tensor:
        ctx.group, ctx.rank, ctx.world = group, rank, world
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        grad = grad.contiguous()
        if "nccl" in str(dist.get_backend(ctx.group)):
            out = torch.empty_like(grad[0])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None, None, None
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total[ctx.rank], None, None, None


def _reorder(parts: Tensor, *, dim: int, layout: str, world: int) -> Tensor:
    """Shards stacked on dim 0 (rank order) -> the sequence in global order on ``dim``
    (``dim`` counts the dims of one shard)."""
    if layout == "contiguous":
        return torch.cat(list(parts.unbind(0)), dim=dim)
    held: dict[int, Tensor] = {}
    for r, shard in enumerate(parts.unbind(0)):
        first, second = shard.chunk(2, dim=dim)
        a, b = _local_chunks(layout, r, world)
        held[a], held[b] = first, second
    return torch.cat([held[c] for c in range(2 * world)], dim=dim)


def shard_sequence(
    x: Tensor, *, dim: int, group: Any = None, layout: str = "contiguous",
    rank: int | None = None, world_size: int | None = None,
) -> Tensor:
    """This rank's shard of a full sequence ``x`` (the sequence on ``dim``).

    ``"contiguous"``: chunk ``rank`` of ``P`` equal chunks; ``"head_tail"``: chunks ``rank``
    and ``2P - 1 - rank`` of ``2P`` equal chunks, concatenated. ``rank`` and ``world_size``
    default to the group's (then the process group must be initialized). Serves queries, keys,
    values, labels and padding masks alike; differentiable (a view or a concatenation).
    """
    layout = _check_layout(layout)
    if rank is None or world_size is None:
        g_rank, g_world = _initialized_group(group)
        rank = g_rank if rank is None else rank
        world_size = g_world if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    n = x.shape[dim]
    chunks = _chunks(layout, world_size)
    if n % chunks:
        raise ValueError(
            f"layout {layout!r} over {world_size} ranks cuts the sequence into {chunks} equal "
            f"chunks, but its length (dim {dim}) is {n}: allowed lengths are multiples of "
            f"{chunks}"
        )
    c = n // chunks
    pieces = [x.narrow(dim, i * c, c) for i in _local_chunks(layout, rank, world_size)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard_sequence(
    x: Tensor, *, dim: int, group: Any = None, layout: str = "contiguous"
) -> Tensor:
    """The full sequence from every rank's shard ``x`` (the inverse of :func:`shard_sequence`):
    one all-gather, then the chunks in global order. Differentiable for floating point
    tensors (the backward returns this rank's slice of the gradient summed over ranks); bool
    tensors (padding masks) are gathered as uint8. Every rank must pass the same shape,
    dtype, ``dim`` and ``layout`` (checked with one small all-gather first, so no rank hangs
    and every rank raises)."""
    layout = _check_layout(layout)
    rank, world = _initialized_group(group)
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"unshard_sequence takes up to {_MAX_DIMS} dims, got {x.dim()}")
    dim = dim % max(x.dim(), 1)
    _check_device(x, group)
    if world == 1:
        return x
    shape = list(x.shape) + [0] * (_MAX_DIMS - x.dim())
    meta = _gather_meta([LAYOUTS.index(layout), dim, x.dim(), _code(str(x.dtype)), *shape],
                        x.device, group, world)
    for at, name, show in ((0, "layout", lambda m: repr(LAYOUTS[m[0]])),
                           (1, "dim", lambda m: str(m[1]))):
        if any(m[at] != meta[0][at] for m in meta):
            raise ValueError(f"unshard_sequence: the ranks disagree on {name}: "
                             f"{_ranks([show(m) for m in meta])}; every rank must pass the same")
    meta = [m[2:] for m in meta]
    if any(m != meta[0] for m in meta):
        got = {r: (m[0], m[2:2 + m[0]]) for r, m in enumerate(meta)}
        raise ValueError(
            f"unshard_sequence needs one shape and dtype on every rank, got (ndim, shape) by "
            f"rank {got} (dtypes {'equal' if len({m[1] for m in meta}) == 1 else 'differ'})"
        )
    if layout == "head_tail" and x.shape[dim] % 2:
        raise ValueError(f"a head_tail shard holds two equal chunks, got odd length "
                         f"{x.shape[dim]} on dim {dim}")
    if x.dtype == torch.bool:
        parts = _AllGather.apply(x.to(torch.uint8), group, rank, world).to(torch.bool)
    else:
        parts = _AllGather.apply(x, group, rank, world)
    return _reorder(parts, dim=dim, layout=layout, world=world)


class _Plan:
    """Who holds which chunks of the sequence, and the call's kernel options."""

    def __init__(self, *, layout: str, rank: int, world: int, n_local: int, left: int,
                 right: int, is_causal: bool, scale: float, dropout_p: float,
                 seed: Tensor | None, group: Any) -> None:
        self.layout, self.rank, self.world, self.group = layout, rank, world, group
        self.n = n_local * world
        self.c = self.n // _chunks(layout, world)
        self.options: dict[str, Any] = dict(left=left, right=right, is_causal=is_causal,
                                            scale=scale, dropout_p=dropout_p)
        self.seed = seed

    def pieces(self, owner: int) -> list[tuple[slice, int]]:
        """``(rows of the owner's shard, global position of its first row)`` per chunk."""
        return [(slice(i * self.c, (i + 1) * self.c), g * self.c)
                for i, g in enumerate(_local_chunks(self.layout, owner, self.world))]

    def pairs(self, owner: int) -> list[tuple[slice, int, slice, int]]:
        """The kernel calls of one ring step: (local query rows, their global start, the
        visiting shard's key rows, their global start), skipping key chunks that lie wholly
        after the query chunk of a causal call."""
        return [(qs, gq, ks, gk) for qs, gq in self.pieces(self.rank)
                for ks, gk in self.pieces(owner)
                if not (self.options["is_causal"] and gk >= gq + self.c)]

    def seed_at(self, gq: int, gk: int) -> Tensor | None:
        """The dropout stream of one kernel call, placed at its global rows and keys."""
        if self.seed is None:
            return None
        return torch.cat([self.seed, torch.tensor([self.n, gq, gk], dtype=torch.int64)])


def _ring_exchange(send: list[Tensor], group: Any, rank: int, world: int) -> tuple[
    list[Tensor], list[Any]
]:
    """Post sends of ``send`` to the next rank and receives of tensors shaped alike from the
    previous one (all posted before any wait); returns the receive buffers and the requests."""
    nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (
        (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (
        (rank - 1) % world)
    recv = [torch.empty_like(t) for t in send]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recv]
    return recv, dist.batch_isend_irecv(ops)


def _wait(requests: list[Any]) -> None:
    for r in requests:
        r.wait()


def _ring(plan: _Plan, held: list[Tensor], acc: torch.dtype) -> Iterator[
    tuple[list[Tensor], list[tuple[slice, int, slice, int]]]
]:
    """The ring's steps, one a rank: the shard held at each (its owner's keys, values and key
    bias) widened to ``acc``, and the kernel calls it serves (:meth:`_Plan.pairs`). The next
    shard's transfer is posted before a step's calls and waited for after them, so the two
    overlap."""
    for step in range(plan.world):
        last = step == plan.world - 1
        if not last:
            coming, requests = _ring_exchange(held, plan.group, plan.rank, plan.world)
        yield [t.to(acc) for t in held], plan.pairs((plan.rank - step) % plan.world)
        if not last:
            _wait(requests)
            held = coming


def _key_bias(key_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if key_mask is None:
        return None
    return torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device).masked_fill(
        ~key_mask, -torch.inf)


class _Ring(torch.autograd.Function):
    """Ring attention over the shards: queries and tables in the accumulation dtype, keys,
    values and key bias in the input dtype, as they travel (a bfloat16 shard is sent as
    bfloat16: half the bytes of float32), widened to the accumulation dtype where computed
    (exactly: every bfloat16 and float16 value is a float32 one). The key/value gradients ride
    their ring in the accumulation dtype, so their sums over the ranks round once."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, rk: Tensor | None,
                rv: Tensor | None, kb: Tensor | None, plan: _Plan) -> Tensor:
        from relpos.ops.native import op

        B, H, n_local = q.shape[:3]
        Dv = v.shape[3]
        acc = q.dtype
        out = q.new_zeros(B, H, n_local, Dv)
        z = q.new_full((B, H, n_local), -torch.inf)  # log-mass so far
        filled: set[int] = set()
        # The visiting shard: keys, values (and key bias) as they are, no copy made to send.
        held = [k.contiguous(), v.contiguous()] + ([] if kb is None else [kb.contiguous()])
        for wide, pairs in _ring(plan, held, acc):
            for qs, gq, ks, gk in pairs:
                o, lse = op.forward(
                    q[:, :, qs], wide[0][:, :, ks], wide[1][:, :, ks], rk, rv,
                    None if kb is None else wide[2][:, ks], None, plan.seed_at(gq, gk),
                    query_start=gq - gk, **plan.options)
                log_mass = lse.masked_fill(lse == torch.inf, -torch.inf)  # empty rows: no mass
                merge_rows(out, z, qs, o, log_mass, first=gq not in filled)
                filled.add(gq)
        lse = z.masked_fill(z == -torch.inf, torch.inf)  # the kernels' convention: +inf
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, rk, rv, kb, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        from relpos.ops.native import op

        plan: _Plan = ctx.plan
        q, k, v, rk, rv, kb, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q)
        drk = None if rk is None else torch.zeros_like(rk)
        drv = None if rv is None else torch.zeros_like(rv)
        acc = q.dtype
        held = [k.contiguous(), v.contiguous()] + ([] if kb is None else [kb.contiguous()])
        # The gradient of the visiting shard's keys and values, riding along with it.
        dkv = [held[0].new_zeros(held[0].shape, dtype=acc),
               held[1].new_zeros(held[1].shape, dtype=acc)]
        for wide, pairs in _ring(plan, held, acc):
            for qs, gq, ks, gk in pairs:
                g = op._backward(
                    grad_out[:, :, qs], q[:, :, qs], wide[0][:, :, ks], wide[1][:, :, ks], rk,
                    rv, None if kb is None else wide[2][:, ks], None, plan.seed_at(gq, gk),
                    out[:, :, qs], lse[:, :, qs], query_start=gq - gk, **plan.options)
                dq[:, :, qs] += g[0]
                dkv[0][:, :, ks] += g[1]
                dkv[1][:, :, ks] += g[2]
                for total, part in ((drk, g[3]), (drv, g[4])):
                    if total is not None and part is not None:
                        total += part
                del g
            # This shard's gradient goes on to the next rank (after the last step: its owner).
            sent = dkv
            dkv, grad_requests = _ring_exchange(sent, plan.group, plan.rank, plan.world)
            _wait(grad_requests)
            del sent
        return (dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), drk, drv, None, None)


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: Any = None,
    max_distance: int | tuple[int, int],
    rel_keys: Tensor | None = None,
    rel_values: Tensor | None = None,
    is_causal: bool = False,
    key_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    layout: str = "contiguous",
    mode: str = "all_gather",
    head_group: int | None = None,
) -> Tensor:
    """Shaw attention over a sequence sharded across the ranks of ``group`` (self-attention).

    Each rank passes its shard of the queries, keys and values ``(B, H, n_local, D)`` (values
    ``(B, H, n_local, Dv)``) and of ``key_mask`` ``(B, n_local)`` (True = real token), cut as
    ``layout`` says (:func:`shard_sequence`); every rank the same ``n_local`` (pad the
    sequence to a multiple of the layout's chunk count and mask the padding). Returns this
    rank's rows ``(B, H, n_local, Dv)`` of :func:`~relpos.functional.relative_attention` over
    the whole sequence of ``n = P * n_local`` positions, and its gradients in the backward.
    The other arguments mean what they mean there. ``layout="head_tail"`` balances causal
    work; without ``is_causal`` it is allowed and brings nothing (every rank's work is equal
    either way).

    ``mode="all_gather"``: one all-gather of the keys and values (and key mask) per call, one
    reduce-scatter-equivalent in the backward (an all-reduce and a slice on gloo); runs on
    any backend relative_attention has. ``mode="ring"``: ``P - 1`` point-to-point steps
    forward, ``P - 1`` plus ``P`` backward (see docs/scaling.md), holding two shards of keys
    and values instead of the whole sequence; runs on the native CPU kernels, as does
    ``dropout_p > 0`` in either mode. ``head_group=G`` (all-gather mode, no dropout) gathers
    the keys and values of ``G`` heads at a time and re-gathers them in the backward
    (``torch.utils.checkpoint``: each group's attention forward runs again), so a rank holds
    the whole sequence of ``G`` heads, not of all ``H``. Gradients of ``rel_keys`` and
    ``rel_values`` are this rank's partial sums, not all-reduced here: DDP or FSDP reduce them
    like any other weight.
    A group of one rank runs the local call.

    Before computing, the ranks agree in one small all-gather: ranks that differ in the shard
    shapes or in any option that must match (layout, mode, ``head_group``, ``is_causal``,
    ``max_distance``, ``scale``, ``dropout_p``, the tables' shapes, dtype, which inputs need
    gradients) all raise one ValueError naming it and each rank's value; a rank that refuses
    its own arguments raises its error and the others a ValueError quoting it (none hangs).

    Raises:
        ValueError: an unknown mode or layout, ranks that disagree (above), shards that the
            layout cannot split, tensors on a device the group's backend does not serve (or,
            for ring mode and dropout, not on the CPU), and every bad input that
            ``relative_attention`` refuses.
        RuntimeError: torch.distributed not initialized; ring mode or dropout without the
            native kernels.
    """
    args: dict[str, Any] = dict(max_distance=max_distance, rel_keys=rel_keys,
                                rel_values=rel_values, is_causal=is_causal, key_mask=key_mask,
                                dropout_p=dropout_p, scale=scale)
    # Every local argument checked before any collective; a rank that refuses its arguments
    # still joins the agreement's gather below, so the other ranks raise too.
    refused: Exception | None = None
    try:
        check_arguments(query, key, value, layout=layout, mode=mode, head_group=head_group,
                        **args)
    except (TypeError, ValueError) as e:
        refused = e
    if refused is not None and not (dist.is_available() and dist.is_initialized()):
        raise refused
    rank, world = _initialized_group(group)
    dropout = refused is None and float(dropout_p) > 0.0
    if refused is None:
        try:
            _check_device(query, group)
            if world > 1 and (mode == "ring" or dropout):
                _native_for(query, "mode='ring'" if mode == "ring"
                            else "dropout under context parallelism")
        except (ValueError, RuntimeError) as e:
            refused = e
    kwargs: dict[str, Any] = dict(max_distance=max_distance, rel_keys=rel_keys,
                                  rel_values=rel_values, is_causal=is_causal, scale=scale)
    if world == 1:
        if refused is not None:
            raise refused
        return relative_attention(query, key, value, key_mask=key_mask, dropout_p=dropout_p,
                                  **kwargs)

    from relpos.ops import native

    # One small all-gather: every rank raises alike unless all agree on every option that
    # must match (CALL_OPTIONS) and none refused; it carries rank 0's dropout seed too.
    seed = native.draw_seed() if dropout else torch.zeros(2, dtype=torch.int64)
    meta = agree("context_parallel_attention", CALL_OPTIONS, None if refused is not None else
                 call_values(query, key, value, layout=layout, mode=mode, head_group=head_group,
                             seed=seed, **args),
                 refused, device=meta_device(query, group), group=group, world=world)
    H, n_local, D = query.shape[1:]
    if layout == "head_tail" and n_local % 2:
        raise ValueError(
            f"layout 'head_tail' holds two equal chunks per rank, got odd n_local={n_local}: "
            f"the sequence length must be a multiple of 2P = {2 * world}"
        )
    n = n_local * world
    # The window narrowed to the whole sequence (offsets lie in [-(n - 1), n - 1]).
    left, right = check_window(max_distance)
    lo, hi = min(left, n - 1), min(right, n - 1)
    tables = [None if t is None else (t if t.dim() == 3 else t[None])[:, left - lo:left + hi + 1]
              for t in (rel_keys, rel_values)]
    if rel_keys is None and rel_values is None:
        lo = hi = 0
    D_scale = float(D) ** -0.5 if scale is None else float(scale)
    plan = _Plan(layout=layout, rank=rank, world=world, n_local=n_local, left=lo, right=hi,
                 is_causal=is_causal, scale=D_scale, dropout_p=float(dropout_p),
                 seed=torch.tensor(meta["dropout seed"], dtype=torch.int64) if dropout
                 else None,
                 group=group)
    if mode == "ring":
        acc = accumulation_dtype(query.dtype)  # queries and tables; shards travel as given
        q = query.to(acc)
        rk, rv = (None if t is None else t.to(acc) for t in tables)
        out = _Ring.apply(q, key, value, rk, rv, _key_bias(key_mask, key.dtype), plan)
        return out.to(query.dtype)
    if head_group is None or head_group >= H:
        return _all_gather_attention(query, key, value, key_mask, tables, plan, kwargs)
    return _all_gather_by_heads(query, key, value, key_mask, tables, plan, kwargs, head_group)


def _all_gather_by_heads(query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor | None,
                         tables: list[Tensor | None], plan: _Plan, kwargs: dict[str, Any],
                         head_group: int) -> Tensor:
    """All-gather mode, ``head_group`` heads at a time; with autograd on, each group under
    non-reentrant checkpointing, so its gathered keys and values are freed after its forward
    and gathered again (same collectives, same order on every rank) in its backward."""
    from torch.utils.checkpoint import checkpoint

    H = query.shape[1]
    rel = {name: kwargs[name] for name in ("rel_keys", "rel_values")}
    rest = {k: v for k, v in kwargs.items() if k not in rel}

    def heads(t: Tensor | None, hs: slice) -> Tensor | None:
        return t[hs] if t is not None and t.dim() == 3 else t  # per-head tables: their heads

    def group_attention(q: Tensor, k: Tensor, v: Tensor, rk: Tensor | None,
                        rv: Tensor | None) -> Tensor:
        return _all_gather_attention(q, k, v, key_mask, tables, plan,
                                     {**rest, "rel_keys": rk, "rel_values": rv})

    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, *rel.values()))
    outs = []
    for h0 in range(0, H, head_group):
        hs = slice(h0, min(h0 + head_group, H))
        args = (query[:, hs], key[:, hs], value[:, hs], heads(rel["rel_keys"], hs),
                heads(rel["rel_values"], hs))
        outs.append(checkpoint(group_attention, *args, use_reentrant=False) if grad
                    else group_attention(*args))
    return torch.cat(outs, dim=1)


def _all_gather_attention(query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor | None,
                          tables: list[Tensor | None], plan: _Plan,
                          kwargs: dict[str, Any]) -> Tensor:
    """All-gather mode: one collective for keys, values and the key mask (concatenated on the
    last dim), then one call per local query segment at its global offset."""
    B, H, n_local, D = query.shape
    Dv = value.shape[3]
    pieces = [key, value]
    if key_mask is not None:
        pieces.append(key_mask.to(key.dtype)[:, None, :, None].expand(B, H, n_local, 1))
    parts = _AllGather.apply(torch.cat(pieces, dim=-1), plan.group, plan.rank, plan.world)
    full = _reorder(parts, dim=2, layout=plan.layout, world=plan.world)  # (B, H, n, D+Dv[+1])
    k_all, v_all = full[..., :D], full[..., D:D + Dv]
    mask_all = None if key_mask is None else full[:, 0, :, D + Dv] > 0.5
    outs = []
    for qs, g in plan.pieces(plan.rank):
        q_seg = query[:, :, qs]
        stop = g + plan.c if plan.options["is_causal"] else plan.n  # keys after stay hidden
        if plan.seed is None:
            outs.append(relative_attention(
                q_seg, k_all[:, :, :stop], v_all[:, :, :stop], query_start=g,
                key_mask=None if mask_all is None else mask_all[:, :stop], **kwargs,
            ))
            continue
        # Dropout: the native op, its stream placed at this segment's global rows.
        from relpos.ops.native import op  # noqa: F401  (registers relpos::native_attention)

        bias = _key_bias(None if mask_all is None else mask_all[:, :stop],
                         accumulation_dtype(query.dtype))
        outs.append(torch.ops.relpos.native_attention(
            q_seg, k_all[:, :, :stop], v_all[:, :, :stop], tables[0], tables[1], bias, None,
            plan.seed_at(g, 0), query_start=g, **plan.options)[0])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
