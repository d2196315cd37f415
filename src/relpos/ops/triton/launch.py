"""Forward and backward of the Triton backend: the small GEMMs around the kernels, and the
launches. Imports Triton (load it only when a call runs).

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
R = left + right + 1 table rows, Hr table heads (1 or H).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from relpos.ops._numerics import accumulation_dtype
from relpos.ops.triton import configs
from relpos.ops.triton.kernels import backward_dkdv_kernel, backward_dq_kernel, forward_kernel

__all__ = ["Blocks", "backward", "backward_varlen", "forward", "forward_varlen", "interpreted"]

_TL_DTYPE = {torch.float32: tl.float32, torch.float64: tl.float64}


@dataclass(frozen=True)
class Blocks:
    """Block sizes forced for every kernel (tests use small ones to cross many tiles under the
    interpreter); None in :data:`FORCED` = the table of :mod:`~relpos.ops.triton.configs`."""

    block_m: int
    block_n: int


FORCED: Blocks | None = None


def interpreted() -> bool:
    """Whether the kernels were loaded by Triton's interpreter (``TRITON_INTERPRET=1`` when they
    were first imported): they then run on CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(forward_kernel, InterpretedFunction)


@dataclass(frozen=True)
class Packed:
    """The sequences of a packed batch, read once from its ``cu_seqlens`` on the host: each
    one's first query row ``q0``, query count ``lq``, first key row ``k0`` and the keys it uses
    ``sk`` (``seqused_k``, else its key region)."""

    q0: tuple[int, ...]
    lq: tuple[int, ...]
    k0: tuple[int, ...]
    sk: tuple[int, ...]

    @classmethod
    def of(cls, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_k: Tensor | None
           ) -> Packed:
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        regions = [b - a for a, b in itertools.pairwise(cu_k)]
        used = regions if seqused_k is None else seqused_k.tolist()
        return cls(tuple(cu_q[:-1]), tuple(b - a for a, b in itertools.pairwise(cu_q)),
                   tuple(cu_k[:-1]), tuple(used))

    def table(self, block: int, *, by_keys: bool, device: torch.device) -> Tensor:
        """The programs of a varlen launch, five int32 each ``(q0, L_s, k0, S_s, start)``: one
        per query block of every sequence (``by_keys`` False: forward, ``dq``), or one per key
        block of every sequence with queries (``by_keys``: ``dk, dv``; the other key rows keep
        the zeros they arrive with)."""
        rows: list[int] = []
        for q0, lq, k0, sk in zip(self.q0, self.lq, self.k0, self.sk, strict=True):
            if by_keys and lq == 0:
                continue
            for start in range(0, sk if by_keys else lq, block):
                rows += (q0, lq, k0, sk, start)
        return torch.tensor(rows, dtype=torch.int32).to(device)


def _heads_view(x: Tensor) -> Tensor:
    """A packed ``(T, H, X)`` as a contiguous ``(1, H, T, X)``: each head's rows in one run,
    every sequence a run of rows in it."""
    return x.transpose(0, 1).unsqueeze(0).contiguous()


def _launch_options(kernel: str, dim: int, dtype: torch.dtype) -> dict[str, int]:
    cfg = configs.config(kernel, dim, dtype)
    if FORCED is not None:
        return dict(BLOCK_M=FORCED.block_m, BLOCK_N=FORCED.block_n, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages)
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def _flags(query: Tensor, rel_keys: Tensor | None, rel_values: Tensor | None,
           key_mask: Tensor | None, is_causal: bool, varlen: bool = False) -> dict[str, object]:
    """The kernels' compile-time flags (each combination is one compiled kernel)."""
    return dict(HAS_QA=rel_keys is not None, HAS_AV=rel_values is not None,
                HAS_KM=key_mask is not None, CAUSAL=is_causal,
                ACC=_TL_DTYPE[accumulation_dtype(query.dtype)],
                BF16_EMULATED=query.dtype == torch.bfloat16 and interpreted(), VARLEN=varlen)


