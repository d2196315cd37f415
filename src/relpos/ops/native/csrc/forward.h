// The forward: one thread's state (ForwardBlock); the phases of a query block (prologue: QA;
// per row of a tile: band key term, masks, the online-softmax step with its rescale, dropout and
// the bucket update; epilogue: the table term, out and lse); the 16-bit GEMMs of a call with
// 16-bit inputs (packed tiles or brgemm); the task (one query block of one head, streamed
// through its key blocks); and its loops: forward_impl (padded: (batch, head, query block)) and
// forward_varlen_impl (varlen: (sequence, head, query block)).

#pragma once

#include "blocks.h"
#include "config.h"
#include "convert.h"
#include "dropout.h"
#include "forward_gemms.h"
#include "gemm.h"
#include "geometry.h"
#include "row_phases.h"

#include <ATen/Parallel.h>

namespace relpos_native {

// One thread's state for the query block it works on: blocks of at most BQ rows, tiles of at
// most `tile` scores (BQ · BK for one block size; the largest of a varlen call's sequences), and
// its GEMM operands (forward_gemms.h).
template <typename accum_t, typename scalar_t = accum_t>
struct ForwardBlock {
  std::vector<accum_t> scores;  // (tile): S of the current tile (nq, nk), then P (row stride nk)
  std::vector<accum_t> qa;      // (BQ, R): QA = scale · Q_I @ aK^T
  std::vector<accum_t> pb;      // (BQ, R): Pb, each row's probability mass per table row
  std::vector<accum_t> acc;     // (BQ, Dv): sum_j p_ij v_j
  std::vector<accum_t> m, l;    // (BQ): the online softmax's running max and sum
  ForwardGemms<accum_t, scalar_t> gemm;

