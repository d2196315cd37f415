"""The Triton kernels: flash attention with Toeplitz buckets (docs/design.md §6).

One program handles one (batch·head, query block) in the forward and in the ``dq`` pass, one
(batch·head, key block) in the ``dk, dv`` pass. With ``VARLEN`` (a packed batch, laid out
``(H, T, X)``) the same kernels take program 0's index from a table of ``(sequence, block)``
entries (:func:`_varlen_program`): each program its sequence's query and key rows, lengths and
``query_start = S_s - L_s``, nothing across sequences. Every tile ``(query block I, key block J)``:

    s_ij = scale * q_i . k_j + QA[i, r_ij]        QA = scale * q @ aK^T   (B, H, L, R)
    r_ij = clamp(j - p_i + left, 0, R - 1)       p_i = query_start + i

Tiles beyond the band read only the first or last column of ``QA`` (held per row); inside
the band the interior columns are gathered (predicated loads: far tiles issue none). The
value term is carried by per-row bucket masses: the two edge buckets (every far key) are
accumulated like the softmax denominator; an interior bucket ``0 < r < R - 1`` holds exactly
one key (``j = p_i + r - left``), so its score is stored once into the ``(L, R)`` buffer and
turned into a probability after the last tile, and ``out += Pb @ aV`` closes the row.

The backward recomputes ``p_ij = exp(s_ij - lse_i)``, ``dp_ij = dO_i . v_j + dOA[i, r_ij]``
(``dOA = dO @ aV^T``) and ``ds_ij = p_ij (dp_ij - delta_i)``; the ``dq`` pass also writes the
bucket sums ``dSb`` of ``ds`` (edges accumulated, interior stored), from which the caller gets
``dq += scale dSb @ aK``, ``daK = scale dSb^T @ q`` and ``daV = Pb^T @ dO`` as GEMMs: every sum
in a fixed order, no atomics.

Float32 inputs multiply in IEEE float32 (``input_precision="ieee"``, never TF32), so the
interpreter's numbers are the GPU's; half-precision inputs multiply in their dtype with float32
accumulation; float64 (interpreter only) stays float64 throughout.

Shape legend: B batch, H heads, L queries, S keys, D head dim, Dv value head dim, R table rows.
All tensors are contiguous; ``BLOCK_D`` / ``BLOCK_DV`` are the head dims rounded up to a power
of two (at least 16, what ``tl.dot`` takes), the rest masked.
"""
# mypy: ignore-errors
# (Triton's language is typed by its own compiler, not by mypy.)

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, ACC: tl.constexpr, BF16_EMULATED: tl.constexpr):
    """``a @ b`` accumulated in ``ACC``. With ``BF16_EMULATED`` (bfloat16 under the interpreter,
    whose ``tl.dot`` reads bfloat16 storage as integers) the product runs in float32: the same
    numbers, as a product of two bfloat16 values is exact in float32."""
    if BF16_EMULATED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee", out_dtype=ACC)


@triton.jit
def _narrow(x, dtype: tl.constexpr, BF16_EMULATED: tl.constexpr):
    """``x`` (accumulation dtype) in ``dtype``, rounded to nearest even as on the GPU. With
    ``BF16_EMULATED`` the rounding is done on the bits first: the interpreter's own cast to
    bfloat16 truncates."""
    if BF16_EMULATED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _bucket_gather(table_ptr, offs_m, idx, first, last, R, row_ok):
    """``table[i, idx_ij]`` for a (BLOCK_M, BLOCK_N) tile of bucket indices: the edge columns
    from the per-row values ``first`` / ``last``, the interior ones gathered."""
    interior = (idx > 0) & (idx < R - 1) & row_ok[:, None]
    inner = tl.load(table_ptr + offs_m[:, None] * R + idx, mask=interior, other=0.0)
    return tl.where(idx == 0, first[:, None], tl.where(idx == R - 1, last[:, None], inner))


