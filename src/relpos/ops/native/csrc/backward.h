// The backward: one thread's state (BackwardBlock); the phases of a query block (prologue:
// delta, QA, dOA; per row of a tile: recompute P, NaN rows, dS by segment, bucket sums; the tile
// GEMMs dV, dq, dK; epilogue: the table terms of dq and the table gradients); the bfloat16 tile
// GEMMs on packed operands; the task (one head, its query blocks, in each its key blocks); and
// its loops: backward_impl (padded: (batch, head)) and backward_varlen_impl (varlen: (sequence,
// head) by groups of sequences, whose table-gradient partials are fixed by the lengths alone).

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

// One thread's state for the query block it works on (sizes as for ForwardBlock). With 16-bit
// inputs (I) it also holds the head's dK and dV in float (S_max rows: the largest S of the call)
// until the task rounds them once, Q_I and dO_I widened (for the table gradients), and either
// P (or P dropped) and dS rounded to I for the 16-bit GEMMs or, without them, K_J and V_J
// widened.
template <typename T, typename I = T>
struct BackwardBlock {
  std::vector<T> scores;     // (tile): S of the current tile (nq, nk), then P (row stride nk)
  std::vector<T> dp;         // (tile): dP = dO @ V_J^T (+ dOA), then dS
  std::vector<T> p_dropped;  // (tile), with dropout only: P times the keep mask / (1 - p)
  std::vector<T> qa;         // (BQ, R): QA = scale · Q_I @ aK^T
  std::vector<T> doa;        // (BQ, R): dOA = dO_I @ aV^T
  std::vector<T> pb;         // (BQ, R): Pb, bucket sums of the (dropped) P
  std::vector<T> dsb;        // (BQ, R): dSb, bucket sums of dS
  std::vector<T> dq_acc;     // (BQ, D): dS @ K + dSb @ aK, before the scale
  std::vector<T> delta;      // (BQ): dO_i . out_i
  std::vector<T> q_wide, do_wide, dk_acc, dv_acc, k_wide, v_wide;  // 16-bit inputs only
  std::vector<I> p_low, ds_low;  // 16-bit inputs with 16-bit GEMMs only
  bool gemms16 = false;          // 16-bit inputs: the tile GEMMs take 16-bit operands
  TileGemm tiles = kNoTiles;     // ... on packed tiles (bfloat16, AMX or VDPBF16PS):
  AmxBuffer q_rows, do_rows, q_pairs, do_pairs;  // per query block (Q times a power-of-two
  bool q_scaled = false;                         // scale in q_rows and q_pairs: q_scaled)
  AmxOperand ak_op, av_op;  // aK, aV transposed (kept while the same rows come back)
  AmxOperand k_pairs;       // K_J as pairs where cut short
  AmxHeadTiles k_head_t, v_head_t, k_head_pairs;  // a head's K_J, V_J transposed and K_J as
                                                  // pairs, kept for its query blocks
  AmxBuffer p_t, ds_rows, ds_t;                   // P^T, dS and dS^T of the tile

  BackwardBlock(int64_t BQ, int64_t tile, int64_t R, int64_t D, bool keys, bool values,
                bool dropout, int64_t Dv = 0, int64_t BK = 0, int64_t S_max = 0,
                bool low_gemms = false, TileGemm tile_gemms = kNoTiles)
      : scores(tile), dp(tile), p_dropped(dropout ? tile : 0), qa(keys ? BQ * R : 0),
        doa(values ? BQ * R : 0), pb(values ? BQ * R : 0), dsb(keys ? BQ * R : 0), dq_acc(BQ * D),
        delta(BQ) {
    if constexpr (!std::is_same_v<T, I>) {
      q_wide.resize(BQ * D);
      do_wide.resize(BQ * Dv);
      dk_acc.resize(S_max * D);
      dv_acc.resize(S_max * Dv);
      if (low_gemms) {
        gemms16 = true;
        if (tile_gemms != kNoTiles) {
          tiles = tile_gemms;
          const int64_t kq = amx_kblocks(BQ), kk = amx_kblocks(BK);
          q_rows.resize(amx_tiles_of(BQ) * amx_kblocks(D) * kTileElems);
          do_rows.resize(amx_tiles_of(BQ) * amx_kblocks(Dv) * kTileElems);
          q_pairs.resize(amx_tiles_of(D) * kq * kTileElems);
          do_pairs.resize(amx_tiles_of(Dv) * kq * kTileElems);
          k_pairs.buf.resize(amx_tiles_of(D) * kk * kTileElems);
          ak_op.buf.resize(keys ? amx_tiles_of(R) * amx_kblocks(D) * kTileElems : 0);
          av_op.buf.resize(values ? amx_tiles_of(R) * amx_kblocks(Dv) * kTileElems : 0);
          p_t.resize(amx_tiles_of(BK) * kq * kTileElems);
          ds_rows.resize(amx_tiles_of(BQ) * kk * kTileElems);
          ds_t.resize(amx_tiles_of(BK) * kq * kTileElems);
        }
        if (!tiles) {
          p_low.resize(tile);
          ds_low.resize(tile);
        }
      } else {
        k_wide.resize(BK * D);
        v_wide.resize(BK * Dv);
      }
    }
  }
};