  ForwardBlock(const ForwardShape& sh, HalfGemms gemms = {}, TileGemm tile_gemms = kNoTiles)
      : scores(sh.tile), qa(sh.keys ? sh.BQ * sh.R : 0), pb(sh.values ? sh.BQ * sh.R : 0),
        acc(sh.BQ * sh.Dv), m(sh.BQ), l(sh.BQ), gemm(sh, gemms, tile_gemms) {}
};

// The max of a far segment's scores plus its constant; -inf where the segment has no visible
// score (hidden keys are -inf), whatever the constant (-inf + NaN would make the row NaN).
template <typename accum_t>
static inline accum_t far_segment_max(const accum_t* s, int64_t n, accum_t far) {
  const accum_t mx = row_max<accum_t>(s, n);
  return mx == -std::numeric_limits<accum_t>::infinity() ? mx : mx + far;
}

// The row's max over its visible scores, far constants included. row_max skips NaN; a row whose
// visible scores are all NaN must stay NaN, not look empty (other NaNs reach the row through
// exp and its sum).
template <typename accum_t>
static RELPOS_INLINE accum_t segments_max(const accum_t* s, const RowSegments& seg,
                                          FarConstants<accum_t> qa_far) {
  const accum_t ninf = -std::numeric_limits<accum_t>::infinity();
  const accum_t* band_scores = s + seg.n_left;
  accum_t mx = ninf;
  if (seg.n_left > 0)
    mx = nan_max<accum_t>(mx, far_segment_max<accum_t>(s, seg.n_left, qa_far.left));
  if (seg.n_band > 0) mx = nan_max<accum_t>(mx, row_max<accum_t>(band_scores, seg.n_band));
  if (seg.n_right > 0)
    mx = nan_max<accum_t>(
        mx, far_segment_max<accum_t>(band_scores + seg.n_band, seg.n_right, qa_far.right));
  if (mx == ninf) {
    for (int64_t j = 0; j < seg.n_visible; ++j)
      if (std::isnan(s[j])) mx = std::numeric_limits<accum_t>::quiet_NaN();
  }
  return mx;
}

// RESCALE: the row's running sum, output accumulator and bucket masses, all relative to the old
// max, times alpha = exp(m_old - m_new).
template <typename accum_t, typename scalar_t>
static RELPOS_INLINE void rescale_row(ForwardBlock<accum_t, scalar_t>& w, int64_t r, accum_t alpha,
                                      int64_t Dv, int64_t R, bool values) {
  w.l[r] *= alpha;
  accum_t* a = w.acc.data() + r * Dv;
  for (int64_t d = 0; d < Dv; ++d) a[d] *= alpha;
  if (values) {
    accum_t* pr = w.pb.data() + r * R;
    for (int64_t x = 0; x < R; ++x) pr[x] *= alpha;
  }
}

// exp_segments for a call on packed tiles without dropout: P rounded to bfloat16 into p_row
// (nk entries: zeros past the visible keys, up to p_ld), s left as it is; with pb_row (R
// entries) the row's bucket masses added in the same pass (add_to_buckets's).
template <typename accum_t>
static RELPOS_INLINE SegmentSums<accum_t> exp_segments_bf16(accum_t* s, const RowSegments& seg,
                                                            FarConstants<accum_t> qa_far,
                                                            accum_t offset, uint16_t* p_row,
                                                            int64_t p_ld, accum_t* pb_row,
                                                            int64_t R) {
  SegmentSums<accum_t> sum{};
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<accum_t, float>) {
    accum_t* band_scores = s + seg.n_left;
    accum_t* right_scores = band_scores + seg.n_band;
    const int64_t right0 = seg.n_left + seg.n_band;
    if (std::isfinite(qa_far.left)) {
      sum.left = exp_sum_to_bf16(s, seg.n_left, offset - qa_far.left, p_row);
    } else {
      sum.left = far_exp_sum<accum_t, true>(s, seg.n_left, offset, qa_far.left);
      round_to_bf16(s, seg.n_left, p_row);
    }
    if (pb_row != nullptr)
      sum.band = exp_sum_to_bf16<true>(band_scores, seg.n_band, offset, p_row + seg.n_left,
                                       pb_row + seg.band_row);
    else
      sum.band = exp_sum_to_bf16(band_scores, seg.n_band, offset, p_row + seg.n_left);
    if (std::isfinite(qa_far.right)) {
      sum.right = exp_sum_to_bf16(right_scores, seg.n_right, offset - qa_far.right, p_row + right0);
    } else {
      sum.right = far_exp_sum<accum_t, true>(right_scores, seg.n_right, offset, qa_far.right);
      round_to_bf16(right_scores, seg.n_right, p_row + right0);
    }
    std::fill(p_row + seg.n_visible, p_row + p_ld, uint16_t(0));
    if (pb_row != nullptr) {
      pb_row[0] += sum.left;
      pb_row[R - 1] += sum.right;
    }
  }
#endif
  return sum;
}

// Online-softmax step of row r over one tile: the new max, the rescale of the row's state, then
// s = exp(s - m_new) (far constants folded in; the hidden tail [n_visible, nk) set to 0) and
// l += its sum; with p_row (packed tiles, no dropout), P goes to p_row in bfloat16 instead, s
// left as it is (exp_segments_bf16). With buckets (no dropout), the row's bucket masses (R) are
// added in the same pass. Returns false, with the row's tile (or p_row) zeroed, while the row
// has seen no key.
template <typename accum_t, typename scalar_t>
static RELPOS_INLINE bool online_softmax_step(ForwardBlock<accum_t, scalar_t>& w, int64_t r,
                                              accum_t* s, int64_t nk, const RowSegments& seg,
                                              FarConstants<accum_t> qa_far, int64_t Dv, int64_t R,
                                              bool values, SegmentSums<accum_t>& p_sums,
                                              uint16_t* p_row, accum_t* buckets) {
  const accum_t ninf = -std::numeric_limits<accum_t>::infinity();
  const accum_t mx = segments_max<accum_t>(s, seg, qa_far);
  const accum_t m_old = w.m[r];
  const accum_t m_new = std::isnan(mx) ? mx : std::max(m_old, mx);
  if (m_new == ninf) {  // nothing visible yet in this row
    if (p_row != nullptr)
      std::fill(p_row, p_row + w.gemm.p_ld, uint16_t(0));
    else
      std::fill(s, s + nk, accum_t(0));
    return false;
  }
  // RESCALE to the new max; a row's first visible tile finds its state empty (0) and skips it
  if (m_old != ninf) {
    const accum_t alpha = exp_<accum_t>(m_old - m_new);
    if (alpha != accum_t(1)) rescale_row(w, r, alpha, Dv, R, values);
  }
  w.m[r] = m_new;
  if (p_row != nullptr) {
    // after the rescale above, so the row's masses are relative to m_new
    p_sums = exp_segments_bf16<accum_t>(s, seg, qa_far, m_new, p_row, w.gemm.p_ld, buckets, R);
  } else {
    p_sums = exp_segments<accum_t, !std::is_same_v<accum_t, scalar_t>>(s, seg, qa_far, m_new,
                                                                       buckets, R);
    for (int64_t j = seg.n_visible; j < nk; ++j) s[j] = accum_t(0);
  }
  w.l[r] += p_sums.left + p_sums.band + p_sums.right;
  return true;
}

