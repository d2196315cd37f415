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
#include "gemm.h"
#include "geometry.h"
#include "row_phases.h"

#include <ATen/Parallel.h>

namespace relpos_native {

// One thread's state for the query block it works on: blocks of at most BQ rows, tiles of at
// most `tile` scores (BQ · BK for one block size; the largest of a varlen call's sequences).
template <typename T, typename I = T>
struct ForwardBlock {
  std::vector<T> scores;  // (tile): S of the current tile (nq, nk), then P (row stride nk)
  std::vector<T> qa;      // (BQ, R): QA = scale · Q_I @ aK^T
  std::vector<T> pb;      // (BQ, R): Pb, each row's probability mass per table row
  std::vector<T> acc;     // (BQ, Dv): sum_j p_ij v_j
  std::vector<T> m, l;    // (BQ): the online softmax's running max and sum
  // 16-bit inputs only: Q_I widened (BQ, D); P rounded to I (tile) for the 16-bit value GEMM,
  // or, without 16-bit GEMMs, K_J (BK, D) and V_J (BK, Dv) widened
  std::vector<T> q_wide, k_wide, v_wide;
  std::vector<I> p_low, pb_low;  // P and Pb rounded to I for the 16-bit GEMMs
  bool gemms16 = false;          // 16-bit inputs: the tile GEMMs take 16-bit operands
  TileGemm tiles = kNoTiles;     // ... on packed tiles (bfloat16, AMX or VDPBF16PS):
  AmxBuffer q_pack, pb_pack;     // Q_I (rows; times a power-of-two scale: q_scaled), Pb as it is
  bool q_scaled = false;         // rounded
  AmxBuffer p_rows;  // P in bfloat16, row-major (row stride p_ld), the P @ V GEMM's A as it is
  int64_t p_ld = 0;  // (the tile GEMMs read it with that stride): zeros past each row's keys
  AmxOperand v_op, ak_op, av_op;  // V_J cut short and aV (pairs), aK (transposed)
  AmxHeadTiles k_head, v_head;    // a head's K_J (transposed) and V_J (pairs), kept

  ForwardBlock(int64_t BQ, int64_t tile, int64_t R, int64_t Dv, bool keys, bool values,
               int64_t D = 0, int64_t BK = 0, bool low_gemms = false,
               TileGemm tile_gemms = kNoTiles)
      : scores(tile), qa(keys ? BQ * R : 0), pb(values ? BQ * R : 0), acc(BQ * Dv), m(BQ), l(BQ) {
    if constexpr (!std::is_same_v<T, I>) {
      q_wide.resize(BQ * D);
      if (low_gemms) {
        gemms16 = true;
        pb_low.resize(values ? BQ * R : 0);
        if (tile_gemms != kNoTiles) {
          tiles = tile_gemms;
          q_pack.resize(amx_tiles_of(BQ) * amx_kblocks(D) * kTileElems);
          p_ld = amx_kblocks(BK) * 32;
          p_rows.resize(amx_tiles_of(BQ) * 16 * p_ld);
          pb_pack.resize(values ? amx_tiles_of(BQ) * amx_kblocks(R) * kTileElems : 0);
          v_op.buf.resize(amx_tiles_of(Dv) * amx_kblocks(BK) * kTileElems);
          ak_op.buf.resize(keys ? amx_tiles_of(R) * amx_kblocks(D) * kTileElems : 0);
          av_op.buf.resize(values ? amx_tiles_of(Dv) * amx_kblocks(R) * kTileElems : 0);
        } else {
          p_low.resize(tile);
        }
      } else {
        k_wide.resize(BK * D);
        v_wide.resize(BK * Dv);
      }
    }
  }
};

// The max of a far segment's scores plus its constant; -inf where the segment has no visible
// score (hidden keys are -inf), whatever the constant (-inf + NaN would make the row NaN).
template <typename T>
static inline T far_segment_max(const T* s, int64_t n, T far) {
  const T mx = row_max<T>(s, n);
  return mx == -std::numeric_limits<T>::infinity() ? mx : mx + far;
}

// The row's max over its visible scores, far constants included. row_max skips NaN; a row whose
// visible scores are all NaN must stay NaN, not look empty (other NaNs reach the row through
// exp and its sum).
template <typename T>
static RELPOS_INLINE T segments_max(const T* s, const RowSegments& seg, FarConstants<T> qa_far) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const T* band_scores = s + seg.n_left;
  T mx = ninf;
  if (seg.n_left > 0) mx = nan_max<T>(mx, far_segment_max<T>(s, seg.n_left, qa_far.left));
  if (seg.n_band > 0) mx = nan_max<T>(mx, row_max<T>(band_scores, seg.n_band));
  if (seg.n_right > 0)
    mx = nan_max<T>(mx, far_segment_max<T>(band_scores + seg.n_band, seg.n_right, qa_far.right));
  if (mx == ninf) {
    for (int64_t j = 0; j < seg.n_visible; ++j)
      if (std::isnan(s[j])) mx = std::numeric_limits<T>::quiet_NaN();
  }
  return mx;
}

