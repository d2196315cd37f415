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
#include "backward_gemms.h"
#include "dropout.h"
#include "gemm.h"
#include "geometry.h"
#include "row_phases.h"

#include <ATen/Parallel.h>

namespace relpos_native {

// One thread's state for the query block it works on (sizes as for ForwardBlock), and its GEMM
// operands (backward_gemms.h).
template <typename accum_t, typename scalar_t = accum_t>
struct BackwardBlock {
  std::vector<accum_t> scores;     // (tile): S of the current tile (nq, nk), then P (row stride nk)
  std::vector<accum_t> dp;         // (tile): dP = dO @ V_J^T (+ dOA), then dS
  std::vector<accum_t> p_dropped;  // (tile), with dropout only: P times the keep mask / (1 - p)
  std::vector<accum_t> qa;         // (BQ, R): QA = scale · Q_I @ aK^T
  std::vector<accum_t> doa;        // (BQ, R): dOA = dO_I @ aV^T
  std::vector<accum_t> pb;         // (BQ, R): Pb, bucket sums of the (dropped) P
  std::vector<accum_t> dsb;        // (BQ, R): dSb, bucket sums of dS
  std::vector<accum_t> dq_acc;     // (BQ, D): dS @ K + dSb @ aK, before the scale
  std::vector<accum_t> delta;      // (BQ): dO_i . out_i
  BackwardGemms<accum_t, scalar_t> gemm;

  BackwardBlock(const BackwardShape& sh, bool dropout, HalfGemms gemms = {},
                TileGemm tile_gemms = kNoTiles)
      : scores(sh.tile), dp(sh.tile), p_dropped(dropout ? sh.tile : 0),
        qa(sh.keys ? sh.BQ * sh.R : 0), doa(sh.values ? sh.BQ * sh.R : 0),
        pb(sh.values ? sh.BQ * sh.R : 0), dsb(sh.keys ? sh.BQ * sh.R : 0), dq_acc(sh.BQ * sh.D),
        delta(sh.BQ), gemm(sh, gemms, tile_gemms) {}
};

// delta_i = dO_i . out_i for the rows of a query block.
template <typename accum_t, typename scalar_t>
static RELPOS_INLINE void row_deltas(accum_t* delta, const scalar_t* do_block,
                                     const scalar_t* out_block, int64_t nq, int64_t Dv) {
  for (int64_t r = 0; r < nq; ++r) {
    accum_t acc = 0;
    for (int64_t d = 0; d < Dv; ++d)
      acc +=
          static_cast<accum_t>(do_block[r * Dv + d]) * static_cast<accum_t>(out_block[r * Dv + d]);
    delta[r] = acc;
  }
}

// dS = P (dP - delta') over a far segment, where delta' = delta - the segment's dOA constant;
// dS over dp in place. Returns the segment's sum of dS (its dSb bucket).
template <typename accum_t>
static RELPOS_INLINE accum_t far_segment_ds(const accum_t* p, accum_t* dp, int64_t n,
                                            accum_t far_delta) {
#if defined(RELPOS_VEC_FLOAT)
  if constexpr (std::is_same_v<accum_t, float>) return far_segment_ds_vec(p, dp, n, far_delta);
#endif
  accum_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const accum_t x = p[j] * (dp[j] - far_delta);
    dp[j] = x;
    sum += x;
  }
  return sum;
}

// Without dropout: dS = P (dO . (v_j + aV[r]) - delta) over a row, in place of dP. The band
// gathers its dOA term; each far segment's is a constant, folded into its delta. Returns the
// far segments' dS sums (the band's are added entry by entry in the bucket update).
template <typename accum_t>
static RELPOS_INLINE SegmentSums<accum_t> ds_row(const accum_t* s, accum_t* dp,
                                                 const RowSegments& seg, const accum_t* doa_row,
                                                 FarConstants<accum_t> doa_far, accum_t row_delta) {
  SegmentSums<accum_t> ds;
  ds.left = far_segment_ds<accum_t>(s, dp, seg.n_left, row_delta - doa_far.left);
  const accum_t* band_p = s + seg.n_left;
  accum_t* band_dp = dp + seg.n_left;
  const accum_t* doa_band = doa_row ? doa_row + seg.band_row : nullptr;
  for (int64_t x = 0; x < seg.n_band; ++x)
    band_dp[x] = band_p[x] * (band_dp[x] + (doa_band ? doa_band[x] : accum_t(0)) - row_delta);
  ds.band = accum_t(0);  // not summed
  ds.right = far_segment_ds<accum_t>(band_p + seg.n_band, band_dp + seg.n_band, seg.n_right,
                                     row_delta - doa_far.right);
  return ds;
}

