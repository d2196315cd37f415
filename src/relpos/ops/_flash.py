"""torch's flash kernels that return logsumexp, guarded: what the flash_regions and decode
backends call.

The flash_regions backend needs, for one "lower region" (query ``i`` sees keys ``j <= i + c``), the
plain attention output, its logsumexp, and a backward that takes an arbitrary ``out`` and
``logsumexp``; the decode backend needs the same forward over a KV cache's far keys. torch
exposes exactly that through internal ops:

- CPU: ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``;
- CUDA: ``aten::_efficient_attention_forward`` / ``_efficient_attention_backward``
  (``num_splits_key=1`` for a deterministic backward).

The CPU kernels read rows through the tensors' strides but assume a unit stride in the last
dimension (a transposed or otherwise strided input gives silently wrong numbers):
:func:`kernel_layout` copies exactly those inputs, and every call below goes through it.

Both apply ``is_causal`` top-left aligned (query ``a`` sees key ``b <= a``), so a region with
an offset is cut into at most two pieces (:func:`lower_pieces`). Internal ops change between
torch releases: :data:`EXPECTED_SCHEMAS` holds the signatures this module was written
against, and ``tests/ops/test_flash_regions.py`` fails loudly when they differ.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "EXPECTED_SCHEMAS",
    "Piece",
    "flash_backward",
    "flash_forward",
    "kernel_layout",
    "kernel_scale",
    "lower_pieces",
    "restore_nan_rows",
]

EXPECTED_SCHEMAS: dict[str, str] = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, "
        "Tensor value, float dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, "
        "float? scale=None) -> (Tensor output, Tensor logsumexp)"
    ),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, "
        "Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, float dropout_p, "
        "bool is_causal, *, Tensor? attn_mask=None, float? scale=None) -> (Tensor grad_query, "
        "Tensor grad_key, Tensor grad_value)"
    ),
    "_efficient_attention_forward": (
        "aten::_efficient_attention_forward(Tensor query, Tensor key, Tensor value, "
        "Tensor? bias, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt? max_seqlen_q, "
        "SymInt? max_seqlen_k, float dropout_p, int custom_mask_type, "
        "bool compute_log_sumexp=False, *, float? scale=None, Tensor? seqlen_k=None, "
        "int? window_size=None) -> (Tensor output, Tensor logsumexp, Tensor philox_seed, "
        "Tensor philox_offset, SymInt max_seqlen_batch_q, SymInt max_seqlen_batch_k)"
    ),
    "_efficient_attention_backward": (
        "aten::_efficient_attention_backward(Tensor grad_out_, Tensor query, Tensor key, "
        "Tensor value, Tensor? bias, Tensor out, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
        "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor logsumexp, float dropout_p, "
        "Tensor philox_seed, Tensor philox_offset, int custom_mask_type, "
        "bool bias_requires_grad, *, float? scale=None, int? num_splits_key=None, "
        "int? window_size=None, bool shared_storage_dqdkdv=False) -> (Tensor, Tensor, Tensor, "
        "Tensor)"
    ),
}

_LSE_ALIGN_CUDA = 32  # the CUDA memory-efficient kernel pads logsumexp rows to this multiple


@dataclass(frozen=True)
class Piece:
    """Queries ``[q0, q1)`` against keys ``[k0, k1)``; ``is_causal``: top-left causal mask."""

    q0: int
    q1: int
    k0: int
    k1: int
    is_causal: bool


def lower_pieces(L: int, S: int, c: int) -> list[Piece]:
    """Cut the region "query ``i`` sees key ``j`` iff ``j <= i + c``" into kernel calls.

    Every (query, key) pair of the region lands in exactly one piece; queries that see no
    key are in no piece. A top-left causal kernel serves offset ``c = -i0`` in one call; a
    positive offset ``c' > 0`` needs a non-causal prefix (keys ``0..c'``, seen by every query)
    and a causal remainder.

    Args:
        L: number of queries.
        S: number of keys.
        c: the offset of the region's diagonal.

    Returns:
        Non-empty pieces, at most two.
    """
    i0 = max(0, -c)
    if i0 >= L or S == 0:
        return []
    c1 = c + i0  # >= 0: query i0 sees keys 0..c1
    s_end = min(S, L + c)  # keys j <= L - 1 + c
    if c1 == 0:
        return [Piece(i0, L, 0, s_end, True)]
    pieces = [Piece(i0, L, 0, min(c1 + 1, S), False)]
    if c1 + 1 < s_end:
        pieces.append(Piece(i0 + 1, L, c1 + 1, s_end, True))
    return pieces


def kernel_layout(x: Tensor) -> Tensor:
    """``x`` as the flash kernels read it: unit stride in the last dimension (a copy only when
    it is not; expanded and sliced batch, head and row strides are kept)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def restore_nan_rows(
    q: Tensor, k: Tensor, out: Tensor, lse: Tensor, live: Tensor | None, *, is_causal: bool,
    bias: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Give NaN to the rows the CPU flash kernel reports as empty although they see a key.

    The kernel returns ``out = 0, lse = 0`` both for a row with no visible key and for a row
    whose every visible score is NaN (a NaN query row, or NaN in all the keys it sees), so a
    NaN would silently vanish. Only rows with ``lse == 0`` that the caller knows see a key
    (``live``) are re-examined, a bounded number of rows at a time: in the common case this
    costs one comparison over ``(B, H, L)``.

    Args:
        q, k: the kernel's ``(B, H, L, D)`` and ``(B, H, S, D)`` inputs.
        out, lse: its ``(B, H, L, Dv)`` and ``(B, H, L)`` outputs.
        live: broadcastable to ``(B, H, L)``: True where the row sees a real key (None: every
            row does).
        is_causal, bias: the call's top-left causal flag and ``(B|1, H|1, 1, S)`` key bias.

    Returns:
        ``out`` and ``lse``, with NaN in the rows that see a NaN score.
    """
    suspects = lse == 0
    if live is not None:
        suspects = suspects & live
    if not bool(suspects.any()):
        return out, lse
    S = k.shape[2]
    nan_rows = torch.zeros_like(suspects)
    cols = torch.arange(S, device=q.device)
    for b, h in {(int(b), int(h)) for b, h, _ in suspects.nonzero().tolist()}:
        rows = suspects[b, h].nonzero().squeeze(-1)  # (n,)
        key_visible = torch.ones(S, dtype=torch.bool, device=q.device)
        if bias is not None:  # a key hidden by the bias does not count, NaN or not
            key_visible = bias[0 if bias.shape[0] == 1 else b,
                               0 if bias.shape[1] == 1 else h, 0] > float("-inf")
        for chunk in rows.split(max(1, (1 << 22) // max(1, S))):
            scores = q[b, h, chunk] @ k[b, h].transpose(0, 1)  # (n, S)
            visible = key_visible[None, :]
            if is_causal:
                visible = visible & (cols[None, :] <= chunk[:, None])
            nan_rows[b, h, chunk] = (scores.isnan() & visible).any(-1)
    if not bool(nan_rows.any()):
        return out, lse
    return (out.masked_fill(nan_rows[..., None], math.nan),
            lse.masked_fill(nan_rows, math.nan))


def _cuda_lse_pad(lse_BHL: Tensor) -> Tensor:
    L = lse_BHL.shape[-1]
    padded = math.ceil(L / _LSE_ALIGN_CUDA) * _LSE_ALIGN_CUDA
    return F.pad(lse_BHL, (0, padded - L), value=math.inf).contiguous()


def _as_float32(x: float) -> float:
    """``x`` rounded to float32 (``+-inf`` past its range)."""
    try:
        return float(struct.unpack("f", struct.pack("f", x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)


def kernel_scale(q: Tensor, scale: float) -> tuple[Tensor, float, float]:
    """``(q', scale', dq_factor)`` with ``scale' * q' . k == scale * q . k`` and ``scale' > 0``.

    The CPU flash kernel applies its causal mask before the scale, so a scale that is zero or
    negative in the kernel's accumulation type (float32 for every dtype but float64) turns the
    masked ``-inf`` into NaN or ``+inf``. A negative scale runs as ``|scale|`` on ``-q``; a zero
    one (``0.0``, ``-0.0``, or too small to be represented) as ``1`` on ``0 * q``, which keeps a
    NaN query NaN. The kernel's query gradient is multiplied by ``dq_factor`` (1, -1 or 0).
    """
    seen = scale if q.dtype == torch.float64 else _as_float32(scale)
    if seen > 0:
        return q, scale, 1.0
    if seen < 0:
        return -q, -scale, -1.0
    return q * 0.0, 1.0, 0.0


def flash_forward(
    q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, bias: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Plain attention ``(B, H, L, D) x (B, H, S, D) -> (B, H, L, Dv)`` and logsumexp ``(B, H, L)``.

    ``bias`` is ``None`` or an additive ``(B, 1, 1, S)`` key bias (0 or -inf). Rows whose keys
    are all masked come back as zeros with a meaningless logsumexp: the caller guards them.
    Every finite ``scale`` is served, zero and negative ones included (:func:`kernel_scale`).
    """
    q, scale, _ = kernel_scale(q, scale)
    q, k, v = kernel_layout(q), kernel_layout(k), kernel_layout(v)
    if q.device.type == "cuda":
        if bias is not None:  # pragma: no cover - refused by unsupported_reason
            raise RuntimeError("key bias is not supported on CUDA")
        out, lse, _, _, _, _ = torch.ops.aten._efficient_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, None,
            q.shape[2], k.shape[2], 0.0, 1 if is_causal else 0, True, scale=scale,
        )
        return out.transpose(1, 2), lse[..., : q.shape[2]]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale
    )
    return out, lse


