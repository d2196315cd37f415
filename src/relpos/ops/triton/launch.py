"""Forward and backward of the Triton backend: the small GEMMs around the kernels, and the
launches. Imports Triton (load it only when a call runs).

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
R = left + right + 1 table rows, Hr table heads (1 or H).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from relpos.ops._numerics import accumulation_dtype
from relpos.ops.triton import configs
from relpos.ops.triton.kernels import backward_dkdv_kernel, backward_dq_kernel, forward_kernel

__all__ = ["Blocks", "backward", "forward", "interpreted"]

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


def _launch_options(kernel: str, dim: int, dtype: torch.dtype) -> dict[str, int]:
    cfg = configs.config(kernel, dim, dtype)
    if FORCED is not None:
        return dict(BLOCK_M=FORCED.block_m, BLOCK_N=FORCED.block_n, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages)
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def _flags(query: Tensor, rel_keys: Tensor | None, rel_values: Tensor | None,
           key_mask: Tensor | None, is_causal: bool) -> dict[str, object]:
    """The kernels' compile-time flags (each combination is one compiled kernel)."""
    return dict(HAS_QA=rel_keys is not None, HAS_AV=rel_values is not None,
                HAS_KM=key_mask is not None, CAUSAL=is_causal,
                ACC=_TL_DTYPE[accumulation_dtype(query.dtype)],
                BF16_EMULATED=query.dtype == torch.bfloat16 and interpreted())


def _key_term(query: Tensor, rel_keys: Tensor, scale: float, acc: torch.dtype) -> Tensor:
    """``QA = scale * q @ aK^T``: (B, H, L, D) @ (Hr, D, R) -> (B, H, L, R)."""
    return (torch.matmul(query.to(acc), rel_keys.to(acc).transpose(-1, -2)) * scale).contiguous()


def _mask_bytes(key_mask: Tensor | None, like: Tensor) -> Tensor:
    # (B, S) bool as bytes (1 = real token); a placeholder when absent (never read)
    return like if key_mask is None else key_mask.contiguous().view(torch.uint8)


def forward(
    query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_mask: Tensor | None, *, left: int, right: int,
    is_causal: bool, scale: float, query_start: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``out (B, H, L, Dv)``, ``lse (B, H, L)`` (+inf for rows that see no key) and the bucket
    masses ``Pb (B, H, L, R)`` (empty without a values table), from contiguous inputs."""
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
    grid = (triton.cdiv(L, opts["BLOCK_M"]), B * H)
    forward_kernel[grid](
        query, key, value, qa, av, _mask_bytes(key_mask, query), out, lse,
        pb if pb.numel() else lse,
        H, L, S, D, Dv, R, left, query_start, scale,
        0 if rel_values is None or rel_values.shape[0] == 1 else R * Dv,
        **_flags(query, rel_keys, rel_values, key_mask, is_causal),
        BLOCK_D=configs.block_dim(D), BLOCK_DV=configs.block_dim(Dv), BLOCK_R=configs.BLOCK_R,
        **opts,
    )
    return out, lse, pb


def _table_grad(weights_BHLR: Tensor, x_BHLX: Tensor, heads: int) -> Tensor:
    """``sum_{b, l} w[b, h, l, r] x[b, h, l, :]`` -> (H, R, X), summed over heads when the table
    is shared (``heads == 1``): one GEMM per head, a fixed order."""
    grad = torch.einsum("bhlr,bhlx->hrx", weights_BHLR, x_BHLX)
    return grad.sum(0, keepdim=True) if heads == 1 else grad


def backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_mask: Tensor | None, out: Tensor, lse: Tensor, pb: Tensor, *,
    left: int, right: int, is_causal: bool, scale: float, query_start: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Gradients for query, key, value, rel_keys and rel_values (None for an absent table)."""
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
    flags = _flags(query, rel_keys, rel_values, key_mask, is_causal)
    dims = dict(BLOCK_D=configs.block_dim(D), BLOCK_DV=configs.block_dim(Dv))
    scalars = (H, L, S, D, Dv, R, left, query_start, scale)

    dk, dv = torch.empty_like(key), torch.empty_like(value)
    opts = _launch_options("backward_dkdv", max(D, Dv), query.dtype)
    backward_dkdv_kernel[(triton.cdiv(S, opts["BLOCK_N"]), B * H)](
        query, key, value, qa, doa, km, do, lse, delta, dk, dv, *scalars, **flags, **dims,
        **opts,
    )
    dq_acc = query.new_empty(B, H, L, D, dtype=acc)
    dsb = (lse if rel_keys is None
           else torch.zeros(B, H, L, R, dtype=acc, device=query.device))
    opts = _launch_options("backward_dq", max(D, Dv), query.dtype)
    backward_dq_kernel[(triton.cdiv(L, opts["BLOCK_M"]), B * H)](
        query, key, value, qa, doa, km, do, lse, delta, dq_acc, dsb, *scalars, **flags, **dims,
        **opts,
    )
    drk = drv = None
    if rel_keys is not None:
        dq_acc = dq_acc + torch.matmul(dsb, rel_keys.to(acc))  # dSb @ aK
        drk = (_table_grad(dsb, query.to(acc), rel_keys.shape[0]) * scale).to(rel_keys.dtype)
    if rel_values is not None:
        drv = _table_grad(pb, do_acc, rel_values.shape[0]).to(rel_values.dtype)
    dq = (dq_acc * scale).to(query.dtype)
    return dq, dk, dv, drk, drv
