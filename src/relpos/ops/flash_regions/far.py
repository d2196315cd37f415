"""The far regions of the flash_regions backend: plain attention through the flash kernels.

Every key at offset ``j - p_i <= -K`` (far-left) sees the relative row ``-K``, every key at
``j - p_i >= max(K, 1)`` (far-right) the row ``+K``; within a region the relative key term is
one constant per query row, so the region is plain attention with a shifted causal mask
(docs/design.md §3). A region is "query ``i`` sees key ``j <= i + c``" in region coordinates: the
original ones for far-left, reversed ones (``i' = L - 1 - i``, ``j' = S - 1 - j``) for
far-right. :class:`FarRegion` cuts it into blocks of ``FAR_BLOCK`` queries; each block is a
non-causal piece over a contiguous key range, which needs no reordering (attention does not
depend on the order of its keys), and a causal piece of at most a block's keys, which for
far-right runs on small reversed copies. No sequence-long copy is made, and every call spans
all heads: the CPU flash backward parallelizes over heads only, so per-head calls would leave
threads idle.

Shape legend: N = B·H flat heads, L queries, S keys, D head dim, Dv value head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos.ops._flash import Piece, flash_backward, flash_forward, lower_pieces, restore_nan_rows
from relpos.ops._lse import merge_rows
from relpos.ops._numerics import accumulation_dtype

__all__ = ["FAR_BLOCK", "FAR_KEY_ELEMS", "FarRegion", "far_backward", "far_forward", "key_bias"]

FAR_BLOCK = 1024
"""Far regions: queries per block (each flash call spans all heads and one block)."""
FAR_KEY_ELEMS = 1 << 20
"""Far-region backward: key-range length times heads times D per call (bounds the kernel's
key and value gradients)."""

_INF = math.inf


def reverse(x: Tensor, dim: int) -> Tensor:
    """``x.flip(dim)``, through ``index_select`` (about twice as fast as ``flip`` on CPU)."""
    n = x.shape[dim]
    return x.index_select(dim, torch.arange(n - 1, -1, -1, device=x.device))


def key_bias(
    key_mask: Tensor | None, dtype: torch.dtype, H: int
) -> tuple[Tensor | None, Tensor | None]:
    """Per flat head: additive ``(1, N, 1, S)`` key bias (0 or -inf) and ``(N, S + 1)``
    prefix counts of real keys, from a ``(B, S)`` key mask (None, None without one)."""
    if key_mask is None:
        return None, None
    B, S = key_mask.shape
    bias = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    bias = bias.masked_fill_(~key_mask, -_INF)[:, None, :].expand(B, H, S).reshape(1, B * H, 1, S)
    counts = F.pad(key_mask.to(torch.int32).cumsum(-1), (1, 0))  # (B, S + 1)
    return bias, counts[:, None].expand(B, H, S + 1).reshape(B * H, S + 1)


@dataclass(frozen=True)
class FarRegion:
    """A far region "query ``i`` sees key ``j <= i + c``" in region coordinates.

    Attributes:
        query_len: L.
        key_len: S.
        offset: c.
        reversed: region coordinates are reversed (far-right).
        block: queries per block.
    """

    query_len: int
    key_len: int
    offset: int
    reversed: bool
    block: int

    def blocks(self) -> list[tuple[int, int, list[Piece]]]:
        """``(a, b, pieces)`` per block of region queries ``[a, b)`` that sees some key: a
        non-causal piece over the keys every query of the block sees and a causal remainder
        of at most ``b - a`` keys (see :func:`~relpos.ops._flash.lower_pieces`)."""
        out = []
        for a in range(max(0, -self.offset), self.query_len, self.block):
            b = min(self.query_len, a + self.block)
            pieces = [Piece(p.q0 + a, p.q1 + a, p.k0, p.k1, p.is_causal)
                      for p in lower_pieces(b - a, self.key_len, self.offset + a)]
            if pieces:
                out.append((a, b, pieces))
        return out

    def rows(self, q0: int, q1: int) -> slice:
        """Original query rows of region rows ``[q0, q1)``."""
        return slice(self.query_len - q1, self.query_len - q0) if self.reversed else slice(q0, q1)

    def keys(self, k0: int, k1: int) -> slice:
        """Original keys of region keys ``[k0, k1)``."""
        return slice(self.key_len - k1, self.key_len - k0) if self.reversed else slice(k0, k1)

    def flipped(self, p: Piece) -> bool:
        """Whether piece ``p`` runs on reversed copies (a causal piece of far-right)."""
        return self.reversed and p.is_causal

    def dead(self, counts: Tensor, p: Piece) -> Tensor:
        """``(1, N, rows)`` True where a query of ``p`` sees no real key, in original order.

        Args:
            counts: ``(N, S + 1)`` prefix counts of real keys in ORIGINAL key order.
        """
        rows = torch.arange(p.q0, p.q1, device=counts.device)  # region rows
        last = (rows + (p.k0 - p.q0)).clamp(max=p.k1 - 1) if p.is_causal else rows.new_full(
            rows.shape, p.k1 - 1)  # last region key seen
        first = p.k0
        if self.reversed:  # region keys [first, last] = original [S-1-last, S-1-first]
            n_real = counts[:, self.key_len - first, None] - counts[:, self.key_len - 1 - last]
            n_real = n_real.flip(-1)  # rows in original order
        else:
            n_real = counts[:, last + 1] - counts[:, first : first + 1]
        return (n_real == 0)[None]


def _take(x: Tensor, idx: slice, dim: int, flip: bool) -> Tensor:
    """``x`` sliced along ``dim``; a reversed copy when ``flip``."""
    part = x.narrow(dim % x.dim(), idx.start, idx.stop - idx.start)
    return reverse(part, dim) if flip else part


def far_forward(
    q: Tensor, k: Tensor, v: Tensor, offset: int, bias: Tensor | None, counts: Tensor | None,
    scale: float, reversed: bool,
) -> tuple[Tensor, Tensor]:
    """Plain attention over a far region: output and logsumexp.

    Args:
        q, k, v: ``(1, N, L|S, D|Dv)``.
        offset: the region's ``c``; reversed: far-right (see :class:`FarRegion`).
        bias: ``(1, N, 1, S)`` additive key bias or None; counts: ``(N, S + 1)`` or None.

    Returns:
        ``(1, N, L, Dv)`` output (zeros where empty) and ``(1, N, L)`` logsumexp in the
        accumulation dtype (``-inf`` where empty).
    """
    _, N, L, _ = q.shape
    S, Dv = k.shape[2], v.shape[-1]
    acc = accumulation_dtype(q.dtype)
    # Far-left runs as one block (at most two calls, no merges); far-right block by block
    # so that only a block's causal piece is copied in reverse.
    region = FarRegion(L, S, offset, reversed, block=FAR_BLOCK if reversed else max(1, L))
    o = q.new_empty(1, N, L, Dv)
    lam = torch.full((1, N, L), -_INF, dtype=acc, device=q.device)
    written = torch.zeros(L, dtype=torch.bool)  # rows written by a block's first piece
    for _, _, pieces in region.blocks():
        written[region.rows(pieces[0].q0, pieces[0].q1)] = True
        for n, p in enumerate(pieces):
            flip = region.flipped(p)
            rows, keys = region.rows(p.q0, p.q1), region.keys(p.k0, p.k1)
            q_p, k_p = _take(q, rows, 2, flip), _take(k, keys, 2, flip)
            bias_p = None if bias is None else _take(bias, keys, -1, flip)
            po, pl = flash_forward(q_p, k_p, _take(v, keys, 2, flip), is_causal=p.is_causal,
                                   bias=bias_p, scale=scale)
            dead = None if counts is None else region.dead(counts, p)  # original row order
            live = None if dead is None else ~(dead.flip(-1) if flip else dead)
            po, pl = restore_nan_rows(q_p, k_p, po, pl, live, is_causal=p.is_causal, bias=bias_p)
            if flip:
                po, pl = reverse(po, 2), reverse(pl, -1)
            pl = pl.to(acc)
            if dead is not None:
                pl = pl.masked_fill(dead, -_INF)
            merge_rows(o, lam, rows, po, pl, first=n == 0)
    if not bool(written.all()):
        o[:, :, ~written.to(o.device)] = 0
    return o, lam


def far_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse_shifted: Tensor,
    value_row: Tensor | None, offset: int, bias: Tensor | None, scale: float, reversed: bool,
    dq: Tensor, dk: Tensor, dv: Tensor,
) -> None:
    """Add a far region's share of ``dq`` (content part), ``dk``, ``dv`` (flat heads) in place.

    The flash backward is handed the GLOBAL output minus the region's relative value row and
    the global logsumexp minus the region's constant key term, so its probabilities and its
    ``delta`` are the global ones (docs/design.md §3). Non-causal pieces are cut into key ranges of
    at most ``max(FAR_BLOCK, FAR_KEY_ELEMS / (N * D))`` keys, which bounds the kernel's
    key and value gradients.

    Args:
        grad_out, q, k, v, out: ``(1, N, ., .)``; lse_shifted: ``(1, N, L)``.
        value_row: ``(N, Dv)`` the region's relative value row per flat head, or None.
    """
    _, N, L, D = q.shape
    S = k.shape[2]
    region = FarRegion(L, S, offset, reversed, block=FAR_BLOCK)
    key_step = max(FAR_BLOCK, FAR_KEY_ELEMS // max(1, N * D))
    for a, b, pieces in region.blocks():
        block = region.rows(a, b)
        go_b, lse_b, q_b = grad_out[:, :, block], lse_shifted[:, :, block], q[:, :, block]
        out_b = out[:, :, block]  # the kernel reads strided outputs; a copy only when shifted
        if value_row is not None:
            out_b = out_b - value_row[None, :, None, :]
        base = block.start
        for p in pieces:
            flip = region.flipped(p)
            rows = region.rows(p.q0, p.q1)
            local = slice(rows.start - base, rows.stop - base)
            go, q_p, out_p = (_take(t, local, 2, flip) for t in (go_b, q_b, out_b))
            go, lse_p = go.contiguous(), _take(lse_b, local, -1, flip).contiguous()
            step = p.k1 - p.k0 if p.is_causal else key_step
            for k0 in range(p.k0, p.k1, step):
                keys = region.keys(k0, min(p.k1, k0 + step))
                gq, gk, gv = flash_backward(
                    go, q_p, _take(k, keys, 2, flip), _take(v, keys, 2, flip), out_p, lse_p,
                    is_causal=p.is_causal,
                    bias=None if bias is None else _take(bias, keys, -1, flip), scale=scale,
                )
                if flip:
                    gq, gk, gv = reverse(gq, 2), reverse(gk, 2), reverse(gv, 2)
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
