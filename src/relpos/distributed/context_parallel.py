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
``[0, g + L_seg)``. The ring mode is not built yet.

Table gradients are this rank's partial sums: nothing here all-reduces them. DDP or FSDP
reduce them like every other weight's gradient (the sum over ranks is the single-process
gradient).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from relpos.functional import relative_attention, validate_call

__all__ = ["LAYOUTS", "MODES", "context_parallel_attention", "shard_sequence", "unshard_sequence"]

#: The layouts of a sharded sequence.
LAYOUTS: tuple[str, ...] = ("contiguous", "head_tail")
#: The modes of :func:`context_parallel_attention` that are built.
MODES: tuple[str, ...] = ("all_gather",)

#: Device types each backend serves (a backend not named here is not checked).
_BACKEND_DEVICES: dict[str, frozenset[str]] = {
    "gloo": frozenset({"cpu"}),
    "mpi": frozenset({"cpu"}),
    "nccl": frozenset({"cuda"}),
    "xccl": frozenset({"xpu"}),
}

_MAX_DIMS = 10  # dims of a tensor that unshard_sequence checks across ranks


def _check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return str(layout)


def _chunks(layout: str, world: int) -> int:
    return world if layout == "contiguous" else 2 * world


def _local_chunks(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The global chunk indices this rank holds, in the order it holds them."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def _initialized_group(group: Any) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group "
            "first (or pass rank= and world_size= to shard_sequence)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _check_device(t: Tensor, group: Any) -> None:
    backend = str(dist.get_backend(group))
    allowed: set[str] = set()
    for part in backend.split(","):
        if ":" in part:  # "cpu:gloo,cuda:nccl"
            allowed.add(part.split(":", 1)[0].strip())
        elif part.strip() in _BACKEND_DEVICES:
            allowed |= _BACKEND_DEVICES[part.strip()]
        else:
            return  # a backend this module does not know: let it answer
    if t.device.type not in allowed:
        raise ValueError(
            f"tensors are on {t.device}, but the process group's backend {backend!r} serves "
            f"only {sorted(allowed)} tensors"
        )


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


def _gather_meta(values: list[int], device: torch.device, group: Any, world: int) -> list[
    list[int]
]:
    """One small all_gather of a few integers per rank (shapes, dtypes), before a big one."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [p.tolist() for p in parts]


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
    tensors (padding masks) are gathered as uint8. Every rank must pass the same shape and
    dtype (checked with one small all-gather first, so no rank hangs)."""
    layout = _check_layout(layout)
    rank, world = _initialized_group(group)
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"unshard_sequence takes up to {_MAX_DIMS} dims, got {x.dim()}")
    dim = dim % max(x.dim(), 1)
    _check_device(x, group)
    if world == 1:
        return x
    shape = list(x.shape) + [0] * (_MAX_DIMS - x.dim())
    meta = _gather_meta([x.dim(), _code(str(x.dtype)), *shape], x.device, group, world)
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
) -> Tensor:
    """Shaw attention over a sequence sharded across the ranks of ``group`` (self-attention).

    Each rank passes its shard of the queries, keys and values ``(B, H, n_local, D)`` (values
    ``(B, H, n_local, Dv)``) and of ``key_mask`` ``(B, n_local)`` (True = real token), cut as
    ``layout`` says (:func:`shard_sequence`); every rank the same ``n_local``. Returns this
    rank's rows ``(B, H, n_local, Dv)`` of :func:`~relpos.functional.relative_attention` over
    the whole sequence of ``n = P * n_local`` positions, and its gradients in the backward.
    The other arguments mean what they mean there.

    ``mode="all_gather"``: one all-gather of the keys and values (and key mask) per call, one
    reduce-scatter-equivalent in the backward (an all-reduce and a slice on gloo). Gradients
    of ``rel_keys``/``rel_values`` are this rank's partial sums, not all-reduced here: DDP or
    FSDP reduce them like any other weight. A group of one rank runs the local call.

    Raises:
        ValueError: ``mode`` other than ``"all_gather"`` (ring is not built yet), ``dropout_p
            > 0`` (the kernels key their dropout stream by local rows, so it would not equal a
            single-process run), an unknown layout, shards that differ across ranks or that the
            layout cannot split, tensors on a device the group's backend does not serve, and
            every bad input that ``relative_attention`` refuses.
        RuntimeError: torch.distributed not initialized.
    """
    if mode not in MODES:
        raise ValueError(
            f"mode must be one of {MODES}, got {mode!r} (the ring mode is not built yet)"
        )
    layout = _check_layout(layout)
    if isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) and dropout_p > 0:
        raise ValueError(
            f"context_parallel_attention takes dropout_p=0.0 only, got {dropout_p}: the kernels "
            "key their dropout stream by local rows, so sharded dropout would not equal the "
            "single-process run (apply dropout outside attention, or run without it)"
        )
    rank, world = _initialized_group(group)
    # Every local argument checked before any collective (is_causal, tables, shapes, dtypes).
    validate_call(query, key, value, max_distance=max_distance, rel_keys=rel_keys,
                  rel_values=rel_values, key_mask=key_mask, is_causal=is_causal,
                  dropout_p=dropout_p, scale=scale)
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"context_parallel_attention is self-attention: query and key shards need one "
            f"length, got {query.shape[2]} and {key.shape[2]}"
        )
    _check_device(query, group)
    kwargs: dict[str, Any] = dict(max_distance=max_distance, rel_keys=rel_keys,
                                  rel_values=rel_values, is_causal=is_causal, scale=scale)
    if world == 1:
        return relative_attention(query, key, value, key_mask=key_mask, **kwargs)

    B, H, n_local, D = query.shape
    Dv = value.shape[3]
    meta = _gather_meta(
        [n_local, B, H, D, Dv, key_mask is not None, _code(str(query.dtype))],
        query.device, group, world,
    )
    lengths = [m[0] for m in meta]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"layout {layout!r} needs one shard length on every rank, got n_local by rank "
            f"{lengths}: shard a sequence whose length is a multiple of "
            f"{_chunks(layout, world)} with shard_sequence"
        )
    if any(m != meta[0] for m in meta):
        dtypes = "equal" if len({m[6] for m in meta}) == 1 else "differ"
        raise ValueError(
            "the ranks' shards differ in (n_local, B, H, D, Dv, key_mask given): "
            f"{[m[:6] for m in meta]} by rank (dtypes {dtypes}); all must match"
        )
    if layout == "head_tail" and n_local % 2:
        raise ValueError(
            f"layout 'head_tail' holds two equal chunks per rank, got odd n_local={n_local}: "
            f"the sequence length must be a multiple of 2P = {2 * world}"
        )

    # One collective for keys, values and the key mask: concatenated on the last dim.
    pieces = [key, value]
    if key_mask is not None:
        pieces.append(key_mask.to(key.dtype)[:, None, :, None].expand(B, H, n_local, 1))
    parts = _AllGather.apply(torch.cat(pieces, dim=-1), group, rank, world)
    full = _reorder(parts, dim=2, layout=layout, world=world)  # (B, H, n, D + Dv [+ 1])
    k_all, v_all = full[..., :D], full[..., D:D + Dv]
    mask_all = None if key_mask is None else full[:, 0, :, D + Dv] > 0.5

    chunks = _chunks(layout, world)
    c = (n_local * world) // chunks
    outs = []
    for i, g_chunk in enumerate(_local_chunks(layout, rank, world)):
        g = g_chunk * c  # global position of this segment's first query
        q_seg = query[:, :, i * c:(i + 1) * c]
        stop = g + c if is_causal else n_local * world  # keys after the segment stay hidden
        outs.append(relative_attention(
            q_seg, k_all[:, :, :stop], v_all[:, :, :stop],
            key_mask=None if mask_all is None else mask_all[:, :stop], query_start=g, **kwargs,
        ))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