// RESCALE: the row's running sum, output accumulator and bucket masses, all relative to the old
// max, times alpha = exp(m_old - m_new).
template <typename T, typename I>
static RELPOS_INLINE void rescale_row(ForwardBlock<T, I>& w, int64_t r, T alpha, int64_t Dv,
                                      int64_t R, bool values) {
  w.l[r] *= alpha;
  T* a = w.acc.data() + r * Dv;
  for (int64_t d = 0; d < Dv; ++d) a[d] *= alpha;
  if (values) {
    T* pr = w.pb.data() + r * R;
    for (int64_t x = 0; x < R; ++x) pr[x] *= alpha;
  }
}

// exp_segments for a call on packed tiles without dropout: P rounded to bfloat16 into p_row
// (nk entries: zeros past the visible keys, up to p_ld), s left as it is; with pb_row (R
// entries) the row's bucket masses added in the same pass (add_to_buckets's).
template <typename T>
static RELPOS_INLINE SegmentSums<T> exp_segments_bf16(T* s, const RowSegments& seg,
                                                      FarConstants<T> qa_far, T offset,
                                                      uint16_t* p_row, int64_t p_ld, T* pb_row,
                                                      int64_t R) {
  SegmentSums<T> sum{};
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<T, float>) {
    T* band_scores = s + seg.n_left;
    T* right_scores = band_scores + seg.n_band;
    const int64_t right0 = seg.n_left + seg.n_band;
    if (std::isfinite(qa_far.left)) {
      sum.left = exp_sum_to_bf16(s, seg.n_left, offset - qa_far.left, p_row);
    } else {
      sum.left = far_exp_sum<T, true>(s, seg.n_left, offset, qa_far.left);
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
      sum.right = far_exp_sum<T, true>(right_scores, seg.n_right, offset, qa_far.right);
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
template <typename T, typename I>
static RELPOS_INLINE bool online_softmax_step(ForwardBlock<T, I>& w, int64_t r, T* s, int64_t nk,
                                              const RowSegments& seg, FarConstants<T> qa_far,
                                              int64_t Dv, int64_t R, bool values,
                                              SegmentSums<T>& p_sums, uint16_t* p_row, T* buckets) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const T mx = segments_max<T>(s, seg, qa_far);
  const T m_old = w.m[r];
  const T m_new = std::isnan(mx) ? mx : std::max(m_old, mx);
  if (m_new == ninf) {  // nothing visible yet in this row
    if (p_row != nullptr)
      std::fill(p_row, p_row + w.p_ld, uint16_t(0));
    else
      std::fill(s, s + nk, T(0));
    return false;
  }
  // RESCALE to the new max; a row's first visible tile finds its state empty (0) and skips it
  if (m_old != ninf) {
    const T alpha = exp_<T>(m_old - m_new);
    if (alpha != T(1)) rescale_row(w, r, alpha, Dv, R, values);
  }
  w.m[r] = m_new;
  if (p_row != nullptr) {
    // after the rescale above, so the row's masses are relative to m_new
    p_sums = exp_segments_bf16<T>(s, seg, qa_far, m_new, p_row, w.p_ld, buckets, R);
  } else {
    p_sums = exp_segments<T, !std::is_same_v<T, I>>(s, seg, qa_far, m_new, buckets, R);
    for (int64_t j = seg.n_visible; j < nk; ++j) s[j] = T(0);
  }
  w.l[r] += p_sums.left + p_sums.band + p_sums.right;
  return true;
}

// Dropout of one row of P (forward; `row` its dropout row): dropped entries 0, kept ones times
// 1 / (1 - p).
template <typename T>
static RELPOS_INLINE void drop_row(T* s, const RowSegments& seg, const Dropout& drop, int64_t row,
                                   T inv_keep) {
  uint32_t k1, k2;
  drop.row_keys(row, k1, k2);
  const uint32_t th = drop.threshold;
  const int64_t j0 = seg.j0;
#pragma omp simd
  for (int64_t j = 0; j < seg.n_visible; ++j) {
    const bool kept = Dropout::keep(static_cast<uint32_t>(drop.key_offset + j0 + j), k1, k2, th);
    s[j] = kept ? s[j] * inv_keep : T(0);
  }
}

// out (nq, n) = scale · A (nq, K) @ B^T for rows A and B (n, K) in I (Q_I or dO_I against K_J,
// V_J, aK or aV), 16-bit operands: on packed tiles (tiles), A packed as rows in a_rows (the scale
// already in it where a_scaled) and B packed into op unless it holds B already (or b_packed:
// packed already, op null); else brgemm on a_low and b.
template <typename T, typename I>
static inline void gemm_scores_low(TileGemm tiles, AmxOperand* op, int64_t nq, int64_t n, int64_t K,
                                   T scale, const AmxBuffer& a_rows, bool a_scaled, const I* a_low,
                                   const I* b, T* out, const uint16_t* b_packed = nullptr) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    if (tiles) {
      if (b_packed == nullptr) {
        if (!op->holds(b, n)) {
          amx_pack_transposed(bits_of(b), n, K, op->buf.p);
          op->mark(b, n);
        }
        b_packed = op->buf.p;
      }
      tile_gemm_scaled(tiles, nq, n, amx_kblocks(K), a_scaled ? 1.0f : scale, a_rows.p, b_packed,
                       out);
      return;
    }
  }