// The packed-tile GEMMs of the bfloat16 backward (gemm_tiles.h; as the forward's): Q_I, dO_I as
// row tiles and as pairs, once per query block (Q times the scale where it is a power of two:
// exact).
template <typename T, typename I>
static inline void backward_pack_block(BackwardBlock<T, I>& w, int64_t nq, int64_t D, int64_t Dv,
                                       T scale, const I* q_block, const I* do_block) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    w.q_scaled = power_of_two(scale);
    const float q_scale = w.q_scaled ? scale : 1.0f;
    amx_pack_rows(bits_of(q_block), nq, D, D, w.q_rows.p, q_scale);
    amx_pack_pairs(bits_of(q_block), nq, D, w.q_pairs.p, q_scale);
    amx_pack_rows(bits_of(do_block), nq, Dv, Dv, w.do_rows.p);
    amx_pack_pairs(bits_of(do_block), nq, Dv, w.do_pairs.p);
    return;
  }
#endif
  TORCH_CHECK(false, "relpos native: no bfloat16 tile GEMMs in this build");
}

// Rows [r0, r1) of P (pd) and dS (w.dp), done, rounded to bfloat16 into their packed operands
// while in cache: dS as rows, and where r1 ends a 32-row k-block (or the block), that k-block
// of P^T and dS^T.
template <typename T, typename I>
static inline void backward_pack_rows(BackwardBlock<T, I>& w, int64_t nq, int64_t nk, const T* pd,
                                      int64_t r0, int64_t r1) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    for (int64_t r = r0; r < r1; ++r) amx_pack_row(w.dp.data() + r * nk, nk, r, w.ds_rows.p);
    if (r1 % 32 == 0 || r1 == nq) {
      amx_pack_rows_t(pd, nq, nk, w.p_t.p, (r1 - 1) / 32);
      amx_pack_rows_t(w.dp.data(), nq, nk, w.ds_t.p, (r1 - 1) / 32);
    }
  }
#endif
}

// dV_J += P_IJ^T @ dO_I, dq_acc_I += dS_IJ @ K_J and dK_J += scale · dS_IJ^T @ Q_I on packed
// tiles, P (pd) and dS (w.dp) packed by backward_pack_rows, K_J as pairs (k_packed: the head's
// cache; else packed unless held).
template <typename T, typename I>
static inline void backward_tile_gradients_packed(BackwardBlock<T, I>& w, int64_t nq, int64_t nk,
                                                  int64_t D, int64_t Dv, T scale, const I* k_tile,
                                                  T* dv_tile, T* dk_tile,
                                                  const uint16_t* k_packed = nullptr) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<I, c10::BFloat16>) {
    const int64_t kq = amx_kblocks(nq);
    if (k_packed == nullptr) {
      if (!w.k_pairs.holds(k_tile, nk)) {
        amx_pack_pairs(bits_of(k_tile), nk, D, w.k_pairs.buf.p);
        w.k_pairs.mark(k_tile, nk);
      }
      k_packed = w.k_pairs.buf.p;
    }
    amx_pack_row_padding(nq, nk, w.ds_rows.p);
    tile_gemm_add(w.tiles, nk, Dv, kq, w.p_t.p, w.do_pairs.p, dv_tile);
    tile_gemm_add(w.tiles, nq, D, amx_kblocks(nk), w.ds_rows.p, k_packed, w.dq_acc.data());
    tile_gemm_add(w.tiles, nk, D, kq, w.ds_t.p, w.q_pairs.p, dk_tile, w.q_scaled ? 1.0f : scale);
    return;
  }
#endif
  TORCH_CHECK(false, "relpos native: no bfloat16 tile GEMMs in this build");
}

// delta_i = dO_i . out_i for the rows of a query block.
template <typename T, typename I>
static RELPOS_INLINE void row_deltas(T* delta, const I* do_block, const I* out_block, int64_t nq,
                                     int64_t Dv) {
  for (int64_t r = 0; r < nq; ++r) {
    T acc = 0;
    for (int64_t d = 0; d < Dv; ++d)
      acc += static_cast<T>(do_block[r * Dv + d]) * static_cast<T>(out_block[r * Dv + d]);
    delta[r] = acc;
  }
}