@triton.jit
def _edge_columns(ptr, offs_m, row_ok, R, HAS: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """The first and last columns of a per-row ``(L, R)`` table (``QA``, ``dOA``) for the rows
    ``offs_m``, as ``_bucket_gather`` takes them; zeros without the table."""
    first = tl.zeros([BLOCK_M], dtype=ACC)
    last = tl.zeros([BLOCK_M], dtype=ACC)
    if HAS:
        first = tl.load(ptr + offs_m * R, mask=row_ok, other=0.0)
        last = tl.load(ptr + offs_m * R + R - 1, mask=row_ok, other=0.0)
    return first, last


@triton.jit
def _query_rows(Q, DO, Lse, Delta, q_rows, offs_m, row_ok, offs_d, d_ok, offs_dv, dv_ok, L,
                D: tl.constexpr, Dv: tl.constexpr):
    """What the backward reads of one query block: ``q (BLOCK_M, BLOCK_D)``,
    ``dO (BLOCK_M, BLOCK_DV)``, ``lse`` (+inf past the last row) and ``delta``."""
    q = tl.load(Q + q_rows * D + offs_m[:, None] * D + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + q_rows * Dv + offs_m[:, None] * Dv + offs_dv[None, :],
                 mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    lse = tl.load(Lse + q_rows + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + q_rows + offs_m, mask=row_ok, other=0.0)
    return q, do, lse, delta


@triton.jit
def _key_block(K, V, k_rows, offs_n, col_ok, offs_d, d_ok, offs_dv, dv_ok, S, D: tl.constexpr,
               Dv: tl.constexpr):
    """``k (BLOCK_D, BLOCK_N)`` (transposed, as ``tl.dot(q, k)`` takes it) and
    ``v (BLOCK_N, BLOCK_DV)`` of one key block."""
    k = tl.load(K + k_rows * D + offs_n[None, :] * D + offs_d[:, None],
                mask=col_ok[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(V + k_rows * Dv + offs_n[:, None] * Dv + offs_dv[None, :],
                mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
    return k, v


@triton.jit
def _varlen_program(Tab, pid, q_rows, k_rows):
    """Where program ``pid`` of a packed batch works: ``Tab`` holds five int32 per program,
    ``(q0, L_s, k0, S_s, start)``: its sequence's first query row and query count, first key
    row and the keys it uses, and the first row (query or key) of its block. Returns
    ``(q_rows, k_rows, L, S, query_start, start)`` with the sequence's rows added to the head's
    ``q_rows``, ``k_rows``; its queries align to the end of its keys
    (``query_start = S_s - L_s``)."""
    entry = Tab + pid * 5
    n_q = tl.load(entry + 1)
    n_k = tl.load(entry + 3)
    q_rows += tl.load(entry)
    k_rows += tl.load(entry + 2)
    return q_rows, k_rows, n_q, n_k, n_k - n_q, tl.load(entry + 4)


@triton.jit
def _tile_scores(
    q, k, offs_m, offs_n, pos, row_ok, col_ok, qa_ptr, qa_first, qa_last, km_ptr,
    R, left, scale,
    HAS_QA: tl.constexpr, HAS_KM: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr,
    BF16_EMULATED: tl.constexpr,
):
    """Scores of one tile (BLOCK_M, BLOCK_N) from ``q (BLOCK_M, BLOCK_D)`` and
    ``k (BLOCK_D, BLOCK_N)``, ``-inf`` where key j is hidden from query i; also the bucket
    index of every entry and the visibility mask."""
    s = _dot(q, k, ACC, BF16_EMULATED) * scale
    idx = tl.minimum(tl.maximum(offs_n[None, :] - pos[:, None] + left, 0), R - 1)
    if HAS_QA:
        s += _bucket_gather(qa_ptr, offs_m, idx, qa_first, qa_last, R, row_ok)
    visible = col_ok[None, :] & row_ok[:, None]
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= pos[:, None])
    if HAS_KM:
        real = tl.load(km_ptr + offs_n, mask=col_ok, other=0)
        visible = visible & (real != 0)[None, :]
    s = tl.where(visible, s, float("-inf"))
    return s, idx, visible


@triton.jit
def forward_kernel(
    Q, K, V, QA, AV, KM, Out, Lse, Pb, Tab,
    H, L, S, D: tl.constexpr, Dv: tl.constexpr, R, left, query_start, scale, av_head_stride,
    HAS_QA: tl.constexpr, HAS_AV: tl.constexpr, HAS_KM: tl.constexpr, CAUSAL: tl.constexpr,
    ACC: tl.constexpr, BF16_EMULATED: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Grid ``(cdiv(L, BLOCK_M), B * H)`` (``VARLEN``: ``(programs, H)``). Writes
    ``Out (B, H, L, Dv)``, ``Lse (B, H, L)`` (+inf
    for a row that sees no key) and, with a values table, the bucket masses ``Pb (B, H, L, R)``
    (which must arrive filled with ``-inf``)."""
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    m0 = tl.program_id(0) * BLOCK_M
    q_rows, k_rows = bh * L, bh * S  # the first query and key rows in (rows, X) views
    if VARLEN:  # (H, Tq, X) and (H, Tk, X) views: L = Tq, S = Tk, then this program's own
        q_rows, k_rows, L, S, query_start, m0 = _varlen_program(Tab, tl.program_id(0), q_rows,
                                                                k_rows)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok, d_ok, dv_ok = offs_m < L, offs_d < D, offs_dv < Dv
    pos = query_start + offs_m

    q = tl.load(Q + q_rows * D + offs_m[:, None] * D + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    qa_ptr = QA + q_rows * R
    qa_first, qa_last = _edge_columns(qa_ptr, offs_m, row_ok, R, HAS_QA, ACC, BLOCK_M)
    pb_ptr = Pb + q_rows * R
    km_ptr = KM + b * S

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    l_i = tl.zeros([BLOCK_M], dtype=ACC)
    edge_left = tl.zeros([BLOCK_M], dtype=ACC)
    edge_right = tl.zeros([BLOCK_M], dtype=ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=ACC)

    hi = S
    if CAUSAL:
        hi = tl.minimum(S, query_start + tl.minimum(L, m0 + BLOCK_M))
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S
        k = tl.load(K + k_rows * D + offs_n[None, :] * D + offs_d[:, None],
                    mask=col_ok[None, :] & d_ok[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        s, idx, visible = _tile_scores(
            q, k, offs_m, offs_n, pos, row_ok, col_ok, qa_ptr, qa_first, qa_last, km_ptr,
            R, left, scale, HAS_QA, HAS_KM, CAUSAL, ACC, BF16_EMULATED,
        )
        # online softmax; a row with no visible key so far keeps m = -inf, l = 0
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + k_rows * Dv + offs_n[:, None] * Dv + offs_dv[None, :],
                    mask=col_ok[:, None] & dv_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_DV)
        acc = acc * alpha[:, None] + _dot(_narrow(p, v.dtype, BF16_EMULATED), v, ACC, BF16_EMULATED)
        if HAS_AV:
            at_left = idx == 0
            at_right = (idx == R - 1) & (idx != 0)
            edge_left = edge_left * alpha + tl.sum(tl.where(at_left, p, 0.0), 1)
            edge_right = edge_right * alpha + tl.sum(tl.where(at_right, p, 0.0), 1)
            interior = (idx > 0) & (idx < R - 1) & visible
            tl.store(pb_ptr + offs_m[:, None] * R + idx, s, mask=interior)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("inf"), m_i + tl.log(l_safe))
    out = acc / l_safe[:, None]
    if HAS_AV:
        tl.debug_barrier()  # the interior scores stored above, by other threads of this program
        edge_left = edge_left / l_safe
        edge_right = edge_right / l_safe
        av_ptr = AV + h * av_head_stride
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < R
            cell = row_ok[:, None] & r_ok[None, :]
            scores = tl.load(pb_ptr + offs_m[:, None] * R + offs_r[None, :], mask=cell,
                             other=float("-inf"))
            mass = tl.exp(scores - lse[:, None])
            mass = tl.where((offs_r == R - 1)[None, :], edge_right[:, None], mass)
            mass = tl.where((offs_r == 0)[None, :], edge_left[:, None], mass)
            mass = tl.where(cell, mass, 0.0)
            tl.store(pb_ptr + offs_m[:, None] * R + offs_r[None, :], mass, mask=cell)
            av = tl.load(av_ptr + offs_r[:, None] * Dv + offs_dv[None, :],
                         mask=r_ok[:, None] & dv_ok[None, :], other=0.0)
            # in the input dtype, as p @ v above (masses in [0, 1], rounded like p)
            out += _dot(_narrow(mass, av.dtype, BF16_EMULATED), av, ACC, BF16_EMULATED)
    tl.store(Out + q_rows * Dv + offs_m[:, None] * Dv + offs_dv[None, :],
             _narrow(out, Out.dtype.element_ty, BF16_EMULATED),
             mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(Lse + q_rows + offs_m, lse, mask=row_ok)


@triton.jit
def _tile_grads(
    q, k, v, do, offs_m, offs_n, pos, row_ok, col_ok, lse, delta,
    qa_ptr, qa_first, qa_last, doa_ptr, doa_first, doa_last, km_ptr, R, left, scale,
    HAS_QA: tl.constexpr, HAS_AV: tl.constexpr, HAS_KM: tl.constexpr, CAUSAL: tl.constexpr,
    ACC: tl.constexpr, BF16_EMULATED: tl.constexpr,
):
    """``p``, ``ds`` and the bucket indices of one tile (BLOCK_M, BLOCK_N), from ``q``, ``dO``
    (query rows), ``k (BLOCK_D, BLOCK_N)`` and ``v (BLOCK_N, BLOCK_DV)``."""
    s, idx, visible = _tile_scores(
        q, k, offs_m, offs_n, pos, row_ok, col_ok, qa_ptr, qa_first, qa_last, km_ptr,
        R, left, scale, HAS_QA, HAS_KM, CAUSAL, ACC, BF16_EMULATED,
    )
    p = tl.exp(s - lse[:, None])  # lse = +inf for a row that sees no key: p = 0
    dp = _dot(do, tl.trans(v), ACC, BF16_EMULATED)
    if HAS_AV:
        dp += _bucket_gather(doa_ptr, offs_m, idx, doa_first, doa_last, R, row_ok)
    ds = tl.where(visible, p * (dp - delta[:, None]), 0.0)
    return p, ds, idx, visible


@triton.jit
def backward_dkdv_kernel(
    Q, K, V, QA, DOA, KM, DO, Lse, Delta, DK, DV, Tab,
    H, L, S, D: tl.constexpr, Dv: tl.constexpr, R, left, query_start, scale,
    HAS_QA: tl.constexpr, HAS_AV: tl.constexpr, HAS_KM: tl.constexpr, CAUSAL: tl.constexpr,
    ACC: tl.constexpr, BF16_EMULATED: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Grid ``(cdiv(S, BLOCK_N), B * H)`` (``VARLEN``: ``(programs, H)``):
    ``dk = scale dS^T @ q``, ``dv = P^T @ dO`` for one key
    block, over every query block that can see it."""
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    n0 = tl.program_id(0) * BLOCK_N
    q_rows, k_rows = bh * L, bh * S  # the first query and key rows in (rows, X) views
    if VARLEN:  # (H, Tq, X) and (H, Tk, X) views: L = Tq, S = Tk, then this program's own
        q_rows, k_rows, L, S, query_start, n0 = _varlen_program(Tab, tl.program_id(0), q_rows,
                                                                k_rows)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok, d_ok, dv_ok = offs_n < S, offs_d < D, offs_dv < Dv
    k, v = _key_block(K, V, k_rows, offs_n, col_ok, offs_d, d_ok, offs_dv, dv_ok, S, D, Dv)
    km_ptr = KM + b * S
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=ACC)

    lo = 0
    if CAUSAL:  # query i sees key j only if j <= query_start + i
        lo = (tl.maximum(n0 - query_start, 0) // BLOCK_M) * BLOCK_M
    for m0 in range(lo, L, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < L
        pos = query_start + offs_m
        q, do, lse, delta = _query_rows(Q, DO, Lse, Delta, q_rows, offs_m, row_ok, offs_d, d_ok,
                                        offs_dv, dv_ok, L, D, Dv)
        qa_ptr = QA + q_rows * R
        doa_ptr = DOA + q_rows * R
        qa_first, qa_last = _edge_columns(qa_ptr, offs_m, row_ok, R, HAS_QA, ACC, BLOCK_M)
        doa_first, doa_last = _edge_columns(doa_ptr, offs_m, row_ok, R, HAS_AV, ACC, BLOCK_M)
        p, ds, _idx, _visible = _tile_grads(
            q, k, v, do, offs_m, offs_n, pos, row_ok, col_ok, lse, delta,
            qa_ptr, qa_first, qa_last, doa_ptr, doa_first, doa_last, km_ptr, R, left, scale,
            HAS_QA, HAS_AV, HAS_KM, CAUSAL, ACC, BF16_EMULATED,
        )
        dv += _dot(tl.trans(_narrow(p, do.dtype, BF16_EMULATED)), do, ACC, BF16_EMULATED)
        dk += _dot(tl.trans(_narrow(ds, q.dtype, BF16_EMULATED)), q, ACC, BF16_EMULATED)
    tl.store(DK + k_rows * D + offs_n[:, None] * D + offs_d[None, :],
             _narrow(dk * scale, DK.dtype.element_ty, BF16_EMULATED),
             mask=col_ok[:, None] & d_ok[None, :])
    tl.store(DV + k_rows * Dv + offs_n[:, None] * Dv + offs_dv[None, :],
             _narrow(dv, DV.dtype.element_ty, BF16_EMULATED),
             mask=col_ok[:, None] & dv_ok[None, :])


@triton.jit
def backward_dq_kernel(
    Q, K, V, QA, DOA, KM, DO, Lse, Delta, DQ, DSb, Tab,
    H, L, S, D: tl.constexpr, Dv: tl.constexpr, R, left, query_start, scale,
    HAS_QA: tl.constexpr, HAS_AV: tl.constexpr, HAS_KM: tl.constexpr, CAUSAL: tl.constexpr,
    ACC: tl.constexpr, BF16_EMULATED: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Grid ``(cdiv(L, BLOCK_M), B * H)`` (``VARLEN``: ``(programs, H)``):
    ``DQ = dS @ k`` (unscaled, in the accumulation dtype)
    and, with a keys table, the bucket sums ``DSb (B, H, L, R)`` of ``dS`` (which must arrive
    filled with zeros)."""
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    m0 = tl.program_id(0) * BLOCK_M
    q_rows, k_rows = bh * L, bh * S  # the first query and key rows in (rows, X) views
    if VARLEN:  # (H, Tq, X) and (H, Tk, X) views: L = Tq, S = Tk, then this program's own
        q_rows, k_rows, L, S, query_start, m0 = _varlen_program(Tab, tl.program_id(0), q_rows,
                                                                k_rows)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok, d_ok, dv_ok = offs_m < L, offs_d < D, offs_dv < Dv
    pos = query_start + offs_m
    q, do, lse, delta = _query_rows(Q, DO, Lse, Delta, q_rows, offs_m, row_ok, offs_d, d_ok,
                                    offs_dv, dv_ok, L, D, Dv)
    qa_ptr = QA + q_rows * R
    doa_ptr = DOA + q_rows * R
    dsb_ptr = DSb + q_rows * R
    km_ptr = KM + b * S
    qa_first, qa_last = _edge_columns(qa_ptr, offs_m, row_ok, R, HAS_QA, ACC, BLOCK_M)
    doa_first, doa_last = _edge_columns(doa_ptr, offs_m, row_ok, R, HAS_AV, ACC, BLOCK_M)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    ds_left = tl.zeros([BLOCK_M], dtype=ACC)
    ds_right = tl.zeros([BLOCK_M], dtype=ACC)

    hi = S
    if CAUSAL:
        hi = tl.minimum(S, query_start + tl.minimum(L, m0 + BLOCK_M))
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S
        k, v = _key_block(K, V, k_rows, offs_n, col_ok, offs_d, d_ok, offs_dv, dv_ok, S, D, Dv)
        _p, ds, idx, visible = _tile_grads(
            q, k, v, do, offs_m, offs_n, pos, row_ok, col_ok, lse, delta,
            qa_ptr, qa_first, qa_last, doa_ptr, doa_first, doa_last, km_ptr, R, left, scale,
            HAS_QA, HAS_AV, HAS_KM, CAUSAL, ACC, BF16_EMULATED,
        )
        dq += _dot(_narrow(ds, k.dtype, BF16_EMULATED), tl.trans(k), ACC, BF16_EMULATED)
        if HAS_QA:
            ds_left += tl.sum(tl.where(idx == 0, ds, 0.0), 1)
            ds_right += tl.sum(tl.where((idx == R - 1) & (idx != 0), ds, 0.0), 1)
            interior = (idx > 0) & (idx < R - 1) & visible
            tl.store(dsb_ptr + offs_m[:, None] * R + idx, ds, mask=interior)
    tl.store(DQ + q_rows * D + offs_m[:, None] * D + offs_d[None, :], dq,
             mask=row_ok[:, None] & d_ok[None, :])
    if HAS_QA:
        several = tl.zeros([BLOCK_M], dtype=tl.int32) + R > 1  # R = 1: one bucket, column 0
        tl.store(dsb_ptr + offs_m * R + R - 1, ds_right, mask=row_ok & several)
        tl.store(dsb_ptr + offs_m * R, ds_left, mask=row_ok)