// With dropout: dP += dOA (gathered in the band, constants in the far segments), then with the
// row's keep weights w (0 or 1 / (1 - p)): p_dropped = P w, and dS = P (dP w - delta) in place
// of dP (`row`: the row's dropout row). The hidden tail of p_dropped is set to 0.
template <typename accum_t>
static RELPOS_INLINE void ds_row_dropout(const accum_t* s, accum_t* dp, accum_t* p_dropped,
                                         int64_t nk, const RowSegments& seg, const accum_t* doa_row,
                                         FarConstants<accum_t> doa_far, accum_t row_delta,
                                         const Dropout& drop, int64_t row, accum_t inv_keep) {
  const int64_t nl = seg.n_left, nb = seg.n_band, nr = seg.n_right, nv = seg.n_visible;
  if (doa_row != nullptr) {
    accum_t* band_dp = dp + nl;
    for (int64_t j = 0; j < nl; ++j) dp[j] += doa_far.left;
    const accum_t* doa_band = doa_row + seg.band_row;
    for (int64_t x = 0; x < nb; ++x) band_dp[x] += doa_band[x];
    for (int64_t j = 0; j < nr; ++j) band_dp[nb + j] += doa_far.right;
  }
  uint32_t k1, k2;
  drop.row_keys(row, k1, k2);
  const uint32_t th = drop.threshold;
  const int64_t j0 = seg.j0;
#pragma omp simd
  for (int64_t j = 0; j < nv; ++j) {
    const accum_t w = Dropout::keep(static_cast<uint32_t>(drop.key_offset + j0 + j), k1, k2, th)
                          ? inv_keep
                          : accum_t(0);
    p_dropped[j] = s[j] * w;
    dp[j] = s[j] * (dp[j] * w - row_delta);  // dS
  }
  for (int64_t j = nv; j < nk; ++j) p_dropped[j] = accum_t(0);
}

// A row that the forward left NaN (lse NaN; `s` its scores with the masks applied): P and dS
// are NaN at its keys but 0 at the keys its masks hide (-inf), as the reference's masked softmax
// gives, so that the row reaches neither a hidden key's dk nor a table row it reads only
// through hidden keys.
template <typename accum_t>
static RELPOS_INLINE void nan_row(accum_t* s, accum_t* dp, int64_t n_visible) {
  const accum_t ninf = -std::numeric_limits<accum_t>::infinity();
  const accum_t nan = std::numeric_limits<accum_t>::quiet_NaN();
  for (int64_t j = 0; j < n_visible; ++j) {
    const accum_t x = s[j] == ninf ? accum_t(0) : nan;
    s[j] = x;
    dp[j] = x;
  }
}