// dS = P (dP - delta') over a far segment, where delta' = delta - the segment's dOA constant;
// dS over dp in place. Returns the segment's sum of dS (its dSb bucket).
template <typename T>
static RELPOS_INLINE T far_segment_ds(const T* p, T* dp, int64_t n, T far_delta) {
#if defined(RELPOS_VEC_FLOAT)
  if constexpr (std::is_same_v<T, float>) return far_segment_ds_vec(p, dp, n, far_delta);
#endif
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const T x = p[j] * (dp[j] - far_delta);
    dp[j] = x;
    sum += x;
  }
  return sum;
}

// Without dropout: dS = P (dO . (v_j + aV[r]) - delta) over a row, in place of dP. The band
// gathers its dOA term; each far segment's is a constant, folded into its delta. Returns the
// far segments' dS sums (the band's are added entry by entry in the bucket update).
template <typename T>
static RELPOS_INLINE SegmentSums<T> ds_row(const T* s, T* dp, const RowSegments& seg,
                                           const T* doa_row, FarConstants<T> doa_far, T row_delta) {
  SegmentSums<T> ds;
  ds.left = far_segment_ds<T>(s, dp, seg.n_left, row_delta - doa_far.left);
  const T* band_p = s + seg.n_left;
  T* band_dp = dp + seg.n_left;
  const T* doa_band = doa_row ? doa_row + seg.band_row : nullptr;
  for (int64_t x = 0; x < seg.n_band; ++x)
    band_dp[x] = band_p[x] * (band_dp[x] + (doa_band ? doa_band[x] : T(0)) - row_delta);
  ds.band = T(0);  // not summed
  ds.right = far_segment_ds<T>(band_p + seg.n_band, band_dp + seg.n_band, seg.n_right,
                               row_delta - doa_far.right);
  return ds;
}

// With dropout: dP += dOA (gathered in the band, constants in the far segments), then with the
// row's keep weights w (0 or 1 / (1 - p)): p_dropped = P w, and dS = P (dP w - delta) in place
// of dP (`row`: the row's dropout row). The hidden tail of p_dropped is set to 0.
template <typename T>
static RELPOS_INLINE void ds_row_dropout(const T* s, T* dp, T* p_dropped, int64_t nk,
                                         const RowSegments& seg, const T* doa_row,
                                         FarConstants<T> doa_far, T row_delta, const Dropout& drop,
                                         int64_t row, T inv_keep) {
  const int64_t nl = seg.n_left, nb = seg.n_band, nr = seg.n_right, nv = seg.n_visible;
  if (doa_row != nullptr) {
    T* band_dp = dp + nl;
    for (int64_t j = 0; j < nl; ++j) dp[j] += doa_far.left;
    const T* doa_band = doa_row + seg.band_row;
    for (int64_t x = 0; x < nb; ++x) band_dp[x] += doa_band[x];
    for (int64_t j = 0; j < nr; ++j) band_dp[nb + j] += doa_far.right;
  }
  uint32_t k1, k2;
  drop.row_keys(row, k1, k2);
  const uint32_t th = drop.threshold;
  const int64_t j0 = seg.j0;
#pragma omp simd
  for (int64_t j = 0; j < nv; ++j) {
    const T w = Dropout::keep(static_cast<uint32_t>(drop.key_offset + j0 + j), k1, k2, th)
                    ? inv_keep
                    : T(0);
    p_dropped[j] = s[j] * w;
    dp[j] = s[j] * (dp[j] * w - row_delta);  // dS
  }
  for (int64_t j = nv; j < nk; ++j) p_dropped[j] = T(0);
}

// A row that the forward left NaN (lse NaN; `s` its scores with the masks applied): P and dS
// are NaN at its keys but 0 at the keys its masks hide (-inf), as the reference's masked softmax
// gives, so that the row reaches neither a hidden key's dk nor a table row it reads only
// through hidden keys.
template <typename T>
static RELPOS_INLINE void nan_row(T* s, T* dp, int64_t n_visible) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (int64_t j = 0; j < n_visible; ++j) {
    const T x = s[j] == ninf ? T(0) : nan;
    s[j] = x;
    dp[j] = x;
  }
}

