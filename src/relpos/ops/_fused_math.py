"""Forward and backward math of the fused backend (exact region decomposition, DESIGN.md §3).

Every key ``j`` of query ``i`` (position ``p_i = query_start + i``, offset ``d = j - p_i``)
lies in exactly one region:

- far-left  ``FL``: ``d <= -K``            (relative key/value row 0)
- band      ``BD``: ``-K < d < K``          (row ``d + K``; with ``is_causal`` only ``d <= 0``)
- far-right ``FR``: ``d >= max(K, 1)``      (row 2K; empty with ``is_causal``)

For ``K = 0`` the offset 0 belongs to FL only, so it is counted once. FL and FR are plain
attention with a shifted causal mask through a flash kernel that returns the logsumexp, run
in blocks of ``FAR_BLOCK`` queries with all heads in every call (:class:`_Far`): a non-causal
piece over the keys the whole block sees, and a causal piece, which for FR runs on small
reversed copies; the backward further cuts the non-causal pieces into key ranges, so the
kernels' gradient outputs stay O(B·H·(FAR_BLOCK + key range)·D). The band is computed
explicitly, T queries at a time against a window of ``W`` keys (``T + nb - 1`` rounded up to
a multiple of T; ``nb`` band offsets), one head and at most ``CHUNK_ELEMS`` scores at a time,
so no temporary exceeds O(B·H·L·(T + 2K)) elements. The three parts are merged by
logsumexp. The backward hands each far region's flash backward the GLOBAL output and
logsumexp, shifted by the region's constant, so its probabilities and its ``delta`` are the
global ones. The constants' own gradients are closed-form:
``dc_FL = m_FL (dO . (o_FL + aV[-K]) - delta)``, and since the softmax gradient sums to zero
over a row, ``dc_FR = -dc_FL - (sum of dS over the band)``, so the far-right
output need not be kept. Everything is deterministic: no atomics, no scatter with repeated
indices; overlapping band windows are folded back block by block.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
K clip distance, R = 2K + 1 table rows, T tile of queries, W window of keys per tile.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos.ops._fused_kernels import Piece, flash_backward, flash_forward, lower_pieces

__all__ = ["fused_backward", "fused_forward"]

TILE = 32
"""Queries per band tile."""
CHUNK_ELEMS = 1 << 19
"""Band scores computed at once in the backward (elements): bounds the band's temporaries.
The forward, whose peak memory is lower, takes four times as many (fewer, larger matmuls)."""
FAR_BLOCK = 1024
"""Far regions: queries per block (each flash call spans all heads and one block)."""
FAR_KEY_ELEMS = 1 << 20
"""Far-region backward: key-range length times heads times D per call (bounds the kernel's
key and value gradients)."""

_INF = math.inf


def _reverse(x: Tensor, dim: int) -> Tensor:
    """``x.flip(dim)``, through ``index_select`` (about twice as fast as ``flip`` on CPU)."""
    n = x.shape[dim]
    return x.index_select(dim, torch.arange(n - 1, -1, -1, device=x.device))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ----------------------------------------------------------------------------------------------
# Far regions


def _key_bias(
    key_mask: Tensor | None, dtype: torch.dtype, H: int
) -> tuple[Tensor | None, Tensor | None]:
    """Per flat head: additive ``(1, BH, 1, S)`` key bias and ``(BH, S + 1)`` prefix counts."""
    if key_mask is None:
        return None, None
    B, S = key_mask.shape
    bias = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    bias = bias.masked_fill_(~key_mask, -_INF)[:, None, :].expand(B, H, S).reshape(1, B * H, 1, S)
    counts = F.pad(key_mask.to(torch.int32).cumsum(-1), (1, 0))  # (B, S + 1)
    return bias, counts[:, None].expand(B, H, S + 1).reshape(B * H, S + 1)


def _block_pieces(a: int, b: int, S: int, c: int) -> list[Piece]:
    """Pieces of the lower region ``j <= i + c`` restricted to the queries ``[a, b)``: a
    non-causal prefix (keys every query of the block sees) and a causal remainder of at most
    ``b - a`` keys (see :func:`lower_pieces`)."""
    return [Piece(p.q0 + a, p.q1 + a, p.k0, p.k1, p.causal)
            for p in lower_pieces(b - a, S, c + a)]


class _Far:
    """A far region, block by block of queries, every flash call on all flat heads.

    The region is "query ``i`` sees key ``j <= i + c``" in region coordinates: the original
    ones for far-left, the reversed ones (``i' = L - 1 - i``, ``j' = S - 1 - j``) for
    far-right. Each block of ``FAR_BLOCK`` queries is a non-causal piece over a contiguous key
    range, which needs no reordering (attention is invariant to the order of its keys), and a
    causal piece of at most a block's keys, which for far-right runs on small reversed copies.
    No sequence-long copy is made, and every call spans all heads: the CPU flash backward
    parallelizes over heads only, so per-head calls would leave threads idle.
    """

    def __init__(self, L: int, S: int, c: int, reverse: bool, block: int | None = None) -> None:
        self.L, self.S, self.c, self.reverse = L, S, c, reverse
        self.block = FAR_BLOCK if block is None else max(1, block)

    def blocks(self) -> list[tuple[int, int, list[Piece]]]:
        """``(a, b, pieces)`` per block of region queries ``[a, b)`` that sees some key."""
        out = []
        for a in range(max(0, -self.c), self.L, self.block):
            b = min(self.L, a + self.block)
            pieces = _block_pieces(a, b, self.S, self.c)
            if pieces:
                out.append((a, b, pieces))
        return out

    def rows(self, q0: int, q1: int) -> slice:
        """Original query rows of region rows ``[q0, q1)``."""
        return slice(self.L - q1, self.L - q0) if self.reverse else slice(q0, q1)

    def keys(self, k0: int, k1: int) -> slice:
        """Original keys of region keys ``[k0, k1)``."""
        return slice(self.S - k1, self.S - k0) if self.reverse else slice(k0, k1)

    def flipped(self, p: Piece) -> bool:
        """Whether piece ``p`` runs on reversed copies (a causal piece of far-right)."""
        return self.reverse and p.causal

    def dead(self, counts: Tensor, p: Piece) -> Tensor:
        """``(1, N, rows)`` True where a query of ``p`` sees no real key, in original order.

        Args:
            counts: ``(N, S + 1)`` prefix counts of real keys in ORIGINAL key order.
        """
        rows = torch.arange(p.q0, p.q1, device=counts.device)  # region rows
        hi = (rows + (p.k0 - p.q0)).clamp(max=p.k1 - 1) if p.causal else rows.new_full(
            rows.shape, p.k1 - 1)  # last region key seen
        lo = p.k0
        if self.reverse:  # region keys [lo, hi] = original keys [S - 1 - hi, S - 1 - lo]
            n_real = counts[:, self.S - lo, None] - counts[:, self.S - 1 - hi]
            n_real = n_real.flip(-1)  # rows in original order
        else:
            n_real = counts[:, hi + 1] - counts[:, lo : lo + 1]
        return (n_real == 0)[None]


def _take(x: Tensor, idx: slice, dim: int, flip: bool) -> Tensor:
    """``x`` sliced along ``dim``; a reversed copy when ``flip``."""
    part = x.narrow(dim % x.dim(), idx.start, idx.stop - idx.start)
    return _reverse(part, dim) if flip else part


def _merge_rows(
    o: Tensor, lam: Tensor, rows: slice, po: Tensor, pl: Tensor, first: bool
) -> None:
    """Merge a partial output ``po`` with logsumexp ``pl`` into ``o[:, :, rows]`` in place."""
    if first:
        o[:, :, rows] = po
        lam[:, :, rows] = pl
        return
    old_o, old_l = o[:, :, rows], lam[:, :, rows]
    new_l = torch.logaddexp(old_l, pl)
    safe = new_l.nan_to_num(neginf=_INF)
    w_old = (old_l - safe).exp_()[..., None]
    w_new = (pl - safe).exp_()[..., None]
    o[:, :, rows] = (old_o * w_old + po * w_new).to(o.dtype)
    lam[:, :, rows] = new_l


def _far_forward(
    q: Tensor, k: Tensor, v: Tensor, c: int, bias: Tensor | None, counts: Tensor | None,
    scale: float, reverse: bool,
) -> tuple[Tensor, Tensor]:
    """Plain attention over a far region (see :class:`_Far`): output and logsumexp.

    Args:
        q, k, v: ``(1, N, L|S, D|Dv)`` (N flat heads).
        bias: ``(1, N, 1, S)`` additive key bias or None; counts: ``(N, S + 1)`` or None.

    Returns:
        ``(1, N, L, Dv)`` output (zeros where empty) and ``(1, N, L)`` logsumexp in the
        accumulation dtype (``-inf`` where empty).
    """
    _, N, L, _ = q.shape
    S, Dv = k.shape[2], v.shape[-1]
    acc = _acc_dtype(q.dtype)
    # Far-left runs as one region (at most two calls, no merges); far-right block by block
    # so that only a block's causal piece is copied in reverse.
    region = _Far(L, S, c, reverse, block=None if reverse else L)
    o = q.new_empty(1, N, L, Dv)
    lam = torch.full((1, N, L), -_INF, dtype=acc, device=q.device)
    written = torch.zeros(L, dtype=torch.bool)  # rows written by a block's first piece
    for _, _, pieces in region.blocks():
        written[region.rows(pieces[0].q0, pieces[0].q1)] = True
        for n, p in enumerate(pieces):
            flip = region.flipped(p)
            rows, keys = region.rows(p.q0, p.q1), region.keys(p.k0, p.k1)
            po, pl = flash_forward(
                _take(q, rows, 2, flip), _take(k, keys, 2, flip), _take(v, keys, 2, flip),
                causal=p.causal, bias=None if bias is None else _take(bias, keys, -1, flip),
                scale=scale,
            )
            if flip:
                po, pl = _reverse(po, 2), _reverse(pl, -1)
            pl = pl.to(acc)
            if counts is not None:
                pl = pl.masked_fill(region.dead(counts, p), -_INF)
            _merge_rows(o, lam, rows, po, pl, first=n == 0)
    if not bool(written.all()):
        o[:, :, ~written.to(o.device)] = 0
    return o, lam


def _far_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse_shifted: Tensor,
    av_row: Tensor | None, c: int, bias: Tensor | None, scale: float, reverse: bool,
    dq: Tensor, dk: Tensor, dv: Tensor,
) -> None:
    """Add a far region's share of ``dq`` (content part), ``dk``, ``dv`` (flat heads) in place.

    The flash backward is handed the GLOBAL output minus the region's relative value row and
    the global logsumexp minus the region's constant key term, so its probabilities and its
    ``delta`` are the global ones (DESIGN.md §3). Non-causal pieces are cut into key ranges of
    at most ``max(FAR_BLOCK, FAR_KEY_ELEMS / (N * D))`` keys, which bounds the kernel's
    key and value gradients.

    Args:
        grad_out, q, k, v, out: ``(1, N, ., .)``; lse_shifted: ``(1, N, L)``.
        av_row: ``(N, Dv)`` the region's relative value row per flat head, or None.
    """
    _, N, L, D = q.shape
    S = k.shape[2]
    region = _Far(L, S, c, reverse)
    key_step = max(FAR_BLOCK, FAR_KEY_ELEMS // max(1, N * D))
    for a, b, pieces in region.blocks():
        block = region.rows(a, b)
        go_b, lse_b, q_b = grad_out[:, :, block], lse_shifted[:, :, block], q[:, :, block]
        out_b = out[:, :, block]  # the kernel reads strided outputs; a copy only when shifted
        if av_row is not None:
            out_b = out_b - av_row[None, :, None, :]
        base = block.start
        for p in pieces:
            flip = region.flipped(p)
            rows = region.rows(p.q0, p.q1)
            local = slice(rows.start - base, rows.stop - base)
            go, qq, oo = (_take(t, local, 2, flip) for t in (go_b, q_b, out_b))
            go, ll = go.contiguous(), _take(lse_b, local, -1, flip).contiguous()
            step = p.k1 - p.k0 if p.causal else key_step
            for k0 in range(p.k0, p.k1, step):
                keys = region.keys(k0, min(p.k1, k0 + step))
                gq, gk, gv = flash_backward(
                    go, qq, _take(k, keys, 2, flip), _take(v, keys, 2, flip), oo, ll,
                    causal=p.causal, bias=None if bias is None else _take(bias, keys, -1, flip),
                    scale=scale,
                )
                if flip:
                    gq, gk, gv = _reverse(gq, 2), _reverse(gk, 2), _reverse(gv, 2)
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv


# ----------------------------------------------------------------------------------------------
# Band


def _skew(x: Tensor, width: int, fill: float) -> Tensor:
    """``(N, T, nb) -> (N, T, W)`` with ``y[n, a, a + u] = x[n, a, u]`` and ``fill`` elsewhere."""
    N, T, nb = x.shape
    y = F.pad(x, (0, width + 1 - nb), value=fill)  # (N, T, W + 1)
    return y.view(N, T * (width + 1))[:, : T * width].view(N, T, width)


def _unskew(y: Tensor, nb: int) -> Tensor:
    """Inverse of :func:`_skew` as a view: ``(N, T, W) -> (N, T, nb)``, ``y`` contiguous."""
    N, T, W = y.shape
    return y.as_strided((N, T, nb), (T * W, W + 1, 1), y.storage_offset())


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


def _pad_rows(x: Tensor, rows: int, value: float = 0.0) -> Tensor:
    """Pad dim 1 of ``x`` with ``value`` up to ``rows`` (no copy when already that long)."""
    if x.shape[1] == rows:
        return x
    pad = [0, 0] * (x.dim() - 2) + [0, rows - x.shape[1]]
    return F.pad(x, pad, value=value)


def _windows(src: Tensor, n_tiles: int, tile: int, width: int) -> Tensor:
    """Overlapping windows of one head's source rows as a view: ``(Ls, X) -> (nT, W, X)``."""
    return src.unfold(0, width, tile)[:n_tiles].transpose(1, 2)