// Dropout of one row of P (forward; `row` its dropout row): dropped entries 0, kept ones times
// 1 / (1 - p).
template <typename accum_t>
static RELPOS_INLINE void drop_row(accum_t* s, const RowSegments& seg, const Dropout& drop,
                                   int64_t row, accum_t inv_keep) {
  uint32_t k1, k2;
  drop.row_keys(row, k1, k2);
  const uint32_t th = drop.threshold;
  const int64_t j0 = seg.j0;
#pragma omp simd
  for (int64_t j = 0; j < seg.n_visible; ++j) {
    const bool kept = Dropout::keep(static_cast<uint32_t>(drop.key_offset + j0 + j), k1, k2, th);
    s[j] = kept ? s[j] * inv_keep : accum_t(0);
  }
}

// Prologue of a query block: QA of its rows; the online softmax's state emptied.
template <typename accum_t, typename scalar_t>
static RELPOS_INLINE void forward_prologue(const Geometry& g, const Head<accum_t, scalar_t>& hd,
                                           ForwardBlock<accum_t, scalar_t>& w, int64_t nq,
                                           accum_t scale, const accum_t* q_wide,
                                           const scalar_t* q_block) {
  const int64_t R = g.R;
  const accum_t ninf = -std::numeric_limits<accum_t>::infinity();
  // QA_I (nq, R) = scale · Q_I (nq, D) @ aK^T
  if (hd.ak) w.gemm.table_scores(hd, nq, R, g.D, scale, q_block, q_wide, w.qa.data());
  if (hd.av) std::fill(w.pb.begin(), w.pb.begin() + nq * R, accum_t(0));
  std::fill(w.acc.begin(), w.acc.begin() + nq * g.Dv, accum_t(0));
  std::fill(w.m.begin(), w.m.end(), ninf);
  std::fill(w.l.begin(), w.l.end(), accum_t(0));
}

// Row r of one tile: band key term, masks, online-softmax step, then dropout and the bucket
// update Pb[i, r_ij] += p_ij. Leaves P (0 where hidden) for the P @ V GEMM in the row's tile
// or, on packed tiles, in bfloat16 in row r of w.p_rows (row stride w.p_ld).
template <typename accum_t, typename scalar_t>
static RELPOS_INLINE void forward_row(const Geometry& g, const Head<accum_t, scalar_t>& hd,
                                      const accum_t* attn_bias, const Dropout& drop,
                                      accum_t inv_keep, ForwardBlock<accum_t, scalar_t>& w,
                                      int64_t r, int64_t i, int64_t j0, int64_t j1) {
  const int64_t nk = j1 - j0, R = g.R;
  accum_t* s = w.scores.data() + r * nk;
  const RowSegments seg = g.segments(g.query_start + i, j0, j1);
  const accum_t* qa_row = hd.ak ? w.qa.data() + r * R : nullptr;
  const FarConstants<accum_t> qa_far = far_constants(qa_row, R);
  add_band_key_term<accum_t>(s, seg, qa_row);
  add_masks<accum_t>(s, g, j0, seg.end, hd.key_bias, mask_row(g, attn_bias, hd.b, hd.h, i));
  // the bfloat16 row the tile GEMMs read (written by the softmax where there is no dropout)
  uint16_t* p_row = w.gemm.p_row(r);
  accum_t* pb_row = hd.av ? w.pb.data() + r * R : nullptr;
  SegmentSums<accum_t> p_sums;
  if (!online_softmax_step(w, r, s, nk, seg, qa_far, g.Dv, R, hd.av != nullptr, p_sums,
                           drop.on ? nullptr : p_row, drop.on ? nullptr : pb_row)) {
    if (p_row != nullptr && drop.on) std::fill(p_row, p_row + w.gemm.p_ld, uint16_t(0));
    return;
  }
  if (drop.on) {
    drop_row<accum_t>(s, seg, drop, hd.dropout_row + i, inv_keep);
    if (pb_row) bucket_row<accum_t>(s, R, seg, pb_row);
    w.gemm.dropped_row(s, nk, p_row);
  }  // (without dropout the softmax added the bucket masses)
}