#endif
  gemm16<I>(false, true, nq, n, K, scale, a_low, b, T(0), out);
}

// acc_I (nq, Dv) += A (nq, n) @ B (n, Dv), A float (P or Pb, row stride n) rounded to I (into
// a_pack for the packed tiles, a_low for brgemm), B in I (V_J or aV; packed into op unless it
// holds B already). Packed tiles with a_rows: A is there already, in bfloat16 rows of stride
// lda (zeros past n; a_pack null); with b_packed, B too (op null).
template <typename T, typename I>
static inline void values_low(ForwardBlock<T, I>& w, AmxOperand* op, int64_t nq, int64_t n,
                              int64_t Dv, const T* a, AmxBuffer* a_pack, I* a_low, const I* b,
                              const uint16_t* a_rows = nullptr, int64_t lda = 0,
                              const uint16_t* b_packed = nullptr) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    if (w.tiles) {
      if (b_packed == nullptr) {
        if (!op->holds(b, n)) {
          amx_pack_pairs(bits_of(b), n, Dv, op->buf.p);
          op->mark(b, n);
        }
        b_packed = op->buf.p;
      }
      if (a_rows != nullptr) {
        tile_gemm_add(w.tiles, nq, Dv, amx_kblocks(n), a_rows, b_packed, w.acc.data(), 1.0f, lda);
      } else {
        amx_pack_rows(a, nq, n, n, a_pack->p);
        tile_gemm_add(w.tiles, nq, Dv, amx_kblocks(n), a_pack->p, b_packed, w.acc.data());
      }
      return;
    }
  }
#endif
  convert(a, a_low, nq * n);
  gemm16<I>(false, false, nq, Dv, n, T(1), a_low, b, T(1), w.acc.data());
}

