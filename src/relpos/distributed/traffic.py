"""What context-parallel attention sends over the network: :func:`traffic` (the formula of
docs/scaling.md) and :func:`count_traffic` (a count of the ``torch.distributed`` calls a piece
of code makes, and of the bytes they bring into this rank)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from relpos.distributed._checks import META_INTS, MODES
from relpos.ops._numerics import accumulation_dtype

__all__ = ["Traffic", "TrafficCounter", "count_traffic", "traffic"]


@dataclass(frozen=True)
class Traffic:
    """What one :func:`context_parallel_attention` call sends over the network, per rank.

    ``calls``: the ``torch.distributed`` calls by name, forward and backward
    (``all_gather``, ``batch_isend_irecv``, ``reduce_scatter_tensor``, ``all_reduce``).
    ``forward_bytes`` / ``backward_bytes``: the bytes one rank receives: exact for the
    point-to-point sends of ring mode; for a collective, what a bandwidth-optimal (ring)
    algorithm moves into each rank, as NCCL's do: an all-gather or a reduce-scatter of ``P``
    shards of ``s`` bytes ``(P-1)·s``, an all-reduce of ``N`` bytes ``2(P-1)/P·N``.
    """

    forward_calls: dict[str, int]
    backward_calls: dict[str, int]
    forward_bytes: int
    backward_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


def traffic(mode: str, *, world: int, batch: int, heads: int, n_local: int, head_dim: int,
            value_dim: int | None = None, key_mask: bool = False,
            dtype: torch.dtype = torch.float32, backend: str = "nccl",
            head_group: int | None = None) -> Traffic:
    """The :class:`Traffic` of one call of ``mode`` on ``world`` ranks, each holding
    ``(batch, heads, n_local, head_dim)`` queries and keys and ``value_dim`` values, in
    ``dtype`` (the shards travel in it; ring mode's key/value gradients in the accumulation
    dtype: float32 for half precision).

    With ``E = batch·heads·n_local·(head_dim + value_dim)`` elements of keys and values per
    rank, ``P = world``:

    - ``all_gather``: forward ``(P-1)·E'`` with ``E' = E + batch·heads·n_local`` when there is
      a key mask (one column more), else ``E``; backward ``(P-1)·E'`` (a reduce-scatter; on
      gloo, which has none, an all-reduce: ``2(P-1)·E'``). With ``head_group=G < H`` the
      same bytes go in ``ceil(H/G)`` gathers, and the backward gathers them again first
      (``(P-1)·E'`` more, in as many calls).
    - ``ring``: forward ``(P-1)·(E + M)``, ``M = batch·n_local`` with a key mask, else 0;
      backward ``(P-1)·(E + M) + P·E`` (the shards go round again, and their gradients go
      round a second ring: ``P`` hops, the last one home). Shards are sent in ``dtype``, the
      gradients in its accumulation dtype (float32 for bfloat16 and float16: the ``P·E``
      term's elements are twice as large as the shards').

    Both add one all-gather of ``META_INTS`` (30) int64 per rank first (the shapes and every
    option the ranks must agree on, the dropout seed), ``(P-1)·240`` bytes.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    P = int(world)
    dv = head_dim if value_dim is None else value_dim
    E = batch * heads * n_local * (head_dim + dv)
    meta = (P - 1) * META_INTS * 8
    if P == 1:
        return Traffic({}, {}, 0, 0)
    if mode == "all_gather":
        size = torch.empty((), dtype=dtype).element_size()
        piece = (E + (batch * heads * n_local if key_mask else 0)) * size
        groups = 1 if head_group is None or head_group >= heads else -(-heads // head_group)
        if "nccl" in backend:
            back, back_calls = (P - 1) * piece, {"reduce_scatter_tensor": groups}
        else:
            back, back_calls = 2 * (P - 1) * piece, {"all_reduce": groups}
        if groups > 1:  # the backward gathers each group again first
            back, back_calls = back + (P - 1) * piece, {"all_gather": groups, **back_calls}
        return Traffic({"all_gather": 1 + groups}, back_calls, meta + (P - 1) * piece, back)
    size = torch.empty((), dtype=dtype).element_size()
    grad_size = torch.empty((), dtype=accumulation_dtype(dtype)).element_size()
    hop = (E + (batch * n_local if key_mask else 0)) * size
    return Traffic({"all_gather": 1, "batch_isend_irecv": P - 1},
                   {"batch_isend_irecv": 2 * P - 1},
                   meta + (P - 1) * hop, (P - 1) * hop + P * E * grad_size)


class TrafficCounter:
    """Counts the ``torch.distributed`` calls made while it is on (``calls``, by name) and
    the bytes they bring into this rank (``bytes``): exact for point-to-point receives; for
    collectives by the convention of :class:`Traffic` (a bandwidth-optimal ring algorithm's
    volume per rank). Made by :func:`count_traffic`."""

    NAMES = ("all_gather", "batch_isend_irecv", "reduce_scatter_tensor", "all_reduce")

    def __init__(self, world: int) -> None:
        self.world = world
        self.calls: dict[str, int] = {}
        self.bytes = 0
        self._saved = {name: getattr(dist, name) for name in self.NAMES}

    def _count(self, name: str, received: int) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.bytes += received

    def __enter__(self) -> TrafficCounter:
        P, real = self.world, self._saved

        def nbytes(t: Tensor) -> int:
            return t.numel() * t.element_size()

        def all_gather(parts: list[Tensor], x: Tensor, *a: Any, **kw: Any) -> Any:
            self._count("all_gather", (P - 1) * nbytes(x))
            return real["all_gather"](parts, x, *a, **kw)

        def batch_isend_irecv(ops: list[Any]) -> Any:
            self._count("batch_isend_irecv",
                        sum(nbytes(op.tensor) for op in ops if op.op is dist.irecv))
            return real["batch_isend_irecv"](ops)

        def reduce_scatter_tensor(out: Tensor, x: Tensor, *a: Any, **kw: Any) -> Any:
            self._count("reduce_scatter_tensor", (P - 1) * nbytes(out))
            return real["reduce_scatter_tensor"](out, x, *a, **kw)

        def all_reduce(x: Tensor, *a: Any, **kw: Any) -> Any:
            self._count("all_reduce", 2 * (P - 1) * nbytes(x) // P)
            return real["all_reduce"](x, *a, **kw)

        for name, fn in (("all_gather", all_gather), ("batch_isend_irecv", batch_isend_irecv),
                         ("reduce_scatter_tensor", reduce_scatter_tensor),
                         ("all_reduce", all_reduce)):
            setattr(dist, name, fn)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def count_traffic(world: int) -> TrafficCounter:
    """A context manager that counts the ``torch.distributed`` calls made inside it
    (``all_gather``, ``batch_isend_irecv``, ``reduce_scatter_tensor``, ``all_reduce``) and
    the bytes they bring into this rank, by the convention of :class:`Traffic`, in a group of
    ``world`` ranks: ``with count_traffic(P) as c: ...``, then ``c.calls``, ``c.bytes``.
    It replaces those functions of ``torch.distributed`` while it is on (one thread)."""
    return TrafficCounter(world)