// Row r of one tile: recompute P = exp(s - lse) (band key term, masks, far constants in the
// offsets), turn dP into dS, and add the row's bucket sums to Pb (for daV) and dSb (for dq and
// daK). Leaves P (or P dropped) and dS, both 0 where hidden, for the tile's GEMMs. A row that
// sees no key (lse = +inf) leaves zeros and no bucket sums, whatever the tables hold; a NaN
// row (lse NaN) NaN except at hidden keys (nan_row).
template <typename accum_t, typename scalar_t>
static RELPOS_INLINE void backward_row(const Geometry& g, const Head<accum_t, scalar_t>& hd,
                                       const accum_t* attn_bias, const Dropout& drop,
                                       accum_t inv_keep, BackwardBlock<accum_t, scalar_t>& w,
                                       accum_t* pd, accum_t row_lse, int64_t r, int64_t i,
                                       int64_t j0, int64_t j1) {
  const int64_t nk = j1 - j0, R = g.R;
  accum_t* s = w.scores.data() + r * nk;
  accum_t* dp = w.dp.data() + r * nk;
  accum_t* pd_row = pd + r * nk;
  if (row_lse == std::numeric_limits<accum_t>::infinity()) {
    std::fill(s, s + nk, accum_t(0));
    std::fill(dp, dp + nk, accum_t(0));
    if (drop.on) std::fill(pd_row, pd_row + nk, accum_t(0));
    return;
  }
  const RowSegments seg = g.segments(g.query_start + i, j0, j1);
  const accum_t* qa_row = hd.ak ? w.qa.data() + r * R : nullptr;
  const accum_t* doa_row = hd.av ? w.doa.data() + r * R : nullptr;
  const FarConstants<accum_t> qa_far = far_constants(qa_row, R);
  const FarConstants<accum_t> doa_far = far_constants(doa_row, R);
  add_band_key_term<accum_t>(s, seg, qa_row);
  add_masks<accum_t>(s, g, j0, seg.end, hd.key_bias, mask_row(g, attn_bias, hd.b, hd.h, i));
  const accum_t row_delta = w.delta[r];
  accum_t* pb_row = hd.av ? w.pb.data() + r * R : nullptr;
  accum_t* dsb_row = hd.ak ? w.dsb.data() + r * R : nullptr;
  if (std::isnan(row_lse)) {
    nan_row<accum_t>(s, dp, seg.n_visible);
    if (drop.on) {
      std::copy(s, s + seg.n_visible, pd_row);
      std::fill(pd_row + seg.n_visible, pd_row + nk, accum_t(0));
    }
    if (pb_row) bucket_row<accum_t>(s, R, seg, pb_row);
    if (dsb_row) bucket_row<accum_t>(dp, R, seg, dsb_row);
  } else if (!drop.on) {
    // P, segment by segment (the far constants folded into the offsets)
    exp_segments<accum_t, !std::is_same_v<accum_t, scalar_t>>(s, seg, qa_far, row_lse, pb_row,
                                                              R);  // P, Pb
    const SegmentSums<accum_t> ds_sums = ds_row<accum_t>(s, dp, seg, doa_row, doa_far, row_delta);
    if (dsb_row)
      add_to_buckets<accum_t>(dsb_row, R, seg, ds_sums.left, dp + seg.n_left, ds_sums.right);
  } else {
    exp_segments<accum_t, !std::is_same_v<accum_t, scalar_t>>(s, seg, qa_far, row_lse);
    ds_row_dropout<accum_t>(s, dp, pd_row, nk, seg, doa_row, doa_far, row_delta, drop,
                            hd.dropout_row + i, inv_keep);
    if (pb_row) bucket_row<accum_t>(pd_row, R, seg, pb_row);
    if (dsb_row) bucket_row<accum_t>(dp, R, seg, dsb_row);
  }
  // the hidden tail is 0 in both buffers
  for (int64_t j = seg.n_visible; j < nk; ++j) {
    dp[j] = accum_t(0);
    s[j] = accum_t(0);
  }
}

// Prologue of a query block: delta, QA and dOA of its rows; Pb, dSb and dq_acc zeroed. q_wide
// and do_wide: Q_I and dO_I as T; q_block and do_block as given (I).
template <typename accum_t, typename scalar_t>
static RELPOS_INLINE void backward_prologue(const Geometry& g, const Head<accum_t, scalar_t>& hd,
                                            BackwardBlock<accum_t, scalar_t>& w, int64_t nq,
                                            accum_t scale, const scalar_t* q_block,
                                            const scalar_t* do_block, const scalar_t* out_block,
                                            const accum_t* q_wide, const accum_t* do_wide) {
  const int64_t D = g.D, Dv = g.Dv, R = g.R;
  row_deltas<accum_t, scalar_t>(w.delta.data(), do_block, out_block, nq, Dv);
  if (hd.ak) {
    // QA_I (nq, R) = scale · Q_I (nq, D) @ aK^T
    w.gemm.table_scores(hd, nq, R, D, scale, q_block, q_wide, w.qa.data());
    std::fill(w.dsb.begin(), w.dsb.begin() + nq * R, accum_t(0));
  }
  if (hd.av) {
    // dOA_I (nq, R) = dO_I (nq, Dv) @ aV^T
    w.gemm.table_output_grads(hd, nq, R, Dv, do_block, do_wide, w.doa.data());
    std::fill(w.pb.begin(), w.pb.begin() + nq * R, accum_t(0));
  }
  std::fill(w.dq_acc.begin(), w.dq_acc.begin() + nq * D, accum_t(0));
}