// Epilogue of a query block: acc += Pb @ aV, out = acc / l, lse = m + log l. A row that sees no
// key gets zeros and lse = +inf, so the backward's P is 0.
template <typename accum_t, typename scalar_t>
static RELPOS_INLINE void forward_epilogue(const Geometry& g, const Head<accum_t, scalar_t>& hd,
                                           ForwardBlock<accum_t, scalar_t>& w, int64_t nq,
                                           scalar_t* out_block, accum_t* lse_block) {
  const int64_t Dv = g.Dv;
  // acc_I (nq, Dv) += Pb_I (nq, R) @ aV (R, Dv)
  if (hd.av) w.gemm.table_values(hd, nq, g.R, Dv, w.pb.data(), w.acc.data());
  for (int64_t r = 0; r < nq; ++r) {
    const accum_t row_sum = w.l[r];
    scalar_t* o = out_block + r * Dv;
    const accum_t* a = w.acc.data() + r * Dv;
    if (row_sum > accum_t(0) || std::isnan(row_sum) || std::isnan(w.m[r])) {
      const accum_t inv = accum_t(1) / row_sum;
      for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<scalar_t>(a[d] * inv);
      lse_block[r] = w.m[r] + std::log(row_sum);
    } else {
      for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<scalar_t>(accum_t(0));
      lse_block[r] = std::numeric_limits<accum_t>::infinity();
    }
  }
}

// One forward task: the query block [i0, min(L, i0 + BQ)) of one head, streamed through its key
// blocks of BK keys by the online softmax; writes the block's rows of out_head (L, Dv) and
// lse_head (L).
template <typename accum_t, typename scalar_t>
static RELPOS_INLINE void forward_task(const Geometry& g, const Head<accum_t, scalar_t>& hd,
                                       const accum_t* attn_bias, accum_t scale, const Dropout& drop,
                                       ForwardBlock<accum_t, scalar_t>& w, int64_t i0, int64_t BQ,
                                       int64_t BK, scalar_t* out_head, accum_t* lse_head) {
  const int64_t D = g.D, Dv = g.Dv;
  const accum_t inv_keep = static_cast<accum_t>(drop.inv_keep);
  const int64_t i1 = std::min(g.L, i0 + BQ), nq = i1 - i0;
  const scalar_t* q_block = hd.q + i0 * D;
  const accum_t* q_wide = w.gemm.begin_block(hd, q_block, nq, D, scale);  // Q_I as T, where needed
  forward_prologue(g, hd, w, nq, scale, q_wide, q_block);
  for (int64_t j0 = 0; j0 < g.S; j0 += BK) {
    if (!g.block_visible(i1, j0)) break;
    const int64_t j1 = g.block_end(i1, j0, BK), nk = j1 - j0;
    w.gemm.key_tile(hd, g.S, BK, j0, nk, D, Dv);
    // S_IJ (nq, nk) = scale · Q_I (nq, D) @ K_J^T
    w.gemm.scores(nq, nk, D, scale, q_block, q_wide, hd.k + j0 * D, w.scores.data());
    for (int64_t r = 0; r < nq; ++r)
      forward_row(g, hd, attn_bias, drop, inv_keep, w, r, i0 + r, j0, j1);
    // acc_I (nq, Dv) += P_IJ (nq, nk) @ V_J (nk, Dv)
    w.gemm.values(nq, nk, Dv, w.scores.data(), hd.v + j0 * Dv, w.acc.data());
  }
  forward_epilogue(g, hd, w, nq, out_head + i0 * Dv, lse_head + i0);
}