def flash_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    is_causal: bool,
    bias: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Flash backward with a caller-chosen ``out`` and ``lse`` (see docs/design.md §3).

    With ``P_ij = exp(scale * q_i . k_j - lse_i)`` and ``delta_i = grad_out_i . out_i`` it
    returns ``dq = scale * dS k``, ``dk = scale * dS^T q``, ``dv = P^T grad_out`` for
    ``dS_ij = P_ij (grad_out_i . v_j - delta_i)``, for every finite ``scale``
    (:func:`kernel_scale`).
    """
    q, scale, dq_factor = kernel_scale(q, scale)
    dq, dk, dv = _flash_backward(grad_out, q, k, v, out, lse, is_causal=is_causal, bias=bias,
                                 scale=scale)
    return (dq if dq_factor == 1.0 else dq * dq_factor), dk, dv


def _flash_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
    is_causal: bool, bias: Tensor | None, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    grad_out, q, k, v, out = (kernel_layout(t) for t in (grad_out, q, k, v, out))
    if q.device.type == "cuda":
        if bias is not None:  # pragma: no cover - refused by unsupported_reason
            raise RuntimeError("key bias is not supported on CUDA")
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            None, out.transpose(1, 2), None, None, q.shape[2], k.shape[2],
            _cuda_lse_pad(lse.float()), 0.0, empty, empty, 1 if is_causal else 0, False,
            scale=scale, num_splits_key=1,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse.contiguous(), 0.0, is_causal, attn_mask=bias, scale=scale
    )
    return dq, dk, dv