// The relative key term of dq: dq_acc_I += dSb_I @ aK. With a non-finite aK, row by row over
// the table rows each query can read (a row's other buckets are 0, but 0 · inf is NaN, and the
// reference never multiplies them), none for a row that sees no key (lse = +inf).
template <typename accum_t, typename scalar_t>
static RELPOS_INLINE void dq_table_term(const Geometry& g, const Head<accum_t, scalar_t>& hd,
                                        BackwardBlock<accum_t, scalar_t>& w, int64_t i0, int64_t nq,
                                        const accum_t* lse_block, bool ak_finite) {
  const int64_t D = g.D, R = g.R;
  if (ak_finite) {
    // dq_acc_I (nq, D) += dSb_I (nq, R) @ aK (R, D)
    gemm_nn<accum_t>(nq, D, R, accum_t(1), w.dsb.data(), hd.ak, accum_t(1), w.dq_acc.data());
    return;
  }
  for (int64_t r = 0; r < nq; ++r) {
    if (lse_block[r] == std::numeric_limits<accum_t>::infinity()) continue;
    int64_t lo, hi;
    g.table_rows(g.query_start + i0 + r, lo, hi);
    // dq_acc_i (1, D) += dSb_i[lo..hi] (1, n) @ aK[lo..hi] (n, D)
    if (lo <= hi)
      gemm_nn<accum_t>(1, D, hi - lo + 1, accum_t(1), w.dsb.data() + r * R + lo, hd.ak + lo * D,
                       accum_t(1), w.dq_acc.data() + r * D);
  }
}

// Epilogue of a query block: its relative terms of dq, its shares of the table gradients
// (into this head's partials), and dq = scale · dq_acc (rounded to scalar_t).
template <typename accum_t, typename scalar_t>
static RELPOS_INLINE void backward_epilogue(const Geometry& g, const Head<accum_t, scalar_t>& hd,
                                            BackwardBlock<accum_t, scalar_t>& w, int64_t i0,
                                            int64_t nq, accum_t scale, bool ak_finite,
                                            const accum_t* lse_block, const accum_t* q_wide,
                                            const accum_t* do_wide, accum_t* dak_head,
                                            accum_t* dav_head, scalar_t* dq_block) {
  const int64_t D = g.D, Dv = g.Dv, R = g.R;
  if (hd.ak) {
    dq_table_term<accum_t, scalar_t>(g, hd, w, i0, nq, lse_block, ak_finite);
    // daK (R, D) += scale · dSb_I^T @ Q_I (nq, D)
    gemm_tn<accum_t>(R, D, nq, scale, w.dsb.data(), q_wide, accum_t(1), dak_head);
  }
  // daV (R, Dv) += Pb_I^T @ dO_I (nq, Dv)
  if (hd.av) gemm_tn<accum_t>(R, Dv, nq, accum_t(1), w.pb.data(), do_wide, accum_t(1), dav_head);
  for (int64_t x = 0; x < nq * D; ++x) dq_block[x] = static_cast<scalar_t>(scale * w.dq_acc[x]);
}

// What one backward task reads and writes besides its Head: its rows of dO, out and lse, its
// gradients (dk and dv rows its own, written whole by the task) and the table-gradient partials
// it adds to (zeroed by its caller).
template <typename accum_t, typename scalar_t = accum_t>
struct HeadGradients {
  const scalar_t* dout;  // (L, Dv)
  const scalar_t* out;   // (L, Dv)
  const accum_t* lse;    // (L)
  scalar_t* dq;          // (L, D)
  scalar_t* dk;          // (S, D)
  scalar_t* dv;          // (S, Dv)
  accum_t* dak;          // (R, D), or nullptr without rel_keys
  accum_t* dav;          // (R, Dv), or nullptr without rel_values
};

