"""The native kernels as the custom ops ``relpos::native_attention`` (padded batches) and
``relpos::native_attention_varlen`` (packed variable-length batches), with their autograd formulas.

Each op has a fake implementation (for ``torch.compile`` and ``torch.export``) and a backward
through the op ``<name>_backward``; both are checked with ``torch.library.opcheck``. The ops
read their inputs in any layout (the kernels make them contiguous once). Half precision
(``float16``, ``bfloat16``): both directions read query, key and value (the backward also
``grad_out`` and ``out``) in their own type, never as full-size float32 copies; the tables and
masks are passed as float32. bfloat16 runs the GEMMs on 16-bit operands with float32
accumulation where the CPU has fast ones (the kernels' own AMX tile GEMMs where they are built
for a CPU with AMX-BF16, VDPBF16PS on the same packed tiles where that beats the float32 FMA,
libtorch's brgemm where only oneDNN has the AMX tiles; P and dS rounded to bfloat16 for theirs,
as torch's flash kernel rounds them), else widens each tile to float32, as float16 always
does; the kernels choose at each call (their ``gemm_engines()`` says which), and
``RELPOS_NATIVE_BF16_GEMM`` switches (docs/numerics.md). Every sum and statistic is float32,
``dk`` and ``dv`` accumulate in float32 per head, every output is rounded once, and the tables'
gradients are summed in float32 and rounded to the tables' type.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim,
R = left + right + 1 table rows, Hr table heads (1 or H); varlen: N sequences, Tq and Tk the
queries and key rows of all of them, L_s and S_s those of sequence s (S_s the keys it uses).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relpos.ops._custom_op import (
    Gradients,
    define_op,
    empty_outputs,
    is_empty,
    register_attention_autograd,
)
from relpos.ops._numerics import accumulation_dtype
from relpos.ops.native.build import load

__all__ = [
    "check_queries_fit",
    "dropout_mask",
    "dropout_mask_varlen",
    "forward",
    "forward_varlen",
    "is_empty_varlen",
    "native_attention",
    "native_attention_varlen",
    "varlen_queries_fit",
]


def _kernels():
    module = load()
    if module is None:
        raise RuntimeError("the native kernels are not available (see relpos.ops.native.build)")
    return module


def _kernel_options(
    *, left: int, right: int, is_causal: bool, scale: float, query_start: int, dropout_p: float
) -> object:
    """The op's keyword options as the kernels' one ``AttentionOptions`` struct."""
    return _kernels().AttentionOptions(
        left=left, right=right, is_causal=is_causal, scale=scale, query_start=query_start,
        dropout_p=dropout_p,
    )


def _wide(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _inputs(query: Tensor, *others: Tensor) -> tuple[Tensor, ...]:
    """query, key and value (and the backward's grad_out and out) as the kernels read them:
    float32 and float64 as given, 16-bit types as given too (the kernels compute in float32
    from them), one dtype for all."""
    dtype = query.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        dtype = accumulation_dtype(dtype)
    return (query.to(dtype), *(t.to(dtype) for t in others))


def _expanded(mask: Tensor | None, query: Tensor, key: Tensor) -> Tensor | None:
    """A mask broadcastable to ``(B, H, L, S)`` as a ``(B, H, L, S)`` view (stride 0 where it
    broadcasts; the kernels read it in place)."""
    if mask is None:
        return None
    B, H, L, _ = query.shape
    return mask.expand(B, H, L, key.shape[2])


def _fake(query: Tensor, key: Tensor, value: Tensor, *_inputs: object, **_options: object) -> tuple[
    Tensor, Tensor
]:
    B, H, L, _ = query.shape
    Dv = value.shape[-1]
    return query.new_empty(B, H, L, Dv), query.new_empty(
        B, H, L, dtype=accumulation_dtype(query.dtype))


def forward(
    query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_bias: Tensor | None, attn_bias: Tensor | None,
    seed: Tensor | None, *, left: int, right: int, is_causal: bool, scale: float,
    query_start: int, dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """The forward of :func:`native_attention`, without the custom op's dispatch (what
    inference calls directly: no autograd, no tracing)."""
    if is_empty(query, key):
        return empty_outputs(_fake(query, key, value))
    acc = accumulation_dtype(query.dtype)
    q, k, v = _inputs(query, key, value)
    rk, rv, kb, mb = (_wide(t, acc) for t in (rel_keys, rel_values, key_bias, attn_bias))
    out, lse = _kernels().forward(
        q, k, v, rk, rv, kb, _expanded(mb, query, key), seed,
        _kernel_options(left=left, right=right, is_causal=is_causal, scale=scale,
                        query_start=query_start, dropout_p=dropout_p),
    )
    return out.to(query.dtype), lse


@define_op("relpos::native_attention")
def native_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    key_bias: Tensor | None,
    attn_bias: Tensor | None,
    seed: Tensor | None,
    *,
    left: int,
    right: int,
    is_causal: bool,
    scale: float,
    query_start: int,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """Returns ``out (B, H, L, Dv)`` and the logsumexp ``(B, H, L)`` (``+inf`` for rows that
    see no key; kept for the backward).

    ``key_bias`` is ``(B, S)``, added to every query's score of key ``j`` (``-inf`` hides the
    key); ``attn_bias`` a float mask broadcastable to ``(B, H, L, S)``, added to the scores
    (``-inf`` hides the pair); ``seed`` is two int64 (the dropout stream), or None without
    dropout.
    """
    return forward(
        query, key, value, rel_keys, rel_values, key_bias, attn_bias, seed, left=left,
        right=right, is_causal=is_causal, scale=scale, query_start=query_start,
        dropout_p=dropout_p,
    )


native_attention.register_fake(_fake)


def _backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, key_bias: Tensor | None, attn_bias: Tensor | None,
    seed: Tensor | None, out: Tensor, lse: Tensor, *, left: int, right: int, is_causal: bool,
    scale: float, query_start: int, dropout_p: float,
) -> Gradients:
    """What ``relpos::native_attention_backward`` computes for a non-empty call.
    Deterministic: the table gradients are reduced in a fixed order."""
    acc = accumulation_dtype(query.dtype)
    q, k, v, go, o = _inputs(query, key, value, grad_out, out)
    rk, rv, kb, mb = (_wide(t, acc) for t in (rel_keys, rel_values, key_bias, attn_bias))
    dq, dk, dv, drk, drv = _kernels().backward(
        go, q, k, v, rk, rv, kb, _expanded(mb, query, key), seed, o, lse,
        _kernel_options(left=left, right=right, is_causal=is_causal, scale=scale,
                        query_start=query_start, dropout_p=dropout_p),
    )
    dtype = query.dtype
    return (
        dq.to(dtype), dk.to(dtype), dv.to(dtype),
        None if rel_keys is None else drk.to(rel_keys.dtype),
        None if rel_values is None else drv.to(rel_values.dtype),
    )


native_attention_backward = register_attention_autograd(
    "relpos::native_attention", _backward, saved_outputs=("out", "lse")
)


def dropout_mask(seed: Tensor, shape: tuple[int, int, int, int], dropout_p: float) -> Tensor:
    """The keep mask ``(B, H, L, S)`` (True = kept) that the native kernels apply for the
    dropout stream ``seed`` (two int64) at probability ``dropout_p``: the attention output is
    ``(P * mask / (1 - dropout_p)) @ (V + aV)``. Lets a test apply the very same mask to the
    reference."""
    B, H, L, S = shape
    return _kernels().dropout_mask(seed, B, H, L, S, float(dropout_p))


# ------------------------------------------------------------------------------------------
# Packed variable-length batches


def is_empty_varlen(query: Tensor, key: Tensor) -> bool:
    """Whether a varlen call has no (query, key) pair: ``Tq == 0``, ``Tk == 0`` or ``H == 0``."""
    Tq, H, _ = query.shape
    return Tq == 0 or key.shape[0] == 0 or H == 0


def _fake_varlen(query: Tensor, key: Tensor, value: Tensor, *_inputs: object,
                 **_options: object) -> tuple[Tensor, Tensor]:
    Tq, H, _ = query.shape
    return query.new_empty(Tq, H, value.shape[-1]), query.new_empty(
        H, Tq, dtype=accumulation_dtype(query.dtype))


def forward_varlen(
    query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    seqused_k: Tensor | None, seed: Tensor | None, *, left: int, right: int, is_causal: bool,
    scale: float, dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """The forward of :func:`native_attention_varlen`, without the custom op's dispatch (what
    inference calls directly: no autograd, no tracing)."""
    if is_empty_varlen(query, key):
        return empty_outputs(_fake_varlen(query, key, value))
    acc = accumulation_dtype(query.dtype)
    q, k, v = _inputs(query, key, value)
    rk, rv = (_wide(t, acc) for t in (rel_keys, rel_values))
    out, lse = _kernels().forward_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, rk, rv, seed,
        _kernel_options(left=left, right=right, is_causal=is_causal, scale=scale, query_start=0,
                        dropout_p=dropout_p),
    )
    return out.to(query.dtype), lse


def check_queries_fit(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_k: Tensor | None
                      ) -> None:
    """Raise ValueError unless every sequence has at most as many queries as keys it uses
    (``L_s <= S_s``), what :func:`relpos.relative_attention_varlen` needs with tables or
    ``is_causal`` (the op itself also serves ``L_s > S_s``, at positions before 0). A
    different number of sequences is left to the kernels' check, which names it."""
    lengths_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    lengths_k = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    if lengths_q.shape != lengths_k.shape:
        return
    over = (lengths_q > lengths_k).nonzero()
    if over.numel():
        s = int(over[0, 0])
        keys = (f"uses {int(lengths_k[s])} keys (seqused_k)" if seqused_k is not None
                else f"{int(lengths_k[s])} keys")
        raise ValueError(
            f"sequence {s} has {int(lengths_q[s])} queries but {keys}: relative positions "
            f"align the queries to the end of their keys and need L <= S in every sequence")