// Prologue of a query block: QA of its rows; the online softmax's state emptied.
template <typename T, typename I>
static RELPOS_INLINE void forward_prologue(const Geometry& g, const Head<T, I>& hd,
                                           ForwardBlock<T, I>& w, int64_t nq, T scale,
                                           const T* q_block, const I* q_low) {
  const int64_t R = g.R;
  const T ninf = -std::numeric_limits<T>::infinity();
  // QA_I (nq, R) = scale · Q_I (nq, D) @ aK^T (16-bit operands where the tables come in I)
  if constexpr (!std::is_same_v<T, I>) {
    if (hd.ak_low)
      gemm_scores_low(w.tiles, &w.ak_op, nq, R, g.D, scale, w.q_pack, w.q_scaled, q_low, hd.ak_low,
                      w.qa.data());
  }
  if (hd.ak && !hd.ak_low) gemm_nt<T>(nq, R, g.D, scale, q_block, hd.ak, T(0), w.qa.data());
  if (hd.av) std::fill(w.pb.begin(), w.pb.begin() + nq * R, T(0));
  std::fill(w.acc.begin(), w.acc.begin() + nq * g.Dv, T(0));
  std::fill(w.m.begin(), w.m.end(), ninf);
  std::fill(w.l.begin(), w.l.end(), T(0));
}

// Row r of one tile: band key term, masks, online-softmax step, then dropout and the bucket
// update Pb[i, r_ij] += p_ij. Leaves P (0 where hidden) for the P @ V GEMM in the row's tile
// or, on packed tiles, in bfloat16 in row r of w.p_rows (row stride w.p_ld).
template <typename T, typename I>
static RELPOS_INLINE void forward_row(const Geometry& g, const Head<T, I>& hd, const T* attn_bias,
                                      const Dropout& drop, T inv_keep, ForwardBlock<T, I>& w,
                                      int64_t r, int64_t i, int64_t j0, int64_t j1) {
  const int64_t nk = j1 - j0, R = g.R;
  T* s = w.scores.data() + r * nk;
  const RowSegments seg = g.segments(g.query_start + i, j0, j1);
  const T* qa_row = hd.ak ? w.qa.data() + r * R : nullptr;
  const FarConstants<T> qa_far = far_constants(qa_row, R);
  add_band_key_term<T>(s, seg, qa_row);
  add_masks<T>(s, g, j0, seg.end, hd.key_bias, mask_row(g, attn_bias, hd.b, hd.h, i));
  // the bfloat16 row the tile GEMMs read (written by the softmax where there is no dropout)
  uint16_t* p_row = w.tiles ? w.p_rows.p + r * w.p_ld : nullptr;
  T* pb_row = hd.av ? w.pb.data() + r * R : nullptr;
  SegmentSums<T> p_sums;
  if (!online_softmax_step(w, r, s, nk, seg, qa_far, g.Dv, R, hd.av != nullptr, p_sums,
                           drop.on ? nullptr : p_row, drop.on ? nullptr : pb_row)) {
    if (p_row != nullptr && drop.on) std::fill(p_row, p_row + w.p_ld, uint16_t(0));
    return;
  }
  if (drop.on) {
    drop_row<T>(s, seg, drop, hd.dropout_row + i, inv_keep);
    if (pb_row) bucket_row<T>(s, R, seg, pb_row);
#ifdef RELPOS_HAVE_BF16_TILES
    if constexpr (std::is_same_v<T, float>) {
      if (p_row != nullptr) {
        round_to_bf16(s, nk, p_row);
        std::fill(p_row + nk, p_row + w.p_ld, uint16_t(0));
      }
    }
#endif
  }  // (without dropout the softmax added the bucket masses)
}