// Row r of one tile: recompute P = exp(s - lse) (band key term, masks, far constants in the
// offsets), turn dP into dS, and add the row's bucket sums to Pb (for daV) and dSb (for dq and
// daK). Leaves P (or P dropped) and dS, both 0 where hidden, for the tile's GEMMs. A row that
// sees no key (lse = +inf) leaves zeros and no bucket sums, whatever the tables hold; a NaN
// row (lse NaN) NaN except at hidden keys (nan_row).
template <typename T, typename I>
static RELPOS_INLINE void backward_row(const Geometry& g, const Head<T, I>& hd, const T* attn_bias,
                                       const Dropout& drop, T inv_keep, BackwardBlock<T, I>& w,
                                       T* pd, T row_lse, int64_t r, int64_t i, int64_t j0,
                                       int64_t j1) {
  const int64_t nk = j1 - j0, R = g.R;
  T* s = w.scores.data() + r * nk;
  T* dp = w.dp.data() + r * nk;
  T* pd_row = pd + r * nk;
  if (row_lse == std::numeric_limits<T>::infinity()) {
    std::fill(s, s + nk, T(0));
    std::fill(dp, dp + nk, T(0));
    if (drop.on) std::fill(pd_row, pd_row + nk, T(0));
    return;
  }
  const RowSegments seg = g.segments(g.query_start + i, j0, j1);
  const T* qa_row = hd.ak ? w.qa.data() + r * R : nullptr;
  const T* doa_row = hd.av ? w.doa.data() + r * R : nullptr;
  const FarConstants<T> qa_far = far_constants(qa_row, R);
  const FarConstants<T> doa_far = far_constants(doa_row, R);
  add_band_key_term<T>(s, seg, qa_row);
  add_masks<T>(s, g, j0, seg.end, hd.key_bias, mask_row(g, attn_bias, hd.b, hd.h, i));
  const T row_delta = w.delta[r];
  T* pb_row = hd.av ? w.pb.data() + r * R : nullptr;
  T* dsb_row = hd.ak ? w.dsb.data() + r * R : nullptr;
  if (std::isnan(row_lse)) {
    nan_row<T>(s, dp, seg.n_visible);
    if (drop.on) {
      std::copy(s, s + seg.n_visible, pd_row);
      std::fill(pd_row + seg.n_visible, pd_row + nk, T(0));
    }
    if (pb_row) bucket_row<T>(s, R, seg, pb_row);
    if (dsb_row) bucket_row<T>(dp, R, seg, dsb_row);
  } else if (!drop.on) {
    // P, segment by segment (the far constants folded into the offsets)
    exp_segments<T, !std::is_same_v<T, I>>(s, seg, qa_far, row_lse, pb_row, R);  // P, Pb
    const SegmentSums<T> ds_sums = ds_row<T>(s, dp, seg, doa_row, doa_far, row_delta);
    if (dsb_row) add_to_buckets<T>(dsb_row, R, seg, ds_sums.left, dp + seg.n_left, ds_sums.right);
  } else {
    exp_segments<T, !std::is_same_v<T, I>>(s, seg, qa_far, row_lse);
    ds_row_dropout<T>(s, dp, pd_row, nk, seg, doa_row, doa_far, row_delta, drop, hd.dropout_row + i,
                      inv_keep);
    if (pb_row) bucket_row<T>(pd_row, R, seg, pb_row);
    if (dsb_row) bucket_row<T>(dp, R, seg, dsb_row);
  }
  // the hidden tail is 0 in both buffers
  for (int64_t j = seg.n_visible; j < nk; ++j) {
    dp[j] = T(0);
    s[j] = T(0);
  }
}

// Prologue of a query block: delta, QA and dOA of its rows; Pb, dSb and dq_acc zeroed. q_wide
// and do_wide: Q_I and dO_I as T; q_block and do_block as given (I).
template <typename T, typename I>
static RELPOS_INLINE void backward_prologue(const Geometry& g, const Head<T, I>& hd,
                                            BackwardBlock<T, I>& w, int64_t nq, T scale,
                                            const I* q_block, const I* do_block, const I* out_block,
                                            const T* q_wide, const T* do_wide) {
  const int64_t D = g.D, Dv = g.Dv, R = g.R;
  row_deltas<T, I>(w.delta.data(), do_block, out_block, nq, Dv);
  if (hd.ak) {
    // QA_I (nq, R) = scale · Q_I (nq, D) @ aK^T (16-bit operands where the tables come in I,
    // as the forward computed it)
    if constexpr (!std::is_same_v<T, I>) {
      if (hd.ak_low)
        gemm_scores_low(w.tiles, &w.ak_op, nq, R, D, scale, w.q_rows, w.q_scaled, q_block,
                        hd.ak_low, w.qa.data());
    }
    if (!hd.ak_low) gemm_nt<T>(nq, R, D, scale, q_wide, hd.ak, T(0), w.qa.data());
    std::fill(w.dsb.begin(), w.dsb.begin() + nq * R, T(0));
  }
  if (hd.av) {
    // dOA_I (nq, R) = dO_I (nq, Dv) @ aV^T
    if constexpr (!std::is_same_v<T, I>) {
      if (hd.av_low)
        gemm_scores_low(w.tiles, &w.av_op, nq, R, Dv, T(1), w.do_rows, false, do_block, hd.av_low,
                        w.doa.data());
    }
    if (!hd.av_low) gemm_nt<T>(nq, R, Dv, T(1), do_wide, hd.av, T(0), w.doa.data());
    std::fill(w.pb.begin(), w.pb.begin() + nq * R, T(0));
  }
  std::fill(w.dq_acc.begin(), w.dq_acc.begin() + nq * D, T(0));
}