@define_op("relpos::varlen_queries_fit")
def varlen_queries_fit(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_k: Tensor | None
                       ) -> Tensor:
    """A copy of ``cu_seqlens_q``, once :func:`check_queries_fit` has passed. Under
    ``torch.compile`` the public function's validation cannot read the lengths; this op reads
    them when the compiled graph runs, and the packed op is given the copy it returns, so the
    check runs first and is never left out of the graph."""
    check_queries_fit(cu_seqlens_q, cu_seqlens_k, seqused_k)
    return cu_seqlens_q.clone()


varlen_queries_fit.register_fake(lambda cu_seqlens_q, *_: torch.empty_like(cu_seqlens_q))


@define_op("relpos::native_attention_varlen")
def native_attention_varlen(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    rel_keys: Tensor | None,
    rel_values: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    seqused_k: Tensor | None,
    seed: Tensor | None,
    *,
    left: int,
    right: int,
    is_causal: bool,
    scale: float,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """Attention over a packed batch of N sequences, laid out as flash-attention's
    ``flash_attn_varlen_func``. Returns ``out (Tq, H, Dv)`` in the query's dtype and the
    logsumexp ``(H, Tq)`` in the accumulation dtype (float32 for half inputs; ``+inf`` for rows
    that see no key; kept for the backward).

    ``query (Tq, H, D)``, ``key (Tk, H, D)``, ``value (Tk, H, Dv)`` in any strides;
    ``cu_seqlens_q`` and ``cu_seqlens_k`` are ``(N + 1,)`` int64 CPU tensors from 0,
    non-decreasing, ending at ``Tq`` and ``Tk``: sequence ``s`` holds the query rows
    ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` (``L_s``) and the key rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]`` (``S_s``); either may be empty. ``seqused_k``
    (flash-attention's; a KV cache with spare capacity), an ``(N,)`` int64 CPU tensor or None:
    sequence ``s`` uses only the first ``S_s = seqused_k[s]`` rows of its key region
    (``0 <= seqused_k[s] <= cu_seqlens_k[s + 1] - cu_seqlens_k[s]``); the rest is never read
    and gets a zero gradient. Each sequence is attended on its own, bottom-right aligned (its
    query ``i`` at position ``S_s - L_s + i``), as ``relpos::native_attention`` attends one
    batch row with ``query_start = S_s - L_s``; tables are ``(Hr, R, D)`` and ``(Hr, R, Dv)``;
    ``seed`` is two int64 (the dropout stream, :func:`dropout_mask_varlen` gives its keep
    masks), or None without dropout.
    """
    return forward_varlen(
        query, key, value, rel_keys, rel_values, cu_seqlens_q, cu_seqlens_k, seqused_k, seed,
        left=left, right=right, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
    )


native_attention_varlen.register_fake(_fake_varlen)


def _backward_varlen(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, rel_keys: Tensor | None,
    rel_values: Tensor | None, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    seqused_k: Tensor | None, seed: Tensor | None, out: Tensor, lse: Tensor, *, left: int,
    right: int, is_causal: bool, scale: float, dropout_p: float,
) -> Gradients:
    """What ``relpos::native_attention_varlen_backward`` computes for a non-empty call: the
    gradients shaped like the inputs (``dk``, ``dv`` zero in the key rows past ``seqused_k``).
    Deterministic: the table gradients are reduced in a fixed order."""
    acc = accumulation_dtype(query.dtype)
    q, k, v, go, o = _inputs(query, key, value, grad_out, out)
    rk, rv = (_wide(t, acc) for t in (rel_keys, rel_values))
    dq, dk, dv, drk, drv = _kernels().backward_varlen(
        go, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, rk, rv, seed, o, lse,
        _kernel_options(left=left, right=right, is_causal=is_causal, scale=scale, query_start=0,
                        dropout_p=dropout_p),
    )
    dtype = query.dtype
    return (
        dq.to(dtype), dk.to(dtype), dv.to(dtype),
        None if rel_keys is None else drk.to(rel_keys.dtype),
        None if rel_values is None else drv.to(rel_values.dtype),
    )


native_attention_varlen_backward = register_attention_autograd(
    "relpos::native_attention_varlen", _backward_varlen, saved_outputs=("out", "lse"),
    empty=is_empty_varlen,
)


def dropout_mask_varlen(seed: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        num_heads: int, dropout_p: float,
                        seqused_k: Tensor | None = None) -> list[Tensor]:
    """The keep masks (True = kept) that :func:`native_attention_varlen` applies for the
    dropout stream ``seed`` (two int64) at probability ``dropout_p``: one ``(H, L_s, S_s)`` per
    sequence (``S_s = seqused_k[s]`` when ``seqused_k`` is given), so that sequence ``s``'s
    output is ``(P_s * mask_s / (1 - dropout_p)) @ (V_s + aV)``. Query ``i`` of sequence
    ``s``, head ``h``, draws the padded kernels' row ``h * Tq + cu_seqlens_q[s] + i`` (as query
    ``cu_seqlens_q[s] + i`` of head ``h`` of one padded batch row of ``Tq`` queries), key ``j``
    its index within the sequence."""
    return list(_kernels().dropout_mask_varlen(seed, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                               num_heads, float(dropout_p)))
