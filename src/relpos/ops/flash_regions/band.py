"""The band of the flash_regions backend: offsets ``-left < j - p_i < fr`` (``<= 0`` when
causal), explicit.

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

from relpos.ops._numerics import accumulation_dtype, exp_

__all__ = [
    "CHUNK_ELEMS", "TILE", "TILE_NARROW", "BandLayout", "BandOperands", "band_backward",
    "band_forward",
]

TILE = 32
"""Queries per band tile."""
TILE_NARROW = 16
"""Queries per band tile of a causal band with at most this many offsets (K <= 16): a
tile's window then spans two blocks of 16 keys instead of two of 32, half the scores
computed off the band (3-12% faster at n = 256-4096; for non-causal bands of K <= 8 it
measured within +-3%, so they keep ``TILE``)."""
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
        tile = min(TILE, TILE_NARROW) if is_causal and table_rows <= TILE_NARROW else TILE
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

    def chunks(
        self, flat_heads: int, chunk_elems: int, num_heads: int
    ) -> list[tuple[int, int, int, int]]:
        """``(h0, h1, t0, t1)``: flat heads ``[h0, h1)`` and their tiles ``[t0, t1)``, at most
        ``chunk_elems`` scores each, in order. Short sequences take several heads per chunk (all
        their tiles, so a chunk is one batched matmul, not a Python loop over B·H); a group is a
        multiple of H or a divisor of it, so it never straddles heads unevenly."""
        per = max(1, chunk_elems // (self.tile * self.window))  # tiles per chunk
        if per >= 2 * self.num_tiles and flat_heads > 1:
            group = min(flat_heads, per // self.num_tiles)
            if group >= num_heads:
                group -= group % num_heads
            else:
                group = max(d for d in range(1, group + 1) if num_heads % d == 0)
            return [(h0, min(flat_heads, h0 + group), 0, self.num_tiles)
                    for h0 in range(0, flat_heads, group)]
        return [(h, h + 1, t0, min(self.num_tiles, t0 + per))
                for h in range(flat_heads) for t0 in range(0, self.num_tiles, per)]

    def real_source_rows(self) -> tuple[slice, slice]:
        """(source rows, key rows) of a head's window source that hold real keys."""
        m0 = max(0, -self.first_key)
        m1 = max(min(self.source_len, self.key_len - self.first_key), m0)
        return slice(m0, m1), slice(self.first_key + m0, self.first_key + m1)

    def windows(self, source: Tensor, t0: int, t1: int) -> Tensor:
        """Tile windows ``[t0, t1)`` of a group's source rows: ``(G, rows, X) ->
        (G * tiles, W, X)``; a view for one head, a copy for several."""
        tiled = source.unfold(1, self.window, self.tile)[:, t0:t1].transpose(-1, -2)
        if source.shape[0] == 1:
            return tiled[0]
        return tiled.reshape(-1, self.window, source.shape[-1])