// Padded tasks: (batch, head, query block).
template <typename accum_t, typename scalar_t = accum_t>
static void forward_impl(const Geometry& g, const Inputs<accum_t, scalar_t>& in, accum_t scale,
                         const Dropout& drop, scalar_t* out, accum_t* lse, HalfGemms gemms = {}) {
  const int64_t L = g.L;
  const int64_t BQ = forward_query_block(L, g.B * g.H), BK = key_block_size(L, g.S);
  const int64_t n_query_blocks = (L + BQ - 1) / BQ;
  const TileGemm tiles = tile_gemms_of(gemms, BQ, BK, kAmxForwardRows);

  at::parallel_for(0, g.B * g.H * n_query_blocks, 1, [&](int64_t begin, int64_t stop) {
    const SingleThreadedBlas one_thread;
    ForwardBlock<accum_t, scalar_t> w(
        {BQ, BQ * BK, g.R, g.D, g.Dv, BK, in.ak != nullptr, in.av != nullptr}, gemms, tiles);
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t bh = task / n_query_blocks, qb = task % n_query_blocks;
      forward_task(g, head_of(g, in, drop, bh), in.attn_bias, scale, drop, w, qb * BQ, BQ, BK,
                   out + bh * L * g.Dv, lse + bh * L);
    }
  });
}

// Varlen tasks: (sequence, head, query block), each sequence with its own block sizes. The
// tasks of sequence s are first_task[s] + h · (its query blocks) + qb.
template <typename accum_t, typename scalar_t = accum_t>
static void forward_varlen_impl(const VarlenCall& vc, const Inputs<accum_t, scalar_t>& in,
                                accum_t scale, const Dropout& drop, scalar_t* out, accum_t* lse,
                                HalfGemms gemms = {}) {
  const Packing& pk = vc.pk;
  std::vector<int64_t> first_task(pk.N + 1, 0);
  for (int64_t s = 0; s < pk.N; ++s) {
    const int64_t L = vc.seqs[s].L, BQ = forward_query_block(L, vc.heads);
    first_task[s + 1] = first_task[s] + pk.H * ((L + BQ - 1) / BQ);
  }
  const TileGemm tiles = tile_gemms_of(gemms, vc.BQ, vc.BK, kAmxForwardRows);

  at::parallel_for(0, first_task[pk.N], 1, [&](int64_t begin, int64_t stop) {
    const SingleThreadedBlas one_thread;
    ForwardBlock<accum_t, scalar_t> w(
        {vc.BQ, vc.tile, vc.R, vc.D, vc.Dv, vc.BK, in.ak != nullptr, in.av != nullptr}, gemms,
        tiles);
    for (int64_t task = begin; task < stop; ++task) {
      // the last sequence whose tasks start at or before this one (sequences without queries
      // have none)
      const int64_t s =
          std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const Geometry& g = vc.seqs[s];
      const int64_t BQ = forward_query_block(g.L, vc.heads);
      const int64_t n_query_blocks = (g.L + BQ - 1) / BQ;
      const int64_t h = (task - first_task[s]) / n_query_blocks;
      const int64_t qb = (task - first_task[s]) % n_query_blocks;
      const int64_t row = pk.q_row(s, h);
      forward_task(g, varlen_head(g, pk, in, s, h), static_cast<const accum_t*>(nullptr), scale,
                   drop, w, qb * BQ, BQ, key_block_size(g.L, g.S), out + row * g.Dv, lse + row);
    }
  });
}

}  // namespace relpos_native
