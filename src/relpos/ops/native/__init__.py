"""Native backend: exact clipped relative attention in one fused C++ kernel per direction, on CPU.

Flash attention with Toeplitz buckets (docs/design.md §6): per query block and key block,
``scale * q @ k^T`` plus the relative key term gathered from ``QA = scale * q @ aK^T``
(``(L, R)``, one small GEMM; key blocks wholly beyond the band add one constant per row), an
online softmax, ``P @ V`` and per-row bucket masses ``Pb`` (``(L, R)``) for the value term,
``out = (acc + Pb @ aV) / l``. The backward recomputes ``P`` tile by tile with
``dS = P * (dP - delta)``, ``dP`` including ``dO @ aV^T`` gathered. Extra memory is O(L·R) per
head, never O(L·S). Equivalent to :mod:`relpos.ops.reference`.

Serves every call on CPU tensors (float32, float64, bfloat16, float16 — half precision read
directly by the forward, with 16-bit GEMMs and float32 sums: docs/numerics.md), except a float
``attn_mask`` that requires grad: causal or not, ``key_mask`` padding, a bool or float
``attn_mask`` (one that depends on the key only, ``(B, 1, 1, S)`` as ``nn.TransformerEncoder``
hands a padding mask over, is read as an O(B·S) key bias; a dense one is read in place,
broadcast), ``query_start`` / bottom-right alignment, windows ``(left, right)``, keys-only and
values-only, shared or per-head tables, ``Dv != D``, attention dropout (in the kernel: a
counter-based hash of a seed drawn from torch's default generator, regenerated in the backward;
:func:`dropout_mask` exposes it), and KV-cache steps.
Rows that see no key give zeros and zero gradients.

The C++ sources (``csrc/``) are compiled on first use and cached (:mod:`.build`); without a
compiler, or with ``RELPOS_NATIVE=0``, this backend passes every call by and the PyTorch
backends serve it. Registered as the custom op ``relpos::native_attention`` (:mod:`.op`), so
``torch.compile(fullgraph=True)`` traces it; packed variable-length batches (flash-attention's
varlen layout, ``seqused_k`` included: KV caches with spare capacity) as
``relpos::native_attention_varlen``, whose dropout masks :func:`dropout_mask_varlen` gives.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
R = left + right + 1 table rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from relpos.ops._numerics import accumulation_dtype
from relpos.ops.call import AttentionCall, Reason, ensure_served, needs_backward
from relpos.ops.native import build

__all__ = [
    "SCALAR_MAX_KEYS",
    "attention",
    "auto_reason",
    "available",
    "draw_seed",
    "dropout_mask",
    "dropout_mask_varlen",
    "masks",
    "unsupported_reason",
]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def available() -> bool:
    """Whether the native kernels can run here (building them now if needed)."""
    return not _state()


def _state() -> str:
    """Why the kernels cannot run here ("" when they can), building them on first use. A
    constant for ``torch.compile``: it is asked once, while tracing, not on every call."""
    if build.disabled():
        return "the native kernels are turned off (RELPOS_NATIVE=0)"
    if build.load() is None:
        return ("the native kernels could not be built here: "
                f"{build.failure() or 'see the warning'}; the PyTorch backends serve the call")
    return ""


SCALAR_MAX_KEYS = 512
"""The most keys (S) at which auto-selection picks kernels built without vector code
(``vectors=none`` in ``build_info()``: a build for a CPU other than x86-64's, or the x86-64
``baseline`` variant), whose row passes are compiled C++ loops and whose float32 GEMMs run on
libtorch's brgemm. Measured with the x86-64 ``baseline`` variant, its GEMMs then on libtorch's
matrix multiply (benchmarks/no_vector_kernels_epyc.md; AMD EPYC, 2 threads, H=8,
D=64, K = 16 and 64, 4096 tokens per batch): up to 8 x 512 they ran at 0.57-1.04x the time of
the faster PyTorch backend, forward and forward + backward, causal or not; from 4 x 1024 on the
flash_regions backend (torch's vectorized flash kernel) was up to 1.85x faster in the
forward. Longer calls go to the PyTorch backends' own rule."""

#: Why auto-selection passes such kernels by (``S``: the call's keys, or a packed call's longest
#: sequence's).
SCALAR_REASON = ("the native kernels here have no vector code (a build for a CPU other than "
                 "x86-64's, or the baseline variant) and the call has S={S} keys, more than "
                 f"the {SCALAR_MAX_KEYS} up to which they kept pace with the PyTorch backends; "
                 "implementation='native' still runs them")


def _scalar_rows() -> bool:
    """Whether the loaded kernels have no vector code (``vectors=none``): auto-selection then
    picks them for calls of at most :data:`SCALAR_MAX_KEYS` keys only. A constant for
    ``torch.compile``, as :func:`_state`."""
    module = build.load()
    if module is None:
        return False
    info = module.build_info  # asked on every call: read once per loaded module
    if info not in _SCALAR_ROWS:
        _SCALAR_ROWS[info] = not build.has_vectors(module)
    return _SCALAR_ROWS[info]


_SCALAR_ROWS: dict[Any, bool] = {}


# What torch.compiler.assume_constant_result(_state) does, without importing torch._dynamo (and
# through it triton) when relpos is imported; tests/ops/test_native.py checks the two agree.
_state._dynamo_marked_constant = True  # type: ignore[attr-defined]
_scalar_rows._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _shape4(mask: Tensor) -> tuple[int, ...]:
    """The shape of a mask broadcastable to ``(B, H, L, S)``, left-padded to 4-D."""
    return (1,) * (4 - mask.dim()) + tuple(mask.shape)


def _per_key(mask: Tensor) -> bool:
    """Whether a mask broadcastable to ``(B, H, L, S)`` depends on the batch row and the key
    only (its shape says so: size 1 along H and L)."""
    shape = _shape4(mask)
    return shape[1] == 1 and shape[2] == 1


def unsupported_reason(call: AttentionCall) -> Reason | str | None:
    """Why the native backend cannot serve the call, or None."""
    query = call.query
    if query.device.type != "cpu":
        return f"device {query.device} is not supported by the native CPU kernels (allowed: cpu)"
    if query.dtype not in _DTYPES:
        return f"dtype {query.dtype} is not supported (allowed: {_DTYPES})"
    mask = call.attn_mask
    if mask is not None and mask.requires_grad:
        return "a float attn_mask that requires grad (the native kernels give no mask gradient)"
    return _state() or None


def auto_reason(call: AttentionCall) -> Reason | str | None:
    """Auto-selection picks the native backend wherever it serves a call, except kernels
    without vector code on calls of more than :data:`SCALAR_MAX_KEYS` keys."""
    reason = unsupported_reason(call)
    if reason is not None:
        return reason
    if _scalar_rows() and call.key_len > SCALAR_MAX_KEYS:
        return Reason.of(SCALAR_REASON, S=call.key_len)
    return None



def masks(call: AttentionCall) -> tuple[Tensor | None, Tensor | None]:
    """The call's masks as the kernels take them: a ``(B, S)`` additive key bias (from
    ``key_mask`` and from an ``attn_mask`` that depends on the key only) and a dense additive
    ``attn_mask`` broadcastable to ``(B, H, L, S)`` (``-inf`` = hidden), in the kernels' dtype;
    None for what the call does not have."""
    B, _, _, S, _, _ = call.dims
    dtype = accumulation_dtype(call.query.dtype)
    bias: Tensor | None = None
    if call.key_mask is not None:
        bias = torch.zeros(B, S, dtype=dtype).masked_fill_(~call.key_mask, float("-inf"))
    mask, dense = call.attn_mask, None
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        mask = mask.to(dtype)
        if _per_key(mask):
            add = mask.reshape(_shape4(mask))[:, 0, 0, :].expand(B, S)  # (B, S)
            bias = add.contiguous() if bias is None else bias + add
        else:
            dense = mask
    return bias, dense


def draw_seed() -> Tensor:
    """The dropout stream of one call: two int64 drawn from torch's default generator (so
    ``torch.manual_seed`` makes runs reproducible)."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64)


def dropout_mask(seed: Tensor, shape: tuple[int, int, int, int], dropout_p: float) -> Tensor:
    """The keep mask ``(B, H, L, S)`` the kernels apply for ``seed`` (see :func:`draw_seed`)."""
    from relpos.ops.native.op import dropout_mask as mask

    return mask(seed, shape, dropout_p)


def dropout_mask_varlen(seed: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        num_heads: int, dropout_p: float,
                        seqused_k: Tensor | None = None) -> list[Tensor]:
    """The keep masks the kernels apply to a varlen call for ``seed``, one ``(H, L_s, S_s)``
    per sequence, ``S_s`` the keys it uses (see
    :func:`relpos.ops.native.op.dropout_mask_varlen`)."""
    from relpos.ops.native.op import dropout_mask_varlen as masks

    return masks(seed, cu_seqlens_q, cu_seqlens_k, num_heads, dropout_p, seqused_k)


def _kernel_window(call: AttentionCall) -> tuple[int, int]:
    """The window ``(left, right)`` the kernels get. With a table it is the call's (the table has
    ``left + right + 1`` rows). Without tables a window changes nothing, and the kernels get
    ``(0, 0)``: the same in eager and under ``torch.compile``, where :func:`relpos.validate_call`
    does not narrow a window to the sequence, so ``max_distance=10**30`` never reaches the op
    (an int64) or the kernels' arithmetic."""
    if call.rel_keys is None and call.rel_values is None:
        return 0, 0
    return call.left, call.right


def attention(call: AttentionCall) -> Tensor:
    """Native backend: see :func:`relpos.relative_attention` for the meaning of the call.

    Returns:
        ``(B, H, L, Dv)``; rows that see no key are zeros.
    """
    ensure_served("native", unsupported_reason(call))
    from relpos.ops.native import op  # registers relpos::native_attention

    seed = draw_seed() if call.dropout_p > 0.0 else None
    key_bias, attn_bias = masks(call)
    args = (call.query, call.key, call.value, call.rel_keys, call.rel_values, key_bias,
            attn_bias, seed)
    left, right = _kernel_window(call)
    options: dict[str, Any] = dict(
        left=left, right=right, is_causal=call.is_causal, scale=call.scale,
        query_start=call.query_start, dropout_p=call.dropout_p,
    )
    if not needs_backward(call) and not (
        torch.compiler.is_compiling() or torch.compiler.is_exporting()
    ):
        return op.forward(*args, **options)[0]  # inference and decoding: no dispatch cost
    return torch.ops.relpos.native_attention(*args, **options)[0]