// Epilogue of a query block: acc += Pb @ aV, out = acc / l, lse = m + log l. A row that sees no
// key gets zeros and lse = +inf, so the backward's P is 0.
template <typename T, typename I>
static RELPOS_INLINE void forward_epilogue(const Geometry& g, const Head<T, I>& hd,
                                           ForwardBlock<T, I>& w, int64_t nq, I* out_block,
                                           T* lse_block) {
  const int64_t Dv = g.Dv;
  // acc_I (nq, Dv) += Pb_I (nq, R) @ aV (R, Dv) (Pb rounded to I where aV comes in I)
  if constexpr (!std::is_same_v<T, I>) {
    if (hd.av_low)
      values_low(w, &w.av_op, nq, g.R, Dv, w.pb.data(), &w.pb_pack, w.pb_low.data(), hd.av_low);
  }
  if (hd.av && !hd.av_low) gemm_nn<T>(nq, Dv, g.R, T(1), w.pb.data(), hd.av, T(1), w.acc.data());
  for (int64_t r = 0; r < nq; ++r) {
    const T row_sum = w.l[r];
    I* o = out_block + r * Dv;
    const T* a = w.acc.data() + r * Dv;
    if (row_sum > T(0) || std::isnan(row_sum) || std::isnan(w.m[r])) {
      const T inv = T(1) / row_sum;
      for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<I>(a[d] * inv);
      lse_block[r] = w.m[r] + std::log(row_sum);
    } else {
      for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<I>(T(0));
      lse_block[r] = std::numeric_limits<T>::infinity();
    }
  }
}

// With 16-bit GEMMs, Q_I's operand for the block: packed in tiles (else read in place),
// times the scale where it is a power of two (1/8 for D = 64: exact, and the score tiles are
// then stored straight from the tile registers, with no pass to scale them).
template <typename T, typename I>
static inline void pack_query_low(ForwardBlock<T, I>& w, const I* q_block, int64_t nq, int64_t D,
                                  T scale) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    if (!w.tiles) return;
    w.q_scaled = power_of_two(scale);
    amx_pack_rows(bits_of(q_block), nq, D, D, w.q_pack.p, w.q_scaled ? scale : 1.0f);
  }
#endif
}

// One forward task: the query block [i0, min(L, i0 + BQ)) of one head, streamed through its key
// blocks of BK keys by the online softmax; writes the block's rows of out_head (L, Dv) and
// lse_head (L).
template <typename T, typename I>
static RELPOS_INLINE void forward_task(const Geometry& g, const Head<T, I>& hd, const T* attn_bias,
                                       T scale, const Dropout& drop, ForwardBlock<T, I>& w,
                                       int64_t i0, int64_t BQ, int64_t BK, I* out_head,
                                       T* lse_head) {
  const int64_t D = g.D, Dv = g.Dv;
  const T inv_keep = static_cast<T>(drop.inv_keep);
  const int64_t i1 = std::min(g.L, i0 + BQ), nq = i1 - i0;
  const I* q_block = hd.q + i0 * D;
  constexpr bool low = !std::is_same_v<T, I>;
  const bool low_gemms = low && w.gemms16;  // else K_J, V_J widened per tile
  const T* q_wide = nullptr;  // Q_I as T: for QA and the score GEMM without 16-bit GEMMs
  if constexpr (low) {
    if (!low_gemms || (hd.ak != nullptr && hd.ak_low == nullptr)) {
      convert(q_block, w.q_wide.data(), nq * D);
      q_wide = w.q_wide.data();
    }
    if (low_gemms) pack_query_low(w, q_block, nq, D, scale);
  } else {
    q_wide = q_block;
  }
  forward_prologue(g, hd, w, nq, scale, q_wide, q_block);
  for (int64_t j0 = 0; j0 < g.S; j0 += BK) {
    if (!g.block_visible(i1, j0)) break;
    const int64_t j1 = g.block_end(i1, j0, BK), nk = j1 - j0;
    // the head's K_J and V_J as packed operands (V_J cut by the causal mask: nullptr, packed alone)
    const uint16_t* k_packed = nullptr;
    const uint16_t* v_packed = nullptr;
#ifdef RELPOS_HAVE_BF16_TILES
    if constexpr (std::is_same_v<I, c10::BFloat16>) {
      if (w.tiles) {
        k_packed = amx_head_tile_transposed(w.k_head, hd.k, g.S, BK, j0, D);
        v_packed = amx_head_tile_pairs(w.v_head, hd.v, g.S, BK, j0, nk, Dv);
      }
    }
#endif
    // S_IJ (nq, nk) = scale · Q_I (nq, D) @ K_J^T
    if constexpr (low) {
      if (low_gemms) {
        gemm_scores_low(w.tiles, nullptr, nq, nk, D, scale, w.q_pack, w.q_scaled, q_block,
                        hd.k + j0 * D, w.scores.data(), k_packed);
      } else {
        convert(hd.k + j0 * D, w.k_wide.data(), nk * D);
        gemm_nt<T>(nq, nk, D, scale, q_wide, w.k_wide.data(), T(0), w.scores.data());
      }
    } else {
      gemm_nt<T>(nq, nk, D, scale, q_block, hd.k + j0 * D, T(0), w.scores.data());
    }
    for (int64_t r = 0; r < nq; ++r)
      forward_row(g, hd, attn_bias, drop, inv_keep, w, r, i0 + r, j0, j1);
    // acc_I (nq, Dv) += P_IJ (nq, nk) @ V_J (nk, Dv)
    if constexpr (low) {
      if (low_gemms) {
        values_low(w, &w.v_op, nq, nk, Dv, w.scores.data(), nullptr, w.p_low.data(), hd.v + j0 * Dv,
                   w.p_rows.p, w.p_ld, v_packed);
      } else {
        convert(hd.v + j0 * Dv, w.v_wide.data(), nk * Dv);
        gemm_nn<T>(nq, Dv, nk, T(1), w.scores.data(), w.v_wide.data(), T(1), w.acc.data());
      }
    } else {
      gemm_nn<T>(nq, Dv, nk, T(1), w.scores.data(), hd.v + j0 * Dv, T(1), w.acc.data());
    }
  }
  forward_epilogue(g, hd, w, nq, out_head + i0 * Dv, lse_head + i0);
}