// The relative key term of dq: dq_acc_I += dSb_I @ aK. With a non-finite aK, row by row over
// the table rows each query can read (a row's other buckets are 0, but 0 · inf is NaN, and the
// reference never multiplies them), none for a row that sees no key (lse = +inf).
template <typename T, typename I>
static RELPOS_INLINE void dq_table_term(const Geometry& g, const Head<T, I>& hd,
                                        BackwardBlock<T, I>& w, int64_t i0, int64_t nq,
                                        const T* lse_block, bool ak_finite) {
  const int64_t D = g.D, R = g.R;
  if (ak_finite) {
    // dq_acc_I (nq, D) += dSb_I (nq, R) @ aK (R, D)
    gemm_nn<T>(nq, D, R, T(1), w.dsb.data(), hd.ak, T(1), w.dq_acc.data());
    return;
  }
  for (int64_t r = 0; r < nq; ++r) {
    if (lse_block[r] == std::numeric_limits<T>::infinity()) continue;
    int64_t lo, hi;
    g.table_rows(g.query_start + i0 + r, lo, hi);
    // dq_acc_i (1, D) += dSb_i[lo..hi] (1, n) @ aK[lo..hi] (n, D)
    if (lo <= hi)
      gemm_nn<T>(1, D, hi - lo + 1, T(1), w.dsb.data() + r * R + lo, hd.ak + lo * D, T(1),
                 w.dq_acc.data() + r * D);
  }
}

// Epilogue of a query block: its relative terms of dq, its shares of the table gradients
// (into this head's partials), and dq = scale · dq_acc (rounded to I).
template <typename T, typename I>
static RELPOS_INLINE void backward_epilogue(const Geometry& g, const Head<T, I>& hd,
                                            BackwardBlock<T, I>& w, int64_t i0, int64_t nq, T scale,
                                            bool ak_finite, const T* lse_block, const T* q_wide,
                                            const T* do_wide, T* dak_head, T* dav_head,
                                            I* dq_block) {
  const int64_t D = g.D, Dv = g.Dv, R = g.R;
  if (hd.ak) {
    dq_table_term<T, I>(g, hd, w, i0, nq, lse_block, ak_finite);
    // daK (R, D) += scale · dSb_I^T @ Q_I (nq, D)
    gemm_tn<T>(R, D, nq, scale, w.dsb.data(), q_wide, T(1), dak_head);
  }
  // daV (R, Dv) += Pb_I^T @ dO_I (nq, Dv)
  if (hd.av) gemm_tn<T>(R, Dv, nq, T(1), w.pb.data(), do_wide, T(1), dav_head);
  for (int64_t x = 0; x < nq * D; ++x) dq_block[x] = static_cast<I>(scale * w.dq_acc[x]);
}

// Two blocks a (na entries) and b (nb) as T: widened into wa and wb for 16-bit inputs, the
// inputs themselves otherwise.
template <typename T, typename I>
static RELPOS_INLINE std::pair<const T*, const T*> as_wide2(const I* a, int64_t na,
                                                            std::vector<T>& wa, const I* b,
                                                            int64_t nb, std::vector<T>& wb) {
  if constexpr (std::is_same_v<T, I>) {
    return {a, b};
  } else {
    convert(a, wa.data(), na);
    convert(b, wb.data(), nb);
    return {wa.data(), wb.data()};
  }
}

// What one backward task reads and writes besides its Head: its rows of dO, out and lse, its
// gradients (dk and dv rows its own, written whole by the task) and the table-gradient partials
// it adds to (zeroed by its caller).
template <typename T, typename I = T>
struct HeadGradients {
  const I* dout;  // (L, Dv)
  const I* out;   // (L, Dv)
  const T* lse;   // (L)
  I* dq;          // (L, D)
  I* dk;          // (S, D)
  I* dv;          // (S, Dv)
  T* dak;         // (R, D), or nullptr without rel_keys
  T* dav;         // (R, Dv), or nullptr without rel_values
};

