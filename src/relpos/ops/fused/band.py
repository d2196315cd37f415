"""The band of the fused backend: offsets ``-left < j - p_i < fr`` (``<= 0`` when causal), explicit.

(``-K < j - p_i < K`` for a clip distance K; ``fr = max(right, 1 - left)`` starts far-right.)
Tile ``t`` of a flat head holds queries ``tT .. tT + T - 1``; its window holds the ``W`` keys
from position ``first_key + tT`` on (``first_key = query_start + first_offset``), read as a
view of a zero-padded copy of the head's keys (:func:`head_windows`). Scores are
``(tiles, T, W)`` per chunk of tiles, -inf off the band; the relative-key term is added on the
band through a strided view (:func:`unskew`). Work goes one flat head (and at most
``CHUNK_ELEMS`` scores) at a time, so no temporary exceeds O(B·H·L·(T + left + right))
elements. The backward folds the overlapping windows' key and value gradients back block by
block: deterministic, no scatter with repeated indices.

:class:`BandLayout` is the geometry (plain integers), :class:`BandOperands` the tensors
prepared once per call; :func:`band_forward` and :func:`band_backward` do the work.

Shape legend: N = B·H flat heads, L queries (padded to Lp), S keys, D head dim, Dv value
head dim, K clip distance, T tile of queries, W window of keys per tile, P band table rows
(the band's offsets padded to a multiple of 8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos.ops.call import accumulation_dtype

__all__ = ["CHUNK_ELEMS", "TILE", "BandLayout", "BandOperands", "band_backward", "band_forward"]

TILE = 32
"""Queries per band tile."""
CHUNK_ELEMS = 1 << 19
"""Band scores computed at once in the backward (elements): bounds the band's temporaries.
The forward, whose peak memory is lower, takes four times as many (fewer, larger matmuls)."""

_INF = math.inf


def skew(x: Tensor, width: int, fill: float) -> Tensor:
    """``(N, T, P) -> (N, T, W)`` with ``y[n, a, a + u] = x[n, a, u]`` and ``fill`` elsewhere."""
    N, T, P = x.shape
    y = F.pad(x, (0, width + 1 - P), value=fill)  # (N, T, W + 1)
    return y.view(N, T * (width + 1))[:, : T * width].view(N, T, width)


def unskew(y: Tensor, offsets: int) -> Tensor:
    """Inverse of :func:`skew` as a view: ``(N, T, W) -> (N, T, offsets)``, ``y`` contiguous."""
    N, T, W = y.shape
    return y.as_strided((N, T, offsets), (T * W, W + 1, 1), y.storage_offset())


def pad_rows(x: Tensor, rows: int, value: float = 0.0) -> Tensor:
    """Pad dim 1 of ``x`` with ``value`` up to ``rows`` (no copy when already that long)."""
    if x.shape[1] == rows:
        return x
    pad = [0, 0] * (x.dim() - 2) + [0, rows - x.shape[1]]
    return F.pad(x, pad, value=value)


@dataclass(frozen=True)
class BandLayout:
    """Where the band's tiles and key windows lie (integers only).

    Attributes:
        query_len: L.
        key_len: S.
        left: the window's left bound (the band's table rows start at ``first_offset + left``).
        first_offset: the band's most negative offset, ``1 - left``.
        num_offsets: band offsets per query: ``1 - left .. fr - 1`` with ``fr = max(right,
            1 - left)`` the first far-right offset (``.. 0`` when causal); ``2K - 1`` (``K``
            when causal) for a symmetric window; 0 = no band.
        table_rows: P, ``num_offsets`` rounded up to a multiple of 8: matmuls with 127 rows
            run at a third of the speed of 128 on CPU, so the tables are zero-padded.
        tile: T, queries per tile.
        segments: a window spans this many blocks of T keys (``T + P - 1`` rounded up), so its
            gradient folds back block by block into contiguous slices.
        num_tiles: tiles per head, ``ceil(L / T)``.
        first_key: key position of window column 0 of tile 0.
    """

    query_len: int
    key_len: int
    left: int
    first_offset: int
    num_offsets: int
    table_rows: int
    tile: int
    segments: int
    num_tiles: int
    first_key: int

    @classmethod
    def build(
        cls, query_len: int, key_len: int, left: int, right: int, is_causal: bool,
        query_start: int,
    ) -> BandLayout:
        first = 1 - left
        last = 0 if is_causal else max(right, 1 - left) - 1
        num_offsets = max(0, last - first + 1)
        table_rows = -(-num_offsets // 8) * 8
        tile = TILE
        return cls(
            query_len=query_len, key_len=key_len, left=left, first_offset=first,
            num_offsets=num_offsets, table_rows=table_rows, tile=tile,
            segments=-(-(tile + table_rows - 1) // tile), num_tiles=-(-query_len // tile),
            first_key=query_start + first,
        )

    @property
    def window(self) -> int:
        """W, keys per tile window."""
        return self.segments * self.tile

    @property
    def padded_queries(self) -> int:
        """Lp, queries per head padded to whole tiles."""
        return self.num_tiles * self.tile

    @property
    def source_len(self) -> int:
        """Rows of a head's zero-padded key source that the windows read."""
        return (self.num_tiles + self.segments - 1) * self.tile

    @property
    def table_slice(self) -> slice:
        """Rows of a ``(Hr, R, X)`` table that the band uses."""
        start = self.first_offset + self.left
        return slice(start, start + self.num_offsets)

    def chunks(self, flat_heads: int, chunk_elems: int) -> list[tuple[int, int, int]]:
        """``(h, t0, t1)``: one flat head and a range of its tiles, at most ``chunk_elems``
        scores each, heads in order."""
        per = max(1, chunk_elems // (self.tile * self.window))
        return [(h, t0, min(self.num_tiles, t0 + per))
                for h in range(flat_heads) for t0 in range(0, self.num_tiles, per)]

    def real_source_rows(self) -> tuple[slice, slice]:
        """(source rows, key rows) of a head's window source that hold real keys."""
        m0 = max(0, -self.first_key)
        m1 = max(min(self.source_len, self.key_len - self.first_key), m0)
        return slice(m0, m1), slice(self.first_key + m0, self.first_key + m1)

    def windows(self, source: Tensor) -> Tensor:
        """Overlapping tile windows of one head's source rows, a view: ``(rows, X) ->
        (tiles, W, X)``."""
        return source.unfold(0, self.window, self.tile)[: self.num_tiles].transpose(1, 2)


@dataclass(frozen=True)
class BandOperands:
    """The band's tensors, prepared once per call.

    Attributes:
        queries: ``(N, Lp, D)`` in the accumulation dtype, zero rows past L.
        keys, values: ``(N, S, D)``, ``(N, S, Dv)`` flat views of the inputs.
        key_table: ``(Hr, P, D)`` band rows of ``rel_keys`` times ``scale``, or None.
        value_table: ``(Hr, P, Dv)`` band rows of ``rel_values``, or None.
        column_bias: ``(B|1, tiles, W)`` 0 for real keys, -inf for padding and ``key_mask``.
        tiles_with_bias: per tile, whether its window has a -inf column.
        off_band: ``(1, T, W)``: 0 on the band, -inf off it.
        num_heads: H (flat head ``h`` is batch row ``h // H``, head ``h % H``).
        scale: the score scale.
    """

    queries: Tensor
    keys: Tensor
    values: Tensor
    key_table: Tensor | None
    value_table: Tensor | None
    column_bias: Tensor
    tiles_with_bias: tuple[bool, ...]
    off_band: Tensor
    num_heads: int
    scale: float

    @classmethod
    def prepare(
        cls, layout: BandLayout, q: Tensor, k: Tensor, v: Tensor, rel_keys: Tensor | None,
        rel_values: Tensor | None, key_mask: Tensor | None, scale: float,
    ) -> BandOperands:
        B, H, L, D = q.shape
        S, Dv = k.shape[2], v.shape[-1]
        acc = accumulation_dtype(q.dtype)
        rows, pad = layout.table_slice, (0, 0, 0, layout.table_rows - layout.num_offsets)
        key_table = None if rel_keys is None else F.pad((rel_keys[:, rows] * scale).to(acc), pad)
        value_table = None if rel_values is None else F.pad(rel_values[:, rows].to(acc), pad)
        pos = layout.first_key + torch.arange(layout.source_len, device=q.device)
        valid = ((pos >= 0) & (pos < S))[None]  # (1, source rows)
        if key_mask is not None:
            valid = valid & key_mask[:, pos.clamp(0, max(S - 1, 0))]  # (B, source rows)
        win_valid = valid.unfold(1, layout.window, layout.tile)[:, : layout.num_tiles]
        column_bias = torch.zeros(win_valid.shape, dtype=acc, device=q.device).masked_fill_(
            ~win_valid, -_INF
        )  # (B|1, tiles, W)
        off_band = torch.full((1, layout.tile, layout.window), -_INF, dtype=acc, device=q.device)
        unskew(off_band, layout.num_offsets).zero_()
        return cls(
            queries=pad_rows(q.reshape(B * H, L, D).to(acc), layout.padded_queries),
            keys=k.reshape(B * H, S, D), values=v.reshape(B * H, S, Dv),
            key_table=key_table, value_table=value_table, column_bias=column_bias,
            tiles_with_bias=tuple((~win_valid).any(-1).any(0).tolist()), off_band=off_band,
            num_heads=H, scale=scale,
        )

    @property
    def acc(self) -> torch.dtype:
        return self.queries.dtype

    def table_of(self, table: Tensor, h: int) -> Tensor:
        """Flat head ``h``'s ``(P, X)`` rows of a shared or per-head band table."""
        return table[0] if table.shape[0] == 1 else table[h % self.num_heads]

    def head_windows(self, layout: BandLayout, h: int) -> tuple[Tensor, Tensor]:
        """Flat head ``h``'s key and value sources: rows ``first_key ..`` of its keys and
        values, zeros outside ``[0, S)``, ``(source rows, D|Dv)`` each."""
        return (_window_source(self.keys[h], layout.first_key, layout.source_len, self.acc),
                _window_source(self.values[h], layout.first_key, layout.source_len, self.acc))


def _window_source(x_SX: Tensor, start: int, length: int, dtype: torch.dtype) -> Tensor:
    """Rows ``start .. start + length - 1`` of one head's ``(S, X)`` rows, zeros outside."""
    S, X = x_SX.shape
    lo, hi = max(start, 0), min(start + length, S)
    core = x_SX[lo : max(hi, lo)]
    left = min(length, max(0, -start))
    src = torch.empty(length, X, dtype=dtype, device=x_SX.device)
    src[:left].zero_()
    src[left + core.shape[0] :].zero_()
    src[left : left + core.shape[0]] = core
    return src


def band_scores(
    layout: BandLayout, ops: BandOperands, key_source: Tensor, h: int, t0: int, t1: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Scores of tiles ``[t0, t1)`` of flat head ``h``, -inf off the band.

    Returns:
        ``scores (tiles, T, W)``, the tiles' queries ``(tiles, T, D)`` and key windows
        ``(tiles, W, D)``.
    """
    T, P = layout.tile, layout.table_rows
    D = ops.queries.shape[-1]
    q_tiles = ops.queries[h, t0 * T : t1 * T].view(t1 - t0, T, D)  # (tiles, T, D)
    key_windows = layout.windows(key_source)[t0:t1]  # (tiles, W, D)
    s = torch.baddbmm(ops.off_band, q_tiles, key_windows.transpose(1, 2), alpha=ops.scale)
    if ops.key_table is not None:
        rel = torch.mm(q_tiles.view(-1, D), ops.table_of(ops.key_table, h).t())  # (tiles*T, P)
        unskew(s, P).add_(rel.view(t1 - t0, T, P))
    need = ops.tiles_with_bias[t0:t1]
    if any(need):
        bias = ops.column_bias[0 if ops.column_bias.shape[0] == 1 else h // ops.num_heads, t0:t1]
        if all(need):
            s += bias[:, None, :]
        else:
            for t, flag in enumerate(need):
                if flag:
                    s[t] += bias[t, None, :]
    return s, q_tiles, key_windows


def band_forward(layout: BandLayout, ops: BandOperands) -> tuple[Tensor, Tensor, Tensor]:
    """Unnormalized band output, its row log-scale and the band log-mass.

    Returns:
        ``o (N, Lp, Dv)``, ``m (N, Lp)`` and ``z (N, Lp)``: the band's share of the output is
        ``o * exp(m - LSE)`` and its log-mass ``z`` (-inf = no band key).
    """
    N, T, P = ops.queries.shape[0], layout.tile, layout.table_rows
    Lp, Dv, acc, dev = layout.padded_queries, ops.values.shape[-1], ops.acc, ops.queries.device
    out = torch.empty(N, Lp, Dv, dtype=acc, device=dev)
    row_max = torch.empty(N, Lp, dtype=acc, device=dev)
    row_sum = torch.empty(N, Lp, dtype=acc, device=dev)
    low = torch.finfo(acc).min
    source_head = -1
    for h, t0, t1 in layout.chunks(N, CHUNK_ELEMS * 4):
        if h != source_head:
            key_source, value_source = ops.head_windows(layout, h)
            source_head = h
        rows = slice(t0 * T, t1 * T)
        s, _, _ = band_scores(layout, ops, key_source, h, t0, t1)
        m = s.amax(-1, keepdim=True).clamp_(min=low)  # (tiles, T, 1); finite
        p = s.sub_(m).exp_()  # (tiles, T, W): probabilities up to a per-row factor
        o_h = out[h, rows]  # (tiles*T, Dv), contiguous
        torch.bmm(p, layout.windows(value_source)[t0:t1], out=o_h.view(t1 - t0, T, Dv))
        torch.sum(p, -1, out=row_sum[h, rows].view(t1 - t0, T))
        row_max[h, rows] = m.view(-1)
        if ops.value_table is not None:
            p_band = unskew(p, P).contiguous().view(-1, P)  # (tiles*T, P)
            o_h.addmm_(p_band, ops.table_of(ops.value_table, h))
    return out, row_max, row_sum.log_().add_(row_max)


def band_backward(
    layout: BandLayout, ops: BandOperands, grad_out: Tensor, lse: Tensor, delta: Tensor,
    dk: Tensor, dv: Tensor,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Band gradients, with the global probabilities ``P = exp(s - LSE)``.

    Args:
        grad_out: ``(N, Lp, Dv)``.
        lse: ``(N, Lp)`` merged logsumexp (+inf = no key).
        delta: ``(N, Lp)``, ``grad_out_i . out_i``.
        dk: ``(N, S, D)`` key gradient, the band's share is added in place.
        dv: ``(N, S, Dv)`` value gradient, likewise.

    Returns:
        ``dq (N, Lp, D)``, the band's row sums of dS ``(N, Lp)`` and the per-head table
        gradients of the band rows ``(H, num_offsets, D|Dv)`` (None when the term is off).
    """
    N, T, P = ops.queries.shape[0], layout.tile, layout.table_rows
    D, Dv, H = ops.queries.shape[-1], ops.values.shape[-1], ops.num_heads
    dev, acc, Lp = grad_out.device, ops.acc, layout.padded_queries
    dq = torch.zeros(N, Lp, D, dtype=acc, device=dev)
    ds_sum = torch.zeros(N, Lp, dtype=acc, device=dev)
    dk_src = torch.zeros(layout.source_len, D, dtype=acc, device=dev)
    dv_src = torch.zeros(layout.source_len, Dv, dtype=acc, device=dev)
    dak = None if ops.key_table is None else torch.zeros(H, P, D, dtype=acc, device=dev)
    dav = None if ops.value_table is None else torch.zeros(H, P, Dv, dtype=acc, device=dev)
    dk_blocks = dk_src.view(-1, T, D)  # source rows in blocks of T
    dv_blocks = dv_src.view(-1, T, Dv)
    real_src, real_keys = layout.real_source_rows()
    chunks = layout.chunks(N, CHUNK_ELEMS)
    source_head = -1
    for n, (h, t0, t1) in enumerate(chunks):
        if h != source_head:
            key_source, value_source = ops.head_windows(layout, h)
            source_head = h
        tiles = t1 - t0
        rows = slice(t0 * T, t1 * T)
        s, q_tiles, key_windows = band_scores(layout, ops, key_source, h, t0, t1)
        p = s.sub_(lse[h, rows].view(tiles, T, 1)).exp_()  # (tiles, T, W): global P
        go = grad_out[h, rows].view(tiles, T, Dv)
        value_windows = layout.windows(value_source)[t0:t1]  # (tiles, W, Dv)
        # dP - delta = grad_out . (v_j + rel_values[r]) - delta
        ds = torch.baddbmm(-delta[h, rows].view(tiles, T, 1), go, value_windows.transpose(1, 2))
        if ops.value_table is not None:
            rel = torch.mm(go.view(-1, Dv), ops.table_of(ops.value_table, h).t())  # (tiles*T, P)
            unskew(ds, P).add_(rel.view(tiles, T, P))
        ds = ds.mul_(p)  # (tiles, T, W): dS
        ds_sum[h, rows] = ds.sum(-1).view(-1)
        dq_tiles = dq[h, rows].view(tiles, T, D)
        dq_tiles.baddbmm_(ds, key_windows, alpha=ops.scale)
        if ops.key_table is not None:
            assert dak is not None
            ds_band = unskew(ds, P).contiguous().view(-1, P)  # (tiles*T, P)
            dq_tiles.view(-1, D).addmm_(ds_band, ops.table_of(ops.key_table, h))
            dak[h % H].addmm_(ds_band.t(), q_tiles.view(-1, D), alpha=ops.scale)
        if ops.value_table is not None:
            assert dav is not None
            p_band = unskew(p, P).contiguous().view(-1, P)
            dav[h % H].addmm_(p_band.t(), go.view(-1, Dv))
        # Windows overlap: add them block by block (T source rows), deterministically.
        for seg in range(layout.segments):
            cols = slice(seg * T, (seg + 1) * T)
            blocks = slice(t0 + seg, t1 + seg)
            dk_blocks[blocks].baddbmm_(ds[:, :, cols].transpose(1, 2), q_tiles, alpha=ops.scale)
            dv_blocks[blocks].baddbmm_(p[:, :, cols].transpose(1, 2), go)
        if n + 1 == len(chunks) or chunks[n + 1][0] != h:  # head done: hand over dk, dv
            dk[h, real_keys] += dk_src[real_src]
            dv[h, real_keys] += dv_src[real_src]
            dk_src.zero_()
            dv_src.zero_()
    used = layout.num_offsets
    return (dq, ds_sum, None if dak is None else dak[:, :used],
            None if dav is None else dav[:, :used])