class _Band:
    """Tiled band ``-K < j - p_i < K`` (``<= 0`` when causal), shared by forward and backward.

    Tile ``t`` of a head holds queries ``tT .. tT + T - 1``; its window holds the ``W`` keys
    from position ``j_start + tT`` on (``j_start = query_start - K + 1``), read as a view of a
    zero-padded copy of the keys. Scores are ``(nT, T, W)`` per block of tiles, with -inf off
    the band; the relative-key term is added on the band through a strided view
    (:func:`_unskew`). Work goes one head (and at most ``CHUNK_ELEMS`` scores) at a time.
    """

    def __init__(
        self, q: Tensor, k: Tensor, v: Tensor, rel_keys: Tensor | None,
        rel_values: Tensor | None, key_mask: Tensor | None, K: int, causal: bool,
        scale: float, query_start: int, *, for_backward: bool,
    ) -> None:
        B, H, L, D = q.shape
        S, Dv = k.shape[2], v.shape[-1]
        acc = _acc_dtype(q.dtype)
        self.B, self.H, self.L, self.D, self.Dv, self.acc = B, H, L, D, Dv, acc
        self.scale = scale
        lo, hi = -(K - 1), (0 if causal else K - 1)
        nb = hi - lo + 1
        T = TILE
        # Table rows padded to a multiple of 8 (zeros, off the band): matmuls with 127 rows
        # run at a third of the speed of 128 on CPU.
        nbp = -(-nb // 8) * 8
        # A window spans whole blocks of T source rows (T + nbp - 1 rounded up): its gradient
        # folds back block by block into contiguous slices.
        self.segments = -(-(T + nbp - 1) // T)
        W = self.segments * T
        nT = -(-L // T)
        self.lo, self.nb, self.nbp, self.T, self.W, self.nT = lo, nb, nbp, T, W, nT
        self.Lp = nT * T
        self.Ls = (nT + self.segments - 1) * T  # source rows per head
        self.j_start = query_start + lo  # key position of window column 0 of tile 0
        self.S = S
        self.chunk_elems = CHUNK_ELEMS * (1 if for_backward else 4)
        self.qb = _pad_rows(q.reshape(B * H, L, D).to(acc), self.Lp)  # (BH, Lp, D)
        self.k_flat = k.reshape(B * H, S, D)
        self.v_flat = v.reshape(B * H, S, Dv)
        self._source_head = -1
        self.kb = self.vb = self.qb[0]  # replaced by source(h)
        rows = slice(lo + K, hi + K + 1)
        pad = (0, 0, 0, nbp - nb)
        self.akb = None if rel_keys is None else F.pad((rel_keys[:, rows] * scale).to(acc), pad)
        self.avb = None if rel_values is None else F.pad(rel_values[:, rows].to(acc), pad)
        # Key validity of every window column (padding and key_mask): (Bm, nT, W), Bm in {1, B}.
        pos = self.j_start + torch.arange(self.Ls, device=q.device)
        valid = ((pos >= 0) & (pos < S))[None]  # (1, Ls)
        if key_mask is not None:
            valid = valid & key_mask[:, pos.clamp(0, max(S - 1, 0))]  # (B, Ls)
        win_valid = valid.unfold(1, W, T)[:, :nT]  # (Bm, nT, W)
        self.col_bias = torch.zeros(win_valid.shape, dtype=acc, device=q.device).masked_fill_(
            ~win_valid, -_INF
        )
        self.tile_needs_bias = (~win_valid).any(-1).any(0).tolist()  # (nT,) python bools
        structure = torch.zeros(1, T, W, dtype=acc, device=q.device)
        structure.fill_(-_INF)
        _unskew(structure, nb).zero_()
        self.structure = structure  # (1, T, W): 0 on the band, -inf off it

    def chunks(self) -> list[tuple[int, int, int]]:
        """``(h, t0, t1)``: one flat head and a range of its tiles."""
        per = max(1, self.chunk_elems // (self.T * self.W))
        return [(h, t0, min(self.nT, t0 + per))
                for h in range(self.B * self.H) for t0 in range(0, self.nT, per)]

    def source(self, h: int) -> None:
        """Build the zero-padded key/value rows of flat head ``h`` (one head at a time)."""
        if h != self._source_head:
            self.kb = _window_source(self.k_flat[h], self.j_start, self.Ls, self.acc)
            self.vb = _window_source(self.v_flat[h], self.j_start, self.Ls, self.acc)
            self._source_head = h

    def _table(self, table: Tensor, h: int) -> Tensor:
        return table[0] if table.shape[0] == 1 else table[h % self.H]

    def scores(self, h: int, t0: int, t1: int) -> tuple[Tensor, Tensor, Tensor]:
        """Band scores ``(nTc, T, W)`` (-inf off the band), the block's queries and keys."""
        T, W, nbp = self.T, self.W, self.nbp
        self.source(h)
        qc = self.qb[h, t0 * T : t1 * T].view(t1 - t0, T, self.D)  # (nTc, T, D)
        kw = _windows(self.kb, self.nT, T, W)[t0:t1]  # (nTc, W, D)
        s = torch.baddbmm(self.structure, qc, kw.transpose(1, 2), alpha=self.scale)
        if self.akb is not None:
            rel = torch.mm(qc.view(-1, self.D), self._table(self.akb, h).t())  # (nTc*T, nbp)
            _unskew(s, nbp).add_(rel.view(t1 - t0, T, nbp))
        need = self.tile_needs_bias[t0:t1]
        if any(need):
            cb = self.col_bias[0 if self.col_bias.shape[0] == 1 else h // self.H, t0:t1]
            if all(need):
                s += cb[:, None, :]
            else:
                for t, flag in enumerate(need):
                    if flag:
                        s[t] += cb[t, None, :]
        return s, qc, kw

    def forward(self) -> tuple[Tensor, Tensor, Tensor]:
        """Unnormalized band output, its row log-scale and the band log-mass.

        Returns:
            ``o (BH, Lp, Dv)``, ``m (BH, Lp)`` and ``zb (BH, Lp)``: the band's share of the
            output is ``o * exp(m - LSE)`` and its log-mass ``zb`` (-inf = no band key).
        """
        BH, T, nbp, Dv = self.B * self.H, self.T, self.nbp, self.Dv
        dev = self.qb.device
        out = torch.empty(BH, self.Lp, Dv, dtype=self.acc, device=dev)
        m_all = torch.empty(BH, self.Lp, dtype=self.acc, device=dev)
        sum_all = torch.empty(BH, self.Lp, dtype=self.acc, device=dev)
        low = torch.finfo(self.acc).min
        for h, t0, t1 in self.chunks():
            rows = slice(t0 * T, t1 * T)
            s, _, _ = self.scores(h, t0, t1)
            m = s.amax(-1, keepdim=True).clamp_(min=low)  # (nTc, T, 1); finite
            p = s.sub_(m).exp_()  # (nTc, T, W): probabilities up to a per-row factor
            o_h = out[h, rows]  # (nTc*T, Dv), contiguous
            torch.bmm(p, _windows(self.vb, self.nT, T, self.W)[t0:t1],
                      out=o_h.view(t1 - t0, T, Dv))
            torch.sum(p, -1, out=sum_all[h, rows].view(t1 - t0, T))
            m_all[h, rows] = m.view(-1)
            if self.avb is not None:
                pu = _unskew(p, nbp).contiguous().view(-1, nbp)  # (nTc*T, nbp)
                o_h.addmm_(pu, self._table(self.avb, h))
        return out, m_all, sum_all.log_().add_(m_all)

    def backward(
        self, grad_out: Tensor, lse: Tensor, delta: Tensor, dk: Tensor, dv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """Band gradients.

        Args:
            grad_out: ``(BH, Lp, Dv)``.
            lse: ``(BH, Lp)`` merged logsumexp (+inf = no key).
            delta: ``(BH, Lp)``, ``grad_out_i . out_i``.
            dk: ``(BH, S, D)`` key gradient, the band's share is added in place.
            dv: ``(BH, S, Dv)`` value gradient, likewise.

        Returns:
            ``dq (BH, Lp, D)``, the band's row sums of dS ``(BH, Lp)`` and the per-head table
            gradients ``(H, nb, D|Dv)`` (None when the term is off).
        """
        BH, T, W, nbp, D, Dv = self.B * self.H, self.T, self.W, self.nbp, self.D, self.Dv
        dev, acc = grad_out.device, self.acc
        dq = torch.zeros(BH, self.Lp, D, dtype=acc, device=dev)
        ds_sum = torch.zeros(BH, self.Lp, dtype=acc, device=dev)
        dk_src = torch.zeros(self.Ls, D, dtype=acc, device=dev)
        dv_src = torch.zeros(self.Ls, Dv, dtype=acc, device=dev)
        dak = None if self.akb is None else torch.zeros(self.H, nbp, D, dtype=acc, device=dev)
        dav = None if self.avb is None else torch.zeros(self.H, nbp, Dv, dtype=acc, device=dev)
        n_src = self.Ls // T
        src, keys = self.source_slice()
        chunks = self.chunks()
        for n, (h, t0, t1) in enumerate(chunks):
            nTc = t1 - t0
            rows = slice(t0 * T, t1 * T)
            s, qc, kw = self.scores(h, t0, t1)
            p = s.sub_(lse[h, rows].view(nTc, T, 1)).exp_()  # (nTc, T, W): global P
            go = grad_out[h, rows].view(nTc, T, Dv)
            vw = _windows(self.vb, self.nT, T, W)[t0:t1]  # (nTc, W, Dv)
            # dP - delta = grad_out . (v_j + rel_values[r]) - delta
            ds = torch.baddbmm(-delta[h, rows].view(nTc, T, 1), go, vw.transpose(1, 2))
            if self.avb is not None:
                rel = torch.mm(go.view(-1, Dv), self._table(self.avb, h).t())  # (nTc*T, nbp)
                _unskew(ds, nbp).add_(rel.view(nTc, T, nbp))
            ds = ds.mul_(p)  # (nTc, T, W): dS
            ds_sum[h, rows] = ds.sum(-1).view(-1)
            dqc = dq[h, rows].view(nTc, T, D)
            dqc.baddbmm_(ds, kw, alpha=self.scale)
            if self.akb is not None:
                assert dak is not None
                dsu = _unskew(ds, nbp).contiguous().view(-1, nbp)  # (nTc*T, nbp)
                dqc.view(-1, D).addmm_(dsu, self._table(self.akb, h))
                dak[h % self.H].addmm_(dsu.t(), qc.view(-1, D), alpha=self.scale)
            if self.avb is not None:
                assert dav is not None
                pu = _unskew(p, nbp).contiguous().view(-1, nbp)
                dav[h % self.H].addmm_(pu.t(), go.view(-1, Dv))
            # Windows overlap: add them block by block (T source rows), deterministically.
            dk_blocks = dk_src.view(n_src, T, D)
            dv_blocks = dv_src.view(n_src, T, Dv)
            for seg in range(self.segments):
                cols = slice(seg * T, (seg + 1) * T)
                blk = slice(t0 + seg, t1 + seg)
                dk_blocks[blk].baddbmm_(ds[:, :, cols].transpose(1, 2), qc, alpha=self.scale)
                dv_blocks[blk].baddbmm_(p[:, :, cols].transpose(1, 2), go)
            if n + 1 == len(chunks) or chunks[n + 1][0] != h:  # head done: hand over dk, dv
                dk[h, keys] += dk_src[src]
                dv[h, keys] += dv_src[src]
                dk_src.zero_()
                dv_src.zero_()
        if dak is not None:
            dak = dak[:, : self.nb]
        if dav is not None:
            dav = dav[:, : self.nb]
        return dq, ds_sum, dak, dav

    def source_slice(self) -> tuple[slice, slice]:
        """(window-source rows, key rows) that correspond to real keys."""
        m0 = max(0, -self.j_start)
        m1 = min(self.Ls, self.S - self.j_start)
        m1 = max(m1, m0)
        return slice(m0, m1), slice(self.j_start + m0, self.j_start + m1)


# ----------------------------------------------------------------------------------------------
# Whole forward / backward


def _regions(L: int, S: int, K: int, causal: bool, query_start: int) -> tuple[int, int | None]:
    """Offsets ``c`` of FL (``j <= i + c``) and of FR in reversed coordinates (None = empty)."""
    c_left = query_start - K
    if causal:
        return c_left, None
    # FR: j >= p_i + max(K, 1); reversed (i' = L-1-i, j' = S-1-j): j' <= i' + S - L - (qs + K').
    return c_left, S - L - (query_start + max(K, 1))


def _far_constants(q: Tensor, rel_keys: Tensor, K: int, scale: float) -> Tensor:
    """``scale * q . rel_keys[-K]`` and ``... [+K]`` as ``(B, H, L, 2)`` (accumulation dtype)."""
    acc = _acc_dtype(q.dtype)
    rows = rel_keys[:, [0, 2 * K]].to(acc).transpose(-1, -2) * scale  # (Hr, D, 2)
    return torch.matmul(q.to(acc), rows)  # (B, H, L, 2)


def _value_rows(rel_values: Tensor, K: int, B: int, H: int) -> Tensor:
    """Rows -K and +K of ``rel_values`` per flat head: ``(BH, 2, Dv)``."""
    rows = rel_values[:, [0, 2 * K]]  # (Hr, 2, Dv)
    return rows[None].expand(B, H, *rows.shape[1:]).reshape(B * H, *rows.shape[1:])


def _flat(x: Tensor) -> Tensor:
    """``(B, H, ...) -> (1, B*H, ...)`` (a view for contiguous ``x``)."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def fused_forward(
    q: Tensor, k: Tensor, v: Tensor, rel_keys: Tensor | None, rel_values: Tensor | None,
    key_mask: Tensor | None, K: int, causal: bool, scale: float, query_start: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Exact clipped relative attention.

    Returns:
        ``out (B, H, L, Dv)``, merged logsumexp ``(B, H, L)`` (+inf for rows with no key),
        the far-left plain output ``(B, H, L, Dv)`` and the far regions' masses
        ``(B, H, L, 2)``, which the backward needs.
    """
    B, H, L, _ = q.shape
    S, Dv = k.shape[2], v.shape[-1]
    acc = _acc_dtype(q.dtype)
    dev = q.device
    if key_mask is not None and bool(key_mask.all()):
        key_mask = None
    bias, counts = _key_bias(key_mask, q.dtype, H)
    c_left, c_right = _regions(L, S, K, causal, query_start)
    qf, kf, vf = _flat(q), _flat(k), _flat(v)

    o_left, lam_left = _far_forward(qf, kf, vf, c_left, bias, counts, scale, reverse=False)
    o_left, lam_left = o_left.view(B, H, L, Dv), lam_left.view(B, H, L)
    if c_right is not None:
        o_right, lam_right = _far_forward(qf, kf, vf, c_right, bias, counts, scale, reverse=True)
        o_right, lam_right = o_right.view(B, H, L, Dv), lam_right.view(B, H, L)
    else:
        o_right = None
        lam_right = torch.full((B, H, L), -_INF, dtype=acc, device=dev)

    z_left, z_right = lam_left, lam_right
    if rel_keys is not None:
        c_far = _far_constants(q, rel_keys, K, scale)  # (B, H, L, 2)
        z_left = z_left + c_far[..., 0]
        z_right = z_right + c_far[..., 1]

    if K >= 1:
        band = _Band(q, k, v, rel_keys, rel_values, key_mask, K, causal, scale, query_start,
                     for_backward=False)
        o_b, m_b, z_b = band.forward()
        out = o_b[:, :L].view(B, H, L, Dv)
        z_band = z_b[:, :L].view(B, H, L)
        # log-masses of FL, FR, band -> merged logsumexp (+inf where no key: mass 0 below)
        z_all = torch.stack((z_left, z_right, z_band), -1)  # (B, H, L, 3)
        lse = torch.logsumexp(z_all, -1).nan_to_num_(neginf=_INF)  # (B, H, L)
        masses = z_all[..., :2].sub_(lse[..., None]).exp_()  # (B, H, L, 2)
        out = out.mul_((m_b[:, :L].view(B, H, L) - lse).exp_()[..., None])
    else:
        lse = torch.logaddexp(z_left, z_right).nan_to_num_(neginf=_INF)
        out = torch.zeros(B, H, L, Dv, dtype=acc, device=dev)
        masses = torch.stack((z_left, z_right), -1).sub_(lse[..., None]).exp_()  # (B, H, L, 2)
    m_left, m_right = masses[..., 0, None], masses[..., 1, None]  # (B, H, L, 1)
    out = out.addcmul_(m_left, o_left)
    if o_right is not None:
        out = out.addcmul_(m_right, o_right)
    if rel_values is not None:
        av = rel_values[:, [0, 2 * K]].to(acc)  # (Hr, 2, Dv)
        _add_rows_times_table(out, masses, av, 1.0)
    return out.to(q.dtype).contiguous(), lse.contiguous(), o_left, masses.contiguous()


def fused_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_mask: Tensor | None, out: Tensor, lse: Tensor,
    o_left: Tensor, masses: Tensor, K: int, causal: bool, scale: float, query_start: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Gradients of :func:`fused_forward` w.r.t. q, k, v, rel_keys, rel_values."""
    B, H, L, D = q.shape
    S, Dv = k.shape[2], v.shape[-1]
    acc = _acc_dtype(q.dtype)
    dev = q.device
    if key_mask is not None and bool(key_mask.all()):
        key_mask = None
    bias, _ = _key_bias(key_mask, q.dtype, H)
    c_left, c_right = _regions(L, S, K, causal, query_start)
    grad_out = grad_out.contiguous()
    go_acc = grad_out.to(acc)
    delta = _row_dot(go_acc, out, acc)  # (B, H, L)
    dk = torch.zeros(B * H, S, D, dtype=acc, device=dev)
    dv = torch.zeros(B * H, S, Dv, dtype=acc, device=dev)
    dak = None if rel_keys is None else torch.zeros(rel_keys.shape, dtype=acc, device=dev)
    dav = None if rel_values is None else torch.zeros(rel_values.shape, dtype=acc, device=dev)

    # Band first: its dq initializes the accumulator.
    if K >= 1:
        band = _Band(q, k, v, rel_keys, rel_values, key_mask, K, causal, scale, query_start,
                     for_backward=True)
        bq, ds_sum, bak, bav = band.backward(
            _pad_rows(go_acc.reshape(B * H, L, Dv), band.Lp),
            _pad_rows(lse.reshape(B * H, L), band.Lp, _INF),
            _pad_rows(delta.reshape(B * H, L), band.Lp), dk, dv,
        )
        dq = bq[:, :L].contiguous().view(B, H, L, D)
        band_ds = ds_sum[:, :L].reshape(B, H, L)  # sum of dS over each row's band
        rows = slice(band.lo + K, band.lo + K + band.nb)
        for table_grad, per_head in ((dak, bak), (dav, bav)):
            if table_grad is not None and per_head is not None:  # per_head: (H, nb, X)
                if table_grad.shape[0] == 1:
                    per_head = per_head.sum(0, keepdim=True)
                table_grad[:, rows] += per_head
        del band
    else:
        dq = torch.zeros(B, H, L, D, dtype=acc, device=dev)
        band_ds = torch.zeros(B, H, L, dtype=acc, device=dev)

    c_far = None if rel_keys is None else _far_constants(q, rel_keys, K, scale)  # (B, H, L, 2)
    av_flat = None if rel_values is None else _value_rows(rel_values, K, B, H)  # (BH, 2, Dv)
    dqf, dkf, dvf = dq.view(1, B * H, L, D), dk[None], dv[None]  # views: updated in place
    regions = [(0, False, c_left)] if c_right is None else [(0, False, c_left), (1, True, c_right)]
    for side, reverse, c in regions:
        lse_s = lse if c_far is None else lse - c_far[..., side]  # (B, H, L)
        _far_backward(
            _flat(grad_out), _flat(q), _flat(k), _flat(v), _flat(out), _flat(lse_s),
            None if av_flat is None else av_flat[:, side], c, bias, scale, reverse,
            dqf, dkf, dvf,
        )

    # Closed-form gradients of the far regions' constant terms: dc_X = sum of dS over region X.
    # FL directly; FR from "dS sums to zero over each row".
    dot = _row_dot(go_acc, o_left, acc)  # (B, H, L)
    if rel_values is not None:
        av = rel_values[:, [0, 2 * K]].to(acc)  # (Hr, 2, Dv)
        dot = dot + torch.matmul(go_acc, av[:, 0, :, None]).squeeze(-1)
    dc_left = masses[..., 0] * (dot - delta)  # (B, H, L)
    # (B, H, L, n_far)
    dc = dc_left[..., None] if c_right is None else torch.stack((dc_left, -dc_left - band_ds), -1)
    n_far = dc.shape[-1]
    if rel_keys is not None and dak is not None:
        ak = rel_keys[:, [0, 2 * K]].to(acc)  # (Hr, 2, D)
        _add_rows_times_table(dq, dc, ak[:, :n_far], scale)  # (B, H, L, D)
        g_rows = torch.einsum("bhlf,bhld->hfd", dc, q.to(acc)) * scale  # (H, n_far, D)
        _add_far_rows(dak, g_rows, K)
    if rel_values is not None and dav is not None:
        g_rows = torch.einsum("bhlf,bhld->hfd", masses[..., :n_far].to(acc), go_acc)
        _add_far_rows(dav, g_rows, K)
    dt = q.dtype
    return (
        dq.to(dt), dk.view(B, H, S, D).to(dt), dv.view(B, H, S, Dv).to(dt),
        None if dak is None else dak.to(dt), None if dav is None else dav.to(dt),
    )


def _row_dot(a: Tensor, b: Tensor, acc: torch.dtype) -> Tensor:
    """``(a * b).sum(-1)`` of ``(B, H, L, X)`` tensors in ``acc``, one head at a time, so no
    temporary as large as ``a`` is made."""
    B, H, L, X = a.shape
    af, bf = a.reshape(B * H, L, X), b.reshape(B * H, L, X)
    res = torch.empty(B * H, L, dtype=acc, device=a.device)
    for h in range(B * H):
        res[h] = (af[h].to(acc) * bf[h].to(acc)).sum(-1)
    return res.view(B, H, L)


def _add_rows_times_table(x: Tensor, w: Tensor, table: Tensor, alpha: float) -> None:
    """``x += alpha * w @ table[head]`` in place, one head at a time (no full-size temporary).

    Args:
        x: ``(B, H, L, X)``, updated in place.
        w: ``(B, H, L, F)``.
        table: ``(Hr, F, X)``, Hr in {1, H}.
    """
    B, H = x.shape[:2]
    tab = table.to(x.dtype)
    for b in range(B):
        for h in range(H):
            x[b, h].addmm_(w[b, h].to(x.dtype), tab[0 if tab.shape[0] == 1 else h], alpha=alpha)


def _add_far_rows(table_grad: Tensor, g_rows: Tensor, K: int) -> None:
    """Add ``(H, n_far, X)`` gradients of rows -K (and +K) into a ``(Hr, R, X)`` table grad."""
    if table_grad.shape[0] == 1:
        g_rows = g_rows.sum(0, keepdim=True)
    table_grad[:, 0] += g_rows[:, 0]
    if g_rows.shape[1] > 1:
        table_grad[:, 2 * K] += g_rows[:, 1]