// One backward task: one head, its query blocks of BQ rows, and in each the key blocks of BK
// keys, as the forward did. With 16-bit inputs the five tile GEMMs take 16-bit operands (P and
// dS rounded to I, as torch's flash kernel rounds them) with float accumulation, dK and dV are
// accumulated in float and rounded once at the end; without 16-bit GEMMs K_J and V_J are widened
// per tile and the float GEMMs serve.
template <typename T, typename I>
static RELPOS_INLINE void backward_task(const Geometry& g, const Head<T, I>& hd,
                                        const HeadGradients<T, I>& gr, const T* attn_bias, T scale,
                                        bool ak_finite, const Dropout& drop, BackwardBlock<T, I>& w,
                                        int64_t BQ, int64_t BK) {
  const int64_t L = g.L, S = g.S, D = g.D, Dv = g.Dv;
  const T inv_keep = static_cast<T>(drop.inv_keep);
  constexpr bool low = !std::is_same_v<T, I>;
  const bool low_gemms = low && w.gemms16;
  T* dk = nullptr;  // (S, D) and (S, Dv): where dK and dV accumulate
  T* dv = nullptr;
  if constexpr (low) {
    dk = w.dk_acc.data();
    dv = w.dv_acc.data();
  } else {
    dk = gr.dk;
    dv = gr.dv;
  }
  std::fill(dk, dk + S * D, T(0));
  std::fill(dv, dv + S * Dv, T(0));
  for (int64_t i0 = 0; i0 < L; i0 += BQ) {
    const int64_t i1 = std::min(L, i0 + BQ), nq = i1 - i0;
    const I* q_block = hd.q + i0 * D;
    const I* do_block = gr.dout + i0 * Dv;
    const T* lse_block = gr.lse + i0;
    // Q_I and dO_I as T
    const auto [q_wide, do_wide] =
        as_wide2<T, I>(q_block, nq * D, w.q_wide, do_block, nq * Dv, w.do_wide);
    if (w.tiles) backward_pack_block(w, nq, D, Dv, scale, q_block, do_block);
    backward_prologue<T, I>(g, hd, w, nq, scale, q_block, do_block, gr.out + i0 * Dv, q_wide,
                            do_wide);
    for (int64_t j0 = 0; j0 < S; j0 += BK) {
      if (!g.block_visible(i1, j0)) break;
      const int64_t j1 = g.block_end(i1, j0, BK), nk = j1 - j0;
      const I* k_tile = hd.k + j0 * D;
      const I* v_tile = hd.v + j0 * Dv;
      const T* k_wide = nullptr;  // K_J and V_J as T (float GEMMs)
      // the head's K_J, V_J (transposed) and K_J (pairs; nullptr where the causal mask cuts
      // the tile) as packed operands
      const uint16_t* k_packed_t = nullptr;
      const uint16_t* v_packed_t = nullptr;
      const uint16_t* k_packed_pairs = nullptr;
#ifdef RELPOS_HAVE_BF16_TILES
      if constexpr (std::is_same_v<I, c10::BFloat16>) {
        if (w.tiles) {
          k_packed_t = amx_head_tile_transposed(w.k_head_t, hd.k, S, BK, j0, D);
          v_packed_t = amx_head_tile_transposed(w.v_head_t, hd.v, S, BK, j0, Dv);
          k_packed_pairs = amx_head_tile_pairs(w.k_head_pairs, hd.k, S, BK, j0, nk, D);
        }
      }
#endif
      if (low_gemms) {
        if constexpr (low) {
          // S_IJ (nq, nk) = scale · Q_I (nq, D) @ K_J^T; dP_IJ (nq, nk) = dO_I (nq, Dv) @ V_J^T
          gemm_scores_low(w.tiles, nullptr, nq, nk, D, scale, w.q_rows, w.q_scaled, q_block, k_tile,
                          w.scores.data(), k_packed_t);
          gemm_scores_low(w.tiles, nullptr, nq, nk, Dv, T(1), w.do_rows, false, do_block, v_tile,
                          w.dp.data(), v_packed_t);
        }
      } else {
        const auto [kw, v_wide] =
            as_wide2<T, I>(k_tile, nk * D, w.k_wide, v_tile, nk * Dv, w.v_wide);
        k_wide = kw;
        // S_IJ (nq, nk) = scale · Q_I (nq, D) @ K_J^T
        gemm_nt<T>(nq, nk, D, scale, q_wide, k_wide, T(0), w.scores.data());
        // dP_IJ (nq, nk) = dO_I (nq, Dv) @ V_J^T
        gemm_nt<T>(nq, nk, Dv, T(1), do_wide, v_wide, T(0), w.dp.data());
      }
      T* pd = drop.on ? w.p_dropped.data() : w.scores.data();  // what multiplies V
      for (int64_t r = 0; r < nq; ++r) {
        backward_row<T, I>(g, hd, attn_bias, drop, inv_keep, w, pd, lse_block[r], r, i0 + r, j0,
                           j1);
        if (w.tiles) backward_pack_rows(w, nq, nk, pd, r, r + 1);
      }
      if (w.tiles) {
        backward_tile_gradients_packed(w, nq, nk, D, Dv, scale, k_tile, dv + j0 * Dv, dk + j0 * D,
                                       k_packed_pairs);
      } else if (low_gemms) {
        if constexpr (low) {
          convert(pd, w.p_low.data(), nq * nk);
          convert(w.dp.data(), w.ds_low.data(), nq * nk);
          // dV_J (nk, Dv) += P_IJ^T @ dO_I; dq_acc_I (nq, D) += dS_IJ @ K_J;
          // dK_J (nk, D) += scale · dS_IJ^T @ Q_I
          gemm16<I>(true, false, nk, Dv, nq, T(1), w.p_low.data(), do_block, T(1), dv + j0 * Dv);
          gemm16<I>(false, false, nq, D, nk, T(1), w.ds_low.data(), k_tile, T(1),
                      w.dq_acc.data());
          gemm16<I>(true, false, nk, D, nq, scale, w.ds_low.data(), q_block, T(1), dk + j0 * D);
        }
      } else {
        // dV_J (nk, Dv) += P_IJ^T @ dO_I (nq, Dv)
        gemm_tn<T>(nk, Dv, nq, T(1), pd, do_wide, T(1), dv + j0 * Dv);
        // dq_acc_I (nq, D) += dS_IJ (nq, nk) @ K_J (nk, D)
        gemm_nn<T>(nq, D, nk, T(1), w.dp.data(), k_wide, T(1), w.dq_acc.data());
        // dK_J (nk, D) += scale · dS_IJ^T @ Q_I (nq, D)
        gemm_tn<T>(nk, D, nq, scale, w.dp.data(), q_wide, T(1), dk + j0 * D);
      }
    }
    backward_epilogue<T, I>(g, hd, w, i0, nq, scale, ak_finite, lse_block, q_wide, do_wide, gr.dak,
                            gr.dav, gr.dq + i0 * D);
  }
  if constexpr (low) {
    convert(dk, gr.dk, S * D);
    convert(dv, gr.dv, S * Dv);
  }
}