// Padded tasks: (batch, head, query block).
template <typename T, typename I = T>
static void forward_impl(const Geometry& g, const Inputs<T, I>& in, T scale, const Dropout& drop,
                         I* out, T* lse, HalfGemms gemms = {}) {
  const int64_t L = g.L;
  const int64_t BQ = forward_query_block(L, g.B * g.H), BK = key_block_size(L, g.S);
  const int64_t n_query_blocks = (L + BQ - 1) / BQ;
  const TileGemm tiles = tile_gemms_of(gemms, BQ, BK, kAmxForwardRows);

  at::parallel_for(0, g.B * g.H * n_query_blocks, 1, [&](int64_t begin, int64_t stop) {
    const SingleThreadedBlas one_thread;
    ForwardBlock<T, I> w(BQ, BQ * BK, g.R, g.Dv, in.ak != nullptr, in.av != nullptr, g.D, BK,
                         gemms.low, tiles);
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t bh = task / n_query_blocks, qb = task % n_query_blocks;
      forward_task(g, head_of(g, in, drop, bh), in.attn_bias, scale, drop, w, qb * BQ, BQ, BK,
                   out + bh * L * g.Dv, lse + bh * L);
    }
  });
}

// Varlen tasks: (sequence, head, query block), each sequence with its own block sizes. The
// tasks of sequence s are first_task[s] + h · (its query blocks) + qb.
template <typename T, typename I = T>
static void forward_varlen_impl(const VarlenCall& vc, const Inputs<T, I>& in, T scale,
                                const Dropout& drop, I* out, T* lse, HalfGemms gemms = {}) {
  const Packing& pk = vc.pk;
  std::vector<int64_t> first_task(pk.N + 1, 0);
  for (int64_t s = 0; s < pk.N; ++s) {
    const int64_t L = vc.seqs[s].L, BQ = forward_query_block(L, vc.heads);
    first_task[s + 1] = first_task[s] + pk.H * ((L + BQ - 1) / BQ);
  }
  const TileGemm tiles = tile_gemms_of(gemms, vc.BQ, vc.BK, kAmxForwardRows);

  at::parallel_for(0, first_task[pk.N], 1, [&](int64_t begin, int64_t stop) {
    const SingleThreadedBlas one_thread;
    ForwardBlock<T, I> w(vc.BQ, vc.tile, vc.R, vc.Dv, in.ak != nullptr, in.av != nullptr, vc.D,
                         vc.BK, gemms.low, tiles);
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
      forward_task(g, varlen_head(g, pk, in, s, h), static_cast<const T*>(nullptr), scale, drop, w,
                   qb * BQ, BQ, key_block_size(g.L, g.S), out + row * g.Dv, lse + row);
    }
  });
}

}  // namespace relpos_native