def _key_term(query: Tensor, rel_keys: Tensor, scale: float, acc: torch.dtype) -> Tensor:
    """``QA = scale * q @ aK^T``: (B, H, L, D) @ (Hr, D, R) -> (B, H, L, R)."""
    return (torch.matmul(query.to(acc), rel_keys.to(acc).transpose(-1, -2)) * scale).contiguous()


def _mask_bytes(key_mask: Tensor | None, like: Tensor) -> Tensor:
    # (B, S) bool as bytes (1 = real token); a placeholder when absent (never read)
    return like if key_mask is None else key_mask.contiguous().view(torch.uint8)


def forward(
    query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_mask: Tensor | None, *, left: int, right: int,
    is_causal: bool, scale: float, query_start: int, packed: Packed | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``out (B, H, L, Dv)``, ``lse (B, H, L)`` (+inf for rows that see no key) and the bucket
    masses ``Pb (B, H, L, R)`` (empty without a values table), from contiguous inputs.

    With ``packed`` the inputs are a packed batch as :func:`_heads_view` lays it out
    (``B = 1``, ``L = Tq``, ``S = Tk``): one program per (query block of a sequence, head),
    ``query_start`` ignored (each sequence's is ``S_s - L_s``)."""
    B, H, L, D = query.shape
    S, Dv = key.shape[2], value.shape[3]
    R = left + right + 1
    acc = accumulation_dtype(query.dtype)
    qa = query if rel_keys is None else _key_term(query, rel_keys, scale, acc)
    if rel_values is None:
        av, pb = query, query.new_empty(0, dtype=acc)
    else:
        av = rel_values.contiguous()
        pb = torch.full((B, H, L, R), float("-inf"), dtype=acc, device=query.device)
    out = query.new_empty(B, H, L, Dv)
    lse = query.new_empty(B, H, L, dtype=acc)
    opts = _launch_options("forward", max(D, Dv), query.dtype)
    tab, grid = _grid(packed, L, B * H, opts["BLOCK_M"], by_keys=False, like=lse)
    if grid[0] == 0:
        return out, lse, pb
    forward_kernel[grid](
        query, key, value, qa, av, _mask_bytes(key_mask, query), out, lse,
        pb if pb.numel() else lse, tab,
        H, L, S, D, Dv, R, left, query_start, scale,
        0 if rel_values is None or rel_values.shape[0] == 1 else R * Dv,
        **_flags(query, rel_keys, rel_values, key_mask, is_causal, packed is not None),
        BLOCK_D=configs.block_dim(D), BLOCK_DV=configs.block_dim(Dv), BLOCK_R=configs.BLOCK_R,
        **opts,
    )
    return out, lse, pb


def _grid(packed: Packed | None, length: int, rows: int, block: int, *, by_keys: bool,
          like: Tensor) -> tuple[Tensor, tuple[int, int]]:
    """The program table (``like``, never read, when padded) and the grid of a launch over
    ``length`` query or key rows of each of ``rows`` batch·head rows."""
    if packed is None:
        return like, (triton.cdiv(length, block), rows)
    tab = packed.table(block, by_keys=by_keys, device=like.device)
    return tab, (tab.numel() // 5, rows)


def _table_grad(weights_BHLR: Tensor, x_BHLX: Tensor, heads: int) -> Tensor:
    """``sum_{b, l} w[b, h, l, r] x[b, h, l, :]`` -> (H, R, X), summed over heads when the table
    is shared (``heads == 1``): one GEMM per head, a fixed order."""
    grad = torch.einsum("bhlr,bhlx->hrx", weights_BHLR, x_BHLX)
    return grad.sum(0, keepdim=True) if heads == 1 else grad


def backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_mask: Tensor | None, out: Tensor, lse: Tensor, pb: Tensor, *,
    left: int, right: int, is_causal: bool, scale: float, query_start: int,
    packed: Packed | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Gradients for query, key, value, rel_keys and rel_values (None for an absent table);
    ``packed`` as in :func:`forward` (then the key rows no sequence uses get zeros)."""
    B, H, L, D = query.shape
    S, Dv = key.shape[2], value.shape[3]
    R = left + right + 1
    acc = accumulation_dtype(query.dtype)
    do = grad_out.contiguous()
    do_acc = do.to(acc)
    delta = (do_acc * out.to(acc)).sum(-1).contiguous()  # (B, H, L): dO_i . out_i
    qa = query if rel_keys is None else _key_term(query, rel_keys, scale, acc)
    doa = do if rel_values is None else torch.matmul(  # dO @ aV^T: (B, H, L, R)
        do_acc, rel_values.to(acc).transpose(-1, -2)).contiguous()
    km = _mask_bytes(key_mask, query)
    flags = _flags(query, rel_keys, rel_values, key_mask, is_causal, packed is not None)
    dims = dict(BLOCK_D=configs.block_dim(D), BLOCK_DV=configs.block_dim(Dv))
    scalars = (H, L, S, D, Dv, R, left, query_start, scale)

    new = torch.empty_like if packed is None else torch.zeros_like
    dk, dv = new(key), new(value)
    opts = _launch_options("backward_dkdv", max(D, Dv), query.dtype)
    tab, grid = _grid(packed, S, B * H, opts["BLOCK_N"], by_keys=True, like=lse)
    if grid[0]:
        backward_dkdv_kernel[grid](
            query, key, value, qa, doa, km, do, lse, delta, dk, dv, tab, *scalars, **flags,
            **dims, **opts,
        )
    dq_acc = query.new_empty(B, H, L, D, dtype=acc)
    dsb = (lse if rel_keys is None
           else torch.zeros(B, H, L, R, dtype=acc, device=query.device))
    opts = _launch_options("backward_dq", max(D, Dv), query.dtype)
    tab, grid = _grid(packed, L, B * H, opts["BLOCK_M"], by_keys=False, like=lse)
    if grid[0]:
        backward_dq_kernel[grid](
            query, key, value, qa, doa, km, do, lse, delta, dq_acc, dsb, tab, *scalars, **flags,
            **dims, **opts,
        )
    drk = drv = None
    if rel_keys is not None:
        dq_acc = dq_acc + torch.matmul(dsb, rel_keys.to(acc))  # dSb @ aK
        drk = (_table_grad(dsb, query.to(acc), rel_keys.shape[0]) * scale).to(rel_keys.dtype)
    if rel_values is not None:
        drv = _table_grad(pb, do_acc, rel_values.shape[0]).to(rel_values.dtype)
    dq = (dq_acc * scale).to(query.dtype)
    return dq, dk, dv, drk, drv


def forward_varlen(
    query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, packed: Packed, *, left: int, right: int, is_causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """A packed batch ``query (Tq, H, D)``, ``key (Tk, H, D)``, ``value (Tk, H, Dv)``:
    ``out (Tq, H, Dv)``, ``lse (H, Tq)`` and the bucket masses ``Pb (1, H, Tq, R)`` (empty
    without a values table), by the padded kernels over the :func:`_heads_view` layout."""
    out, lse, pb = forward(
        _heads_view(query), _heads_view(key), _heads_view(value), rel_keys, rel_values, None,
        left=left, right=right, is_causal=is_causal, scale=scale, query_start=0, packed=packed,
    )
    return out[0].transpose(0, 1).contiguous(), lse[0], pb


def backward_varlen(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, packed: Packed, out: Tensor, lse: Tensor, pb: Tensor, *,
    left: int, right: int, is_causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """The gradients of :func:`forward_varlen` (packed layouts; ``dk``, ``dv`` zero in the key
    rows no sequence uses)."""
    dq, dk, dv, drk, drv = backward(
        _heads_view(grad_out), _heads_view(query), _heads_view(key), _heads_view(value),
        rel_keys, rel_values, None, _heads_view(out), lse.unsqueeze(0).contiguous(), pb,
        left=left, right=right, is_causal=is_causal, scale=scale, query_start=0, packed=packed,
    )
    return (dq[0].transpose(0, 1).contiguous(), dk[0].transpose(0, 1).contiguous(),
            dv[0].transpose(0, 1).contiguous(), drk, drv)