// Padded tasks: (batch, head), which own their dk, dv and table-gradient partials (B, H, R, ·).
template <typename T, typename I = T>
static void backward_impl(const Geometry& g, const Inputs<T, I>& in, const I* dout, const I* out,
                          const T* lse, T scale, const Dropout& drop, I* dq, I* dk, I* dv,
                          T* dak_part, T* dav_part, HalfGemms gemms = {}) {
  const int64_t L = g.L, S = g.S, D = g.D, Dv = g.Dv, R = g.R;
  const int64_t BQ = backward_query_block(L), BK = key_block_size(L, S);
  const TileGemm tiles = tile_gemms_of(gemms, BQ, BK, kAmxBackwardRows);

  at::parallel_for(0, g.B * g.H, 1, [&](int64_t begin, int64_t stop) {
    const SingleThreadedBlas one_thread;
    BackwardBlock<T, I> w(BQ, BQ * BK, R, D, in.ak != nullptr, in.av != nullptr, drop.on, Dv, BK, S,
                          gemms.low, tiles);
    for (int64_t bh = begin; bh < stop; ++bh) {
      T* dak = in.ak ? dak_part + bh * R * D : nullptr;
      T* dav = in.av ? dav_part + bh * R * Dv : nullptr;
      if (dak) std::fill(dak, dak + R * D, T(0));
      if (dav) std::fill(dav, dav + R * Dv, T(0));
      const HeadGradients<T, I> gr{
          dout + bh * L * Dv, out + bh * L * Dv, lse + bh * L, dq + bh * L * D,
          dk + bh * S * D,    dv + bh * S * Dv,  dak,          dav};
      backward_task<T, I>(g, head_of(g, in, drop, bh), gr, in.attn_bias, scale, in.ak_finite, drop,
                          w, BQ, BK);
    }
  });
}

