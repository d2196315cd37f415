"""Triton backend: the fused kernel of docs/design.md §6 for CUDA GPUs, written in Triton.

Flash attention with Toeplitz buckets: each tile of scores adds the relative key term from
``QA = scale * q @ aK^T`` (gathered only where the tile crosses the band, a per-row constant
beyond it), the value term goes through per-row bucket masses and one ``Pb @ aV``, and the
backward recomputes the tiles (``dS = P * (dP - delta)``, ``dP`` including ``dO @ aV^T``) with
the table gradients as GEMMs over the bucket sums: deterministic, no atomics. O(L·R) extra
memory per head. Equivalent to :mod:`relpos.ops.reference`.

Registered as the custom op ``relpos::triton_attention`` (:mod:`~relpos.ops.triton.op`, with a
fake implementation and autograd through ``relpos::triton_attention_backward``), so it can be
traced by ``torch.compile(fullgraph=True)``.

Packed variable-length batches (:func:`relpos.relative_attention_varlen`, flash-attention's
``cu_seqlens`` layout, ``seqused_k`` too) run through the same kernels in one launch each: the
custom op ``relpos::triton_attention_varlen`` reads the boundaries once on the host and builds
a table of programs, one per (query block of a sequence, head) in the forward and the ``dq``
pass and per (key block of a sequence, head) in the ``dk, dv`` pass, each with its own key
range and ``query_start = S_s - L_s``: no work across sequences, no mask, the table gradients
as deterministic as the padded path's. :mod:`relpos.varlen` takes it wherever the padded
backend would serve the call's sequences (:func:`unsupported_reason`).

Files: ``kernels.py`` the Triton kernels, ``configs.py`` their block sizes (the table the
ahead-of-time compile test checks for sm_80 and sm_90), ``launch.py`` the launches and the small
GEMMs around them, ``op.py`` the custom op; this module is the backend (:func:`attention` and
the reasons it passes a call by). Importing it does not import Triton.

Serves: keys term and values term (each optional), shared or per-head tables, ``is_causal``,
``key_mask`` (any pattern, read as O(B·S) bytes, never an L x S mask), ``query_start`` and
``L != S`` (KV-cache steps: the same kernel with ``query_start = S - L``), every window,
``D, Dv <= 128`` (``Dv != D`` too); float32 (IEEE products, no TF32), bfloat16 and float16
with float32 accumulation on CUDA (compute capability 8.0 or newer). Not served (see
:func:`unsupported_reason`): dropout, a dense ``attn_mask``, head dims above 128.

Without a GPU: with ``TRITON_INTERPRET=1`` set before the kernels are first imported, Triton's
interpreter runs them on CPU tensors when ``implementation="triton"`` is asked for by name
(float64 too), which is how the tests check the numbers; auto-selection never picks this
backend for CPU tensors. GPU speed is unmeasured (``python -m relpos.bench.cuda_check``
measures it).

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
K clip distance, R = 2K + 1 table rows.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
from torch import Tensor

from relpos.ops._custom_op import run_key_mask_op
from relpos.ops.call import AttentionCall, Reason, ensure_served, no_dropout_or_dense_mask
from relpos.ops.triton import op  # noqa: F401  (registers relpos::triton_attention)

__all__ = ["MAX_HEAD_DIM", "attention", "auto_reason", "unsupported_reason"]

MAX_HEAD_DIM = 128
"""The largest head dim (D and Dv) there are kernel configurations for."""

_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INTERPRETER_DTYPES = (*_CUDA_DTYPES, torch.float64)
_MAX_GRID_Y = 65535  # B * H is the second grid dimension


def attention(call: AttentionCall) -> Tensor:
    """Triton backend: see :func:`relpos.relative_attention` for the meaning of the call.

    Returns:
        ``(B, H, L, Dv)``; rows that see no key are zeros.
    """
    ensure_served("triton", unsupported_reason(call))
    return run_key_mask_op(torch.ops.relpos.triton_attention, call)


def _interpreter_reason() -> str | None:
    """Why the kernels cannot run on CPU tensors in this process, or None."""
    if "relpos.ops.triton.kernels" in sys.modules:  # loaded: interpreted or compiled for good
        from relpos.ops.triton import launch

        if launch.interpreted():
            return None
        return ("the Triton kernels were loaded compiled for the GPU (TRITON_INTERPRET=1 was "
                "not set when they were imported), so they cannot run on CPU tensors")
    if os.environ.get("TRITON_INTERPRET") != "1":
        return ("CPU tensors run the Triton kernels only under Triton's interpreter "
                "(set TRITON_INTERPRET=1 before the first call); the backend is for CUDA")
    return None


def unsupported_reason(call: AttentionCall) -> Reason | str | None:
    """Why the triton backend cannot serve the call (hard limitations only), or None."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install 'relpos[gpu]')"
    reason = no_dropout_or_dense_mask(call, "triton")
    if reason is not None:
        return reason
    B, H, *_, D, Dv = call.dims
    if max(D, Dv) > MAX_HEAD_DIM:
        return Reason.of("head dims D={D}, Dv={Dv}: the triton backend serves D, Dv <= {most}",
                         D=D, Dv=Dv, most=MAX_HEAD_DIM)
    if B * H > _MAX_GRID_Y:
        return Reason.of("B * H = {bh} exceeds the kernels' grid limit {most}", bh=B * H,
                         most=_MAX_GRID_Y)
    query = call.query
    device = query.device.type
    if device == "cuda":
        if torch.version.hip is not None:
            return "ROCm devices are not checked for the triton backend (only NVIDIA sm_80+)"
        if query.dtype not in _CUDA_DTYPES:
            return f"dtype {query.dtype} is not supported on CUDA (allowed: {_CUDA_DTYPES})"
        capability = torch.cuda.get_device_capability(query.device)
        if capability < (8, 0):
            return (f"compute capability {capability} is below (8, 0); the triton kernels are "
                    "checked for sm_80 and sm_90")
        return None
    if device == "cpu":
        reason = _interpreter_reason()
        if reason is not None:
            return reason
        if query.dtype not in _INTERPRETER_DTYPES:
            return (f"dtype {query.dtype} is not supported under the interpreter "
                    f"(allowed: {_INTERPRETER_DTYPES})")
        return None
    return f"device {query.device} is not supported (allowed: cuda; cpu under TRITON_INTERPRET=1)"


def auto_reason(call: AttentionCall) -> Reason | str | None:
    """Why ``implementation=None`` does not pick the triton backend: never for CPU tensors
    (the interpreter is for checking, not for speed), else :func:`unsupported_reason`."""
    if call.query.device.type != "cuda":
        return (f"auto-selection uses the triton backend for CUDA tensors only (got "
                f"{call.query.device}); ask for implementation='triton' to run the kernels "
                "under TRITON_INTERPRET=1")
    return unsupported_reason(call)
