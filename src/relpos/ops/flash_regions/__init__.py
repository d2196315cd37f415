"""The flash_regions backend: exact clipped relative attention at about the cost of one flash
attention, as a decomposition into regions served by torch's flash kernels (not a kernel of its
own: the fused kernels are the native and triton backends).

Exact region decomposition (docs/design.md §3): for query ``i`` at position ``p_i`` every key with
``j - p_i <= -K`` sees the relative row ``-K`` and every key with ``j - p_i >= K`` the row
``+K``, so those two far regions are plain attention plus one constant per row, served by a
flash kernel that returns its logsumexp (O(n) memory); the band ``|j - p_i| < K`` is computed
explicitly in tiles, and the three parts are merged by logsumexp. The backward hands each flash
backward the global output and logsumexp, so the whole backward is exact too, and
deterministic (no atomics, no scatter with duplicate indices). Equivalent to
:mod:`relpos.ops.reference`.

Registered as the custom op ``relpos::fused_attention`` (:mod:`~relpos.ops.flash_regions.op`,
with a fake implementation and an autograd formula through ``relpos::fused_attention_backward``),
so it can be traced by ``torch.compile(fullgraph=True)``. The op keeps the name it had before
the backend was renamed (``implementation="fused"``, still accepted with a DeprecationWarning),
so programs exported with it still load.

Files: ``far.py`` the far regions, ``band.py`` the band, ``far_terms.py`` the far rows'
closed-form relative terms, ``decomposition.py`` the forward and backward that put them
together, ``op.py`` the custom op; this module is the backend (:func:`attention` and the
reasons it passes a call by). The guarded flash-kernel wrappers (:mod:`relpos.ops._flash`)
and the logsumexp merge (:mod:`relpos.ops._lse`) are shared with the decode backend.

Serves: keys term and values term (each optional), shared or per-head tables, ``is_causal``,
``key_mask`` (any pattern, as an O(B·S) key bias, never an L x S mask), ``query_start`` and
``L != S``, every ``K >= 0``; float32, float64, bfloat16 and float16 on CPU; float32, bfloat16
and float16 on CUDA (without ``key_mask``). Not served (see :func:`unsupported_reason`):
dropout, a dense ``attn_mask``, ``Dv != D``.

Internal torch ops: ``aten::_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``) on
CPU and ``aten::_efficient_attention_forward`` / ``_backward`` on CUDA. Tested torch range:
2.13.x on CPU (the CUDA path is checked separately by ``python -m relpos.bench.cuda_check`` and
is only used when asked for by name). ``tests/ops/test_flash_regions.py`` compares the ops'
schemas with the ones this module was written against and fails loudly when a torch release
changes them.

Auto-selection (:func:`auto_reason`) also leaves short sequences to the bucketed backend,
which is faster there: below :func:`crossover_keys` keys, a threshold that depends on
whether the call needs a backward pass and on causality (:data:`CROSSOVER`); asking for
``implementation="flash_regions"`` by name only refuses the hard limitations of
:func:`unsupported_reason`.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
K clip distance, R = 2K + 1 table rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relpos.ops._custom_op import run_key_mask_op
from relpos.ops.call import (
    AttentionCall,
    Reason,
    ensure_served,
    needs_backward,
    no_dropout_or_dense_mask,
)
from relpos.ops.flash_regions import op  # noqa: F401  (registers relpos::fused_attention)

__all__ = [
    "CROSSOVER",
    "CROSSOVER_KEYS",
    "attention",
    "auto_reason",
    "crossover_keys",
    "unsupported_reason",
]

CROSSOVER: dict[tuple[bool, bool], int] = {
    # (needs a backward pass, causal) -> fewest keys S at which auto picks flash_regions on CPU
    (False, True): 256,
    (False, False): 512,
    (True, True): 256,
    (True, False): 512,
}
"""Where the flash_regions backend overtakes the bucketed one on CPU, from the training-shapes
table (``relpos bench --preset training``, 4096 tokens per batch, K = 16 and 64, H=8, D=64;
benchmarks/training_shapes_xeon.md, five runs): the bucketed backend's cost grows with B·H·L·S
(every score gathered and scattered), the flash_regions one's with the flash kernel's work plus
the O(L·K) band. With a causal mask the flash kernel skips the masked half and flash_regions wins
from S = 256; without one, the two far regions each fill the kernel's 512-key blocks, and
bucketed (or the reference) stays as fast up to S = 256. At S = 128 causal forward, K = 64,
flash_regions was 1.17-1.31x slower than the reference or bucketed in three of four runs (with
K = 16 the three came within about 20% of each other), so the pass does not move the
crossover on this CPU; it stays a key because another CPU may differ."""

CROSSOVER_KEYS = max(CROSSOVER.values())
"""From this many keys (S) auto-selection picks the flash_regions backend for every call it
serves."""


def crossover_keys(call: AttentionCall) -> int:
    """The fewest keys at which auto-selection picks flash_regions for ``call``
    (:data:`CROSSOVER`)."""
    return CROSSOVER[(needs_backward(call), bool(call.is_causal))]

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def attention(call: AttentionCall) -> Tensor:
    """The flash_regions backend: see :func:`relpos.relative_attention` for the meaning of the call.

    Returns:
        ``(B, H, L, Dv)``; rows that see no key are zeros.
    """
    ensure_served("flash_regions", unsupported_reason(call))
    return run_key_mask_op(torch.ops.relpos.fused_attention, call)


def unsupported_reason(call: AttentionCall) -> Reason | str | None:
    """Why the flash_regions backend cannot serve the call (hard limitations only), or None."""
    query = call.query
    reason = no_dropout_or_dense_mask(call, "flash_regions")
    if reason is not None:
        return reason
    *_, D, Dv = call.dims
    if Dv != D:
        return Reason.of("value head dim Dv={Dv} differs from D={D}; the flash kernels need "
                         "Dv == D", Dv=Dv, D=D)
    device = query.device.type
    if device == "cpu":
        if query.dtype not in _CPU_DTYPES:
            return f"dtype {query.dtype} is not supported on CPU (allowed: {_CPU_DTYPES})"
    elif device == "cuda":
        if query.dtype not in _CUDA_DTYPES:
            return f"dtype {query.dtype} is not supported on CUDA (allowed: {_CUDA_DTYPES})"
        if call.key_mask is not None:
            return "key_mask is not supported by the flash_regions backend on CUDA"
    else:
        return f"device {query.device} is not supported (allowed: cpu, cuda)"
    return None


def auto_reason(call: AttentionCall) -> Reason | str | None:
    """Why ``implementation=None`` does not pick the flash_regions backend: a hard limitation
    (:func:`unsupported_reason`) or, for short sequences, speed. None = flash_regions is picked."""
    reason = unsupported_reason(call)
    if reason is not None:
        return reason
    if call.query.device.type == "cuda":
        return ("the CUDA path of the flash_regions backend is only picked when asked for "
                "(implementation='flash_regions'); check it with python -m relpos.bench.cuda_check")
    crossover = crossover_keys(call)
    if call.key_len < crossover:
        return Reason.of("sequence length S={S} below the flash_regions crossover (S >= "
                         "{crossover} on CPU for this call); bucketed is faster",
                         S=call.key_len, crossover=crossover)
    return None