// With tables, a varlen backward keeps one table-gradient partial per (group, head), a group
// being a run of consecutive sequences: at most this many groups, so that the partials stay
// O(H·R·D) (as for a padded batch of this many rows) however many sequences the call packs.
constexpr int64_t kVarlenGradientGroups = 64;

// The groups of a varlen backward, as their first sequences (n_groups + 1 entries, the last N):
// one per sequence without tables or with at most kVarlenGradientGroups sequences; otherwise
// consecutive runs of about equal work (L·S + L + S a sequence). Depends on the lengths alone,
// so the table gradients are summed in the same order at every thread count.
static std::vector<int64_t> varlen_gradient_groups(const VarlenCall& vc, bool tables) {
  const int64_t N = vc.pk.N;
  std::vector<int64_t> first;
  if (!tables || N <= kVarlenGradientGroups) {
    for (int64_t s = 0; s <= N; ++s) first.push_back(s);
    return first;
  }
  std::vector<double> work(N);
  double total = 0;
  for (int64_t s = 0; s < N; ++s) {
    const double L = static_cast<double>(vc.seqs[s].L), S = static_cast<double>(vc.seqs[s].S);
    work[s] = L * S + L + S;
    total += work[s];
  }
  first.push_back(0);
  double done = 0;
  for (int64_t s = 0; s < N; ++s) {
    // s opens the next group once the groups so far hold their share of the work
    const auto open = static_cast<int64_t>(first.size());
    if (s > 0 && open < kVarlenGradientGroups &&
        done >= total * static_cast<double>(open) / kVarlenGradientGroups)
      first.push_back(s);
    done += work[s];
  }
  first.push_back(N);
  return first;
}

// Varlen tasks: (sequence, head), which own their dk and dv rows (the spare rows of a key region
// past seqused_k included: zeroed), run by units (group, head): a unit zeroes its
// table-gradient partials (n_groups, H, R, ·) and runs the tasks of its group's sequences in
// order, each adding to them.
template <typename T, typename I = T>
static void backward_varlen_impl(const VarlenCall& vc, const std::vector<int64_t>& groups,
                                 const Inputs<T, I>& in, const I* dout, const I* out, const T* lse,
                                 T scale, const Dropout& drop, I* dq, I* dk, I* dv, T* dak_part,
                                 T* dav_part, HalfGemms gemms = {}) {
  const Packing& pk = vc.pk;
  const int64_t n_groups = static_cast<int64_t>(groups.size()) - 1, R = vc.R;
  int64_t S_max = 0;  // 16-bit inputs: the float dK and dV of the longest sequence
  if constexpr (!std::is_same_v<T, I>)
    for (const Geometry& g : vc.seqs) S_max = std::max(S_max, g.S);
  const TileGemm tiles = tile_gemms_of(gemms, vc.BQ, vc.BK, kAmxBackwardRows);

  at::parallel_for(0, n_groups * pk.H, 1, [&](int64_t begin, int64_t stop) {
    const SingleThreadedBlas one_thread;
    BackwardBlock<T, I> w(vc.BQ, vc.tile, R, vc.D, in.ak != nullptr, in.av != nullptr, drop.on,
                          vc.Dv, vc.BK, S_max, gemms.low, tiles);
    for (int64_t unit = begin; unit < stop; ++unit) {
      const int64_t group = unit / pk.H, h = unit % pk.H;
      T* dak = in.ak ? dak_part + unit * R * vc.D : nullptr;
      T* dav = in.av ? dav_part + unit * R * vc.Dv : nullptr;
      if (dak) std::fill(dak, dak + R * vc.D, T(0));
      if (dav) std::fill(dav, dav + R * vc.Dv, T(0));
      for (int64_t s = groups[group]; s < groups[group + 1]; ++s) {
        const Geometry& g = vc.seqs[s];
        const int64_t qr = pk.q_row(s, h), kr = pk.k_row(s, h);
        const HeadGradients<T, I> gr{dout + qr * g.Dv, out + qr * g.Dv, lse + qr, dq + qr * g.D,
                                     dk + kr * g.D,    dv + kr * g.Dv,  dak,      dav};
        backward_task<T, I>(g, varlen_head(g, pk, in, s, h), gr, static_cast<const T*>(nullptr),
                            scale, in.ak_finite, drop, w, backward_query_block(g.L),
                            key_block_size(g.L, g.S));
        const int64_t region = pk.region(s);  // spare capacity [S, region): never read
        std::fill(gr.dk + g.S * g.D, gr.dk + region * g.D, I(0));
        std::fill(gr.dv + g.S * g.Dv, gr.dv + region * g.Dv, I(0));
      }
    }
  });
}

}  // namespace relpos_native
