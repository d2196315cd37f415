"""The validated packed call: :class:`PackedAttentionCall` and :func:`validate_varlen_call`,
the checks of :func:`relpos.relative_attention_varlen`'s arguments.

:class:`PackedAttentionCall` was ``VarlenCall`` before 0.1; the old name is still served, with
a DeprecationWarning (the native kernels' C++ ``VarlenCall`` is another thing: a packing's
geometry and buffer sizes).

Shape legend: Tq, Tk total queries and keys, N sequences, H heads, D head dim, Dv value head
dim, R = left + right + 1 table rows; L_s, S_s the queries and the keys sequence s uses.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from relpos._deprecated import module_getattr, moved
from relpos.functional import Implementation, _check_scalars, _check_table, _check_tensor
from relpos.ops import check_implementation
from relpos.positions import check_int, check_window

__all__ = ["PackedAttentionCall", "validate_varlen_call"]


@dataclass(frozen=True)
class PackedAttentionCall:
    """One validated call of :func:`relpos.relative_attention_varlen`.

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
    def starts(self) -> tuple[list[int], list[int]]:
        """Each sequence's first query row and first key row (its region's)."""
        assert self.lengths_q is not None and self.lengths_k is not None
        regions = self.lengths_k if self.regions_k is None else self.regions_k
        return ([0, *itertools.accumulate(self.lengths_q)],
                [0, *itertools.accumulate(regions)])

    def sequence(self, s: int) -> tuple[Tensor, Tensor, Tensor]:
        """Sequence ``s``'s query, key and value as ``(1, H, L_s, D)`` views (the padded API's
        layout): the keys and values it uses, the first ``S_s`` rows of its key region."""
        assert self.lengths_q is not None and self.lengths_k is not None
        q0, k0 = self.starts[0][s], self.starts[1][s]
        L, S = self.lengths_q[s], self.lengths_k[s]
        return (self.query[q0:q0 + L].transpose(0, 1).unsqueeze(0),
                self.key[k0:k0 + S].transpose(0, 1).unsqueeze(0),
                self.value[k0:k0 + S].transpose(0, 1).unsqueeze(0))

    def padded_kwargs(self) -> dict[str, object]:
        """The keyword arguments of :func:`relpos.relative_attention` every sequence shares."""
        return dict(max_distance=(self.left, self.right), rel_keys=self.rel_keys,
                    rel_values=self.rel_values, is_causal=self.is_causal,
                    dropout_p=self.dropout_p, scale=self.scale)


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
    value = check_int(given, name, "an int or None")
    longest = max(lengths, default=0) if lengths is not None else None
    if longest is not None and value < longest:
        raise ValueError(f"{name}={value} is smaller than the longest sequence, {longest}")


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
) -> PackedAttentionCall:
    """Check the arguments of :func:`relpos.relative_attention_varlen`; the call as one object.

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
    backend = check_implementation(implementation)
    return PackedAttentionCall(
        query=q, key=k, value=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, lengths_q=lengths_q,
        lengths_k=lengths_k, left=left, right=right, rel_keys=ak, rel_values=av,
        is_causal=is_causal, dropout_p=p, scale=sc, implementation=backend,
        seqused_k=used_k, regions_k=regions_k,
    )


# Renamed in 0.1 (the C++ kernels' VarlenCall is another thing).
__getattr__ = module_getattr(__name__, {
    "VarlenCall": moved("relpos.varlen.call.PackedAttentionCall"),
})