@dataclass(frozen=True)
class BandOperands:
    """The band's tensors, prepared once per call.

    Attributes:
        queries: ``(N, Lp, D)`` in the accumulation dtype, zero rows past L.
        keys, values: ``(N, S, D)``, ``(N, S, Dv)`` flat views of the inputs.
        key_table: ``(Hr, P, D)`` band rows of ``rel_keys`` times ``scale``, or None.
        value_table: ``(Hr, P, Dv)`` band rows of ``rel_values``, or None.
        column_hidden: ``(B|1, tiles, W)`` True for padding and keys hidden by ``key_mask``
            (their scores are filled with -inf, so a non-finite table row or hidden key
            reaches no row through them).
        tiles_with_bias: per tile, whether its window has a hidden column.
        value_rows_bad: ``(Hr, P)`` True for band rows of ``rel_values`` with a non-finite
            entry, or None when every row is finite (the common case).
        off_band: ``(1, T, W)``: 0 on the band, -inf off it.
        num_heads: H (flat head ``h`` is batch row ``h // H``, head ``h % H``).
        scale: the score scale.
    """

    queries: Tensor
    keys: Tensor
    values: Tensor
    key_table: Tensor | None
    value_table: Tensor | None
    column_hidden: Tensor
    tiles_with_bias: tuple[bool, ...]
    value_rows_bad: Tensor | None
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
        column_hidden = ~win_valid  # (B|1, tiles, W)
        value_rows_bad = None
        if value_table is not None and not bool(value_table.isfinite().all()):
            value_rows_bad = ~value_table.isfinite().all(-1)  # (Hr, P)
            value_table = value_table.nan_to_num(0.0, 0.0, 0.0)
        off_band = torch.full((1, layout.tile, layout.window), -_INF, dtype=acc, device=q.device)
        unskew(off_band, layout.num_offsets).zero_()
        return cls(
            queries=pad_rows(q.reshape(B * H, L, D).to(acc), layout.padded_queries),
            keys=k.reshape(B * H, S, D), values=v.reshape(B * H, S, Dv),
            key_table=key_table, value_table=value_table, column_hidden=column_hidden,
            tiles_with_bias=tuple(column_hidden.any(-1).any(0).tolist()),
            value_rows_bad=value_rows_bad, off_band=off_band,
            num_heads=H, scale=scale,
        )

    @property
    def acc(self) -> torch.dtype:
        return self.queries.dtype

    def tables_of(self, table: Tensor, h0: int, h1: int) -> Tensor:
        """The ``(1 | G, P, X)`` band table rows of flat heads ``[h0, h1)``: one shared table,
        or one per head (a group never straddles heads unevenly, see ``chunks``)."""
        if table.shape[0] == 1:
            return table
        heads = torch.arange(h0, h1, device=table.device) % self.num_heads
        return table.index_select(0, heads)

    def head_windows(self, layout: BandLayout, h0: int, h1: int) -> tuple[Tensor, Tensor]:
        """Flat heads ``[h0, h1)``'s key and value sources: rows ``first_key ..`` of their keys
        and values, zeros outside ``[0, S)``, ``(G, source rows, D|Dv)`` each."""
        return (_window_source(self.keys[h0:h1], layout.first_key, layout.source_len, self.acc),
                _window_source(self.values[h0:h1], layout.first_key, layout.source_len,
                               self.acc))


def _window_source(x_GSX: Tensor, start: int, length: int, dtype: torch.dtype) -> Tensor:
    """Rows ``start .. start + length - 1`` of a group's ``(G, S, X)`` rows, zeros outside."""
    G, S, X = x_GSX.shape
    lo, hi = max(start, 0), min(start + length, S)
    core = x_GSX[:, lo : max(hi, lo)]
    left = min(length, max(0, -start))
    src = torch.empty(G, length, X, dtype=dtype, device=x_GSX.device)
    src[:, :left].zero_()
    src[:, left + core.shape[1] :].zero_()
    src[:, left : left + core.shape[1]] = core
    return src


def _times_tables(x: Tensor, tables: Tensor, G: int, transpose: bool) -> Tensor:
    """``x @ table`` (``table.T`` if ``transpose``) per head of a group: ``x (G * rows, A)``
    against ``tables (1 | G, A|C, C|A)``, returning ``(G * rows, C)``."""
    tab = tables.transpose(1, 2) if transpose else tables
    if tab.shape[0] == 1:
        return torch.mm(x, tab[0])
    return torch.bmm(x.view(G, -1, x.shape[-1]), tab).view(x.shape[0], -1)