// One backward task: one head, its query blocks of BQ rows, and in each the key blocks of BK
// keys, as the forward did. With 16-bit inputs the five tile GEMMs take 16-bit operands (P and
// dS rounded to scalar_t, as torch's flash kernel rounds them) with float accumulation, dK and dV
// are accumulated in float and rounded once at the end; without 16-bit GEMMs K_J and V_J are
// widened per tile and the float GEMMs serve.
template <typename accum_t, typename scalar_t>
static RELPOS_INLINE void backward_task(const Geometry& g, const Head<accum_t, scalar_t>& hd,
                                        const HeadGradients<accum_t, scalar_t>& gr,
                                        const accum_t* attn_bias, accum_t scale, bool ak_finite,
                                        const Dropout& drop, BackwardBlock<accum_t, scalar_t>& w,
                                        int64_t BQ, int64_t BK) {
  const int64_t L = g.L, S = g.S, D = g.D, Dv = g.Dv;
  const accum_t inv_keep = static_cast<accum_t>(drop.inv_keep);
  const auto [dk, dv] = w.gemm.key_gradients(gr.dk, gr.dv);  // (S, D), (S, Dv): where they sum
  std::fill(dk, dk + S * D, accum_t(0));
  std::fill(dv, dv + S * Dv, accum_t(0));
  for (int64_t i0 = 0; i0 < L; i0 += BQ) {
    const int64_t i1 = std::min(L, i0 + BQ), nq = i1 - i0;
    const scalar_t* q_block = hd.q + i0 * D;
    const scalar_t* do_block = gr.dout + i0 * Dv;
    const accum_t* lse_block = gr.lse + i0;
    // Q_I and dO_I as T
    const auto [q_wide, do_wide] = w.gemm.begin_block(q_block, do_block, nq, D, Dv, scale);
    backward_prologue<accum_t, scalar_t>(g, hd, w, nq, scale, q_block, do_block, gr.out + i0 * Dv,
                                         q_wide, do_wide);
    for (int64_t j0 = 0; j0 < S; j0 += BK) {
      if (!g.block_visible(i1, j0)) break;
      const int64_t j1 = g.block_end(i1, j0, BK), nk = j1 - j0;
      const scalar_t* k_tile = hd.k + j0 * D;
      w.gemm.key_tile(hd, S, BK, j0, nk, D, Dv);
      // S_IJ (nq, nk) = scale · Q_I (nq, D) @ K_J^T; dP_IJ (nq, nk) = dO_I (nq, Dv) @ V_J^T
      w.gemm.scores(nq, nk, D, Dv, scale, q_block, do_block, q_wide, do_wide, k_tile,
                    hd.v + j0 * Dv, w.scores.data(), w.dp.data());
      accum_t* pd = drop.on ? w.p_dropped.data() : w.scores.data();  // what multiplies V
      const bool pack_rows = w.gemm.packs_rows();
      for (int64_t r = 0; r < nq; ++r) {
        backward_row<accum_t, scalar_t>(g, hd, attn_bias, drop, inv_keep, w, pd, lse_block[r], r,
                                        i0 + r, j0, j1);
        if (pack_rows) w.gemm.rows_done(nq, nk, pd, w.dp.data(), r, r + 1);
      }
      // dV_J (nk, Dv) += P_IJ^T @ dO_I; dq_acc_I (nq, D) += dS_IJ @ K_J;
      // dK_J (nk, D) += scale · dS_IJ^T @ Q_I
      w.gemm.gradients(nq, nk, D, Dv, scale, pd, w.dp.data(), q_block, do_block, q_wide, do_wide,
                       k_tile, dv + j0 * Dv, dk + j0 * D, w.dq_acc.data());
    }
    backward_epilogue<accum_t, scalar_t>(g, hd, w, i0, nq, scale, ak_finite, lse_block, q_wide,
                                         do_wide, gr.dak, gr.dav, gr.dq + i0 * D);
  }
  w.gemm.finish_key_gradients(S, D, Dv, gr.dk, gr.dv);
}