def _add_per_head(grad: Tensor, contrib: Tensor, h0: int) -> None:
    """Add per-flat-head contributions ``(G, P, X)`` of heads ``[h0, h0 + G)`` into the
    ``(H, P, X)`` per-head gradient, deterministically."""
    H, G = grad.shape[0], contrib.shape[0]
    if G >= H:
        grad += contrib.view(G // H, H, *contrib.shape[1:]).sum(0)
    else:
        grad[h0 % H : h0 % H + G] += contrib


def band_scores(
    layout: BandLayout, ops: BandOperands, key_source: Tensor, h0: int, h1: int, t0: int,
    t1: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Scores of tiles ``[t0, t1)`` of flat heads ``[h0, h1)``, -inf off the band.

    Returns:
        ``scores (G * tiles, T, W)``, the tiles' queries ``(G * tiles, T, D)`` and key windows
        ``(G * tiles, W, D)``.
    """
    T, P, G, tiles = layout.tile, layout.table_rows, h1 - h0, t1 - t0
    D = ops.queries.shape[-1]
    q_tiles = ops.queries[h0:h1, t0 * T : t1 * T].reshape(G * tiles, T, D)
    key_windows = layout.windows(key_source, t0, t1)  # (G * tiles, W, D)
    # bmm, then one pass for the scale and the off-band -inf: baddbmm with a broadcast input
    # first copies it into every tile, then multiplies (about 1.5x the time on CPU).
    s = torch.bmm(q_tiles, key_windows.transpose(1, 2))
    s = torch.add(ops.off_band, s, alpha=ops.scale, out=s)
    if ops.key_table is not None:
        tables = ops.tables_of(ops.key_table, h0, h1)
        rel = _times_tables(q_tiles.view(-1, D), tables, G, transpose=True)  # (G*tiles*T, P)
        unskew(s, P).add_(rel.view(G * tiles, T, P))
    need = ops.tiles_with_bias[t0:t1]
    if any(need):
        ch = ops.column_hidden
        if ch.shape[0] > 1:  # per batch row: flat head h is batch row h // H
            ch = ch.index_select(0, torch.arange(h0, h1, device=ch.device) // ops.num_heads)
        hidden = ch[:, t0:t1]  # (1 | G, tiles, W)
        if G > 1 or all(need):
            s.view(G, tiles, T, -1).masked_fill_(hidden[:, :, None, :], -_INF)
        else:
            for t, flag in enumerate(need):
                if flag:
                    s[t].masked_fill_(hidden[0, t, None, :], -_INF)
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
    group = (-1, -1)
    for h0, h1, t0, t1 in layout.chunks(N, CHUNK_ELEMS * 4, ops.num_heads):
        if (h0, h1) != group:
            key_source, value_source = ops.head_windows(layout, h0, h1)
            group = (h0, h1)
        G, tiles, rows = h1 - h0, t1 - t0, slice(t0 * T, t1 * T)
        s, _, _ = band_scores(layout, ops, key_source, h0, h1, t0, t1)
        m = s.amax(-1, keepdim=True).clamp_(min=low)  # (G*tiles, T, 1); finite
        p = exp_(s.sub_(m))  # (G*tiles, T, W): probabilities up to a per-row factor
        o = out[h0:h1, rows]  # (G, tiles*T, Dv), contiguous (a group spans whole heads)
        torch.bmm(p, layout.windows(value_source, t0, t1), out=o.view(G * tiles, T, Dv))
        torch.sum(p, -1, out=row_sum[h0:h1, rows].view(G * tiles, T))
        row_max[h0:h1, rows] = m.view(G, -1)
        if ops.value_table is not None:
            p_band = unskew(p, P).contiguous().view(-1, P)  # (G*tiles*T, P)
            tables = ops.tables_of(ops.value_table, h0, h1)
            o.view(-1, Dv).add_(_times_tables(p_band, tables, G, transpose=False))
            if ops.value_rows_bad is not None:  # NaN where a row sees a key at a bad offset
                bad = ops.tables_of(ops.value_rows_bad[..., None], h0, h1)[..., 0]  # (1|G, P)
                reads = (p_band.view(G, -1, P) > 0) & bad[:, None, :]
                o.masked_fill_(reads.any(-1)[..., None], math.nan)
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
    dak = None if ops.key_table is None else torch.zeros(H, P, D, dtype=acc, device=dev)
    dav = None if ops.value_table is None else torch.zeros(H, P, Dv, dtype=acc, device=dev)
    real_src, real_keys = layout.real_source_rows()
    chunks = layout.chunks(N, CHUNK_ELEMS, H)
    group = (-1, -1)
    for n, (h0, h1, t0, t1) in enumerate(chunks):
        G, tiles, rows = h1 - h0, t1 - t0, slice(t0 * T, t1 * T)
        if (h0, h1) != group:
            key_source, value_source = ops.head_windows(layout, h0, h1)
            dk_src = torch.zeros(G, layout.source_len, D, dtype=acc, device=dev)
            dv_src = torch.zeros(G, layout.source_len, Dv, dtype=acc, device=dev)
            group = (h0, h1)
        s, q_tiles, key_windows = band_scores(layout, ops, key_source, h0, h1, t0, t1)
        p = exp_(s.sub_(lse[h0:h1, rows].reshape(G * tiles, T, 1)))  # global P
        go = grad_out[h0:h1, rows].reshape(G * tiles, T, Dv)
        value_windows = layout.windows(value_source, t0, t1)  # (G*tiles, W, Dv)
        # dP - delta = grad_out . (v_j + rel_values[r]) - delta
        ds = torch.bmm(go, value_windows.transpose(1, 2)).sub_(
            delta[h0:h1, rows].reshape(G * tiles, T, 1))
        if ops.value_table is not None:
            v_tables = ops.tables_of(ops.value_table, h0, h1)
            rel = _times_tables(go.view(-1, Dv), v_tables, G, transpose=True)  # (G*tiles*T, P)
            unskew(ds, P).add_(rel.view(G * tiles, T, P))
        ds = ds.mul_(p)  # (G*tiles, T, W): dS
        ds_sum[h0:h1, rows] = ds.sum(-1).view(G, -1)
        dq_tiles = dq[h0:h1, rows].view(G * tiles, T, D)  # contiguous: whole heads or one head
        dq_tiles.baddbmm_(ds, key_windows, alpha=ops.scale)
        if ops.key_table is not None:
            assert dak is not None
            ds_band = unskew(ds, P).contiguous().view(-1, P)  # (G*tiles*T, P)
            k_tables = ops.tables_of(ops.key_table, h0, h1)
            dq_tiles.view(-1, D).add_(_times_tables(ds_band, k_tables, G, transpose=False))
            contrib = torch.bmm(ds_band.view(G, -1, P).transpose(1, 2), q_tiles.view(G, -1, D))
            _add_per_head(dak, contrib.mul_(ops.scale), h0)
        if ops.value_table is not None:
            assert dav is not None
            p_band = unskew(p, P).contiguous().view(-1, P)
            _add_per_head(dav, torch.bmm(p_band.view(G, -1, P).transpose(1, 2),
                                         go.view(G, -1, Dv)), h0)
        # Windows overlap: add them block by block (T source rows), deterministically.
        dk_blocks = dk_src.view(G, -1, T, D)
        dv_blocks = dv_src.view(G, -1, T, Dv)
        for seg in range(layout.segments):
            cols = slice(seg * T, (seg + 1) * T)
            blocks = slice(t0 + seg, t1 + seg)
            if G == 1:
                dk_blocks[0, blocks].baddbmm_(ds[:, :, cols].transpose(1, 2), q_tiles,
                                              alpha=ops.scale)
                dv_blocks[0, blocks].baddbmm_(p[:, :, cols].transpose(1, 2), go)
            else:
                dk_part = torch.bmm(ds[:, :, cols].transpose(1, 2), q_tiles).mul_(ops.scale)
                dk_blocks[:, blocks] += dk_part.view(G, tiles, T, D)
                dv_part = torch.bmm(p[:, :, cols].transpose(1, 2), go)
                dv_blocks[:, blocks] += dv_part.view(G, tiles, T, Dv)
        if n + 1 == len(chunks) or chunks[n + 1][:2] != (h0, h1):  # group done: hand over
            dk[h0:h1, real_keys] += dk_src[:, real_src]
            dv[h0:h1, real_keys] += dv_src[:, real_src]
    used = layout.num_offsets
    return (dq, ds_sum, None if dak is None else dak[:, :used],
            None if dav is None else dav[:, :used])