// Padded tasks: (batch, head), which own their dk, dv and table-gradient partials (B, H, R, ·).
template <typename accum_t, typename scalar_t = accum_t>
static void backward_impl(const Geometry& g, const Inputs<accum_t, scalar_t>& in,
                          const scalar_t* dout, const scalar_t* out, const accum_t* lse,
                          accum_t scale, const Dropout& drop, scalar_t* dq, scalar_t* dk,
                          scalar_t* dv, accum_t* dak_part, accum_t* dav_part,
                          HalfGemms gemms = {}) {
  const int64_t L = g.L, S = g.S, D = g.D, Dv = g.Dv, R = g.R;
  const int64_t BQ = backward_query_block(L), BK = key_block_size(L, S);
  const TileGemm tiles = tile_gemms_of(gemms, BQ, BK, kAmxBackwardRows);

  at::parallel_for(0, g.B * g.H, 1, [&](int64_t begin, int64_t stop) {
    const SingleThreadedBlas one_thread;
    BackwardBlock<accum_t, scalar_t> w(
        {BQ, BQ * BK, R, D, Dv, BK, S, in.ak != nullptr, in.av != nullptr}, drop.on, gemms, tiles);
    for (int64_t bh = begin; bh < stop; ++bh) {
      accum_t* dak = in.ak ? dak_part + bh * R * D : nullptr;
      accum_t* dav = in.av ? dav_part + bh * R * Dv : nullptr;
      if (dak) std::fill(dak, dak + R * D, accum_t(0));
      if (dav) std::fill(dav, dav + R * Dv, accum_t(0));
      const HeadGradients<accum_t, scalar_t> gr{
          dout + bh * L * Dv, out + bh * L * Dv, lse + bh * L, dq + bh * L * D,
          dk + bh * S * D,    dv + bh * S * Dv,  dak,          dav};
      backward_task<accum_t, scalar_t>(g, head_of(g, in, drop, bh), gr, in.attn_bias, scale,
                                       in.ak_finite, drop, w, BQ, BK);
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
template <typename accum_t, typename scalar_t = accum_t>
static void backward_varlen_impl(const VarlenCall& vc, const std::vector<int64_t>& groups,
                                 const Inputs<accum_t, scalar_t>& in, const scalar_t* dout,
                                 const scalar_t* out, const accum_t* lse, accum_t scale,
                                 const Dropout& drop, scalar_t* dq, scalar_t* dk, scalar_t* dv,
                                 accum_t* dak_part, accum_t* dav_part, HalfGemms gemms = {}) {
  const Packing& pk = vc.pk;
  const int64_t n_groups = static_cast<int64_t>(groups.size()) - 1, R = vc.R;
  int64_t S_max = 0;  // 16-bit inputs: the float dK and dV of the longest sequence
  if constexpr (!std::is_same_v<accum_t, scalar_t>)
    for (const Geometry& g : vc.seqs) S_max = std::max(S_max, g.S);
  const TileGemm tiles = tile_gemms_of(gemms, vc.BQ, vc.BK, kAmxBackwardRows);

  at::parallel_for(0, n_groups * pk.H, 1, [&](int64_t begin, int64_t stop) {
    const SingleThreadedBlas one_thread;
    BackwardBlock<accum_t, scalar_t> w(
        {vc.BQ, vc.tile, R, vc.D, vc.Dv, vc.BK, S_max, in.ak != nullptr, in.av != nullptr}, drop.on,
        gemms, tiles);
    for (int64_t unit = begin; unit < stop; ++unit) {
      const int64_t group = unit / pk.H, h = unit % pk.H;
      accum_t* dak = in.ak ? dak_part + unit * R * vc.D : nullptr;
      accum_t* dav = in.av ? dav_part + unit * R * vc.Dv : nullptr;
      if (dak) std::fill(dak, dak + R * vc.D, accum_t(0));
      if (dav) std::fill(dav, dav + R * vc.Dv, accum_t(0));
      for (int64_t s = groups[group]; s < groups[group + 1]; ++s) {
        const Geometry& g = vc.seqs[s];
        const int64_t qr = pk.q_row(s, h), kr = pk.k_row(s, h);
        const HeadGradients<accum_t, scalar_t> gr{
            dout + qr * g.Dv, out + qr * g.Dv, lse + qr, dq + qr * g.D,
            dk + kr * g.D,    dv + kr * g.Dv,  dak,      dav};
        backward_task<accum_t, scalar_t>(
            g, varlen_head(g, pk, in, s, h), gr, static_cast<const accum_t*>(nullptr), scale,
            in.ak_finite, drop, w, backward_query_block(g.L), key_block_size(g.L, g.S));
        const int64_t region = pk.region(s);  // spare capacity [S, region): never read
        std::fill(gr.dk + g.S * g.D, gr.dk + region * g.D, scalar_t(0));
        std::fill(gr.dv + g.S * g.Dv, gr.dv + region * g.Dv, scalar_t(0));
      }
    }
  });
}

}  // namespace relpos_native
