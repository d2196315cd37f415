// The backward's GEMM policy: BackwardGemms<accum_t, scalar_t> owns a thread's GEMM operands and
// runs the backward's GEMMs (QA = scale · Q_I aK^T, dOA = dO_I aV^T; per tile S = scale · Q_I
// K_J^T, dP = dO_I V_J^T, dV_J += P^T dO_I, dq += dS K_J, dK_J += scale · dS^T Q_I) on the engines
// gemm.h chose for the call, so that backward_task reads as the sequence of its GEMMs. As the
// forward's (forward_gemms.h): float32 and float64 on the inputs as they are; 16-bit calls
// (reduced) on widened tiles, or on 16-bit operands (P and dS rounded to scalar_t, as torch's
// flash kernel rounds them) by packed tiles or brgemm, with dK and dV accumulated in float and
// rounded once at the end.

#pragma once

#include "config.h"
#include "convert.h"
#include "forward_gemms.h"
#include "gemm.h"
#include "geometry.h"

namespace relpos_native {

// A thread's backward operands: blocks of at most BQ query rows, tiles of at most BK keys (`tile`
// scores), R table rows, head dims D and Dv, S_max keys of a head (the longest of a varlen call).
struct BackwardShape {
  int64_t BQ, tile, R, D, Dv, BK, S_max;
  bool keys, values;
};

// float32 and float64: the front on the inputs themselves.
template <typename accum_t, typename scalar_t, bool reduced = !std::is_same_v<accum_t, scalar_t>>
struct BackwardGemms {
  static_assert(std::is_same_v<accum_t, scalar_t>, "the 16-bit policy is specialized below");
  const accum_t* k_wide = nullptr;  // K_J and V_J as accum_t: the tile itself
  const accum_t* v_wide = nullptr;

  BackwardGemms(const BackwardShape&, HalfGemms, TileGemm) {}

  // Where dK and dV accumulate: the gradients themselves.
  std::pair<accum_t*, accum_t*> key_gradients(scalar_t* dk, scalar_t* dv) { return {dk, dv}; }
  void finish_key_gradients(int64_t, int64_t, int64_t, scalar_t*, scalar_t*) {}

  // Q_I and dO_I as accum_t: the blocks themselves.
  std::pair<const accum_t*, const accum_t*> begin_block(const scalar_t* q_block,
                                                        const scalar_t* do_block, int64_t, int64_t,
                                                        int64_t, accum_t) {
    return {q_block, do_block};
  }
  // QA_I (nq, R) = scale · Q_I (nq, D) @ aK^T
  void table_scores(const Head<accum_t, scalar_t>& hd, int64_t nq, int64_t R, int64_t D,
                    accum_t scale, const scalar_t*, const accum_t* q_wide, accum_t* qa) {
    gemm_nt<accum_t>(nq, R, D, scale, q_wide, hd.ak, accum_t(0), qa);
  }
  // dOA_I (nq, R) = dO_I (nq, Dv) @ aV^T
  void table_output_grads(const Head<accum_t, scalar_t>& hd, int64_t nq, int64_t R, int64_t Dv,
                          const scalar_t*, const accum_t* do_wide, accum_t* doa) {
    gemm_nt<accum_t>(nq, R, Dv, accum_t(1), do_wide, hd.av, accum_t(0), doa);
  }
  void key_tile(const Head<accum_t, scalar_t>&, int64_t, int64_t, int64_t, int64_t, int64_t,
                int64_t) {}
  // S_IJ (nq, nk) = scale · Q_I (nq, D) @ K_J^T; dP_IJ (nq, nk) = dO_I (nq, Dv) @ V_J^T
  void scores(int64_t nq, int64_t nk, int64_t D, int64_t Dv, accum_t scale, const scalar_t*,
              const scalar_t*, const accum_t* q_wide, const accum_t* do_wide,
              const scalar_t* k_tile, const scalar_t* v_tile, accum_t* s, accum_t* dp) {
    k_wide = k_tile;
    v_wide = v_tile;
    gemm_nt<accum_t>(nq, nk, D, scale, q_wide, k_wide, accum_t(0), s);
    gemm_nt<accum_t>(nq, nk, Dv, accum_t(1), do_wide, v_wide, accum_t(0), dp);
  }
  // Rows of P and dS done (packed tiles pack them here): nothing.
  bool packs_rows() const { return false; }
  void rows_done(int64_t, int64_t, const accum_t*, const accum_t*, int64_t, int64_t) {}
  // dV_J (nk, Dv) += P_IJ^T @ dO_I; dq_acc_I (nq, D) += dS_IJ @ K_J; dK_J (nk, D) += scale ·
  // dS_IJ^T @ Q_I
  void gradients(int64_t nq, int64_t nk, int64_t D, int64_t Dv, accum_t scale, const accum_t* pd,
                 const accum_t* ds, const scalar_t*, const scalar_t*, const accum_t* q_wide,
                 const accum_t* do_wide, const scalar_t*, accum_t* dv_tile, accum_t* dk_tile,
                 accum_t* dq_acc) {
    gemm_tn<accum_t>(nk, Dv, nq, accum_t(1), pd, do_wide, accum_t(1), dv_tile);
    gemm_nn<accum_t>(nq, D, nk, accum_t(1), ds, k_wide, accum_t(1), dq_acc);
    gemm_tn<accum_t>(nk, D, nq, scale, ds, q_wide, accum_t(1), dk_tile);
  }
};

// 16-bit inputs (scalar_t bfloat16 or float16, accum_t float).
template <typename scalar_t>
struct BackwardGemms<float, scalar_t, true> {
  using accum_t = float;
  std::vector<accum_t> q_wide, do_wide, dk_acc, dv_acc, k_wide_buf, v_wide_buf;
  std::vector<scalar_t> p_reduced, ds_reduced;  // with 16-bit GEMMs off the packed tiles
  const accum_t* k_wide = nullptr;              // K_J widened, for dq (widened tiles)
  bool gemms16 = false;                         // the tile GEMMs take 16-bit operands
  TileGemm tiles = kNoTiles;                    // ... on packed tiles (bfloat16, AMX or VDPBF16PS):
  AmxBuffer q_rows, do_rows, q_pairs, do_pairs;  // per query block (Q times a power-of-two
  bool q_scaled = false;                         // scale in q_rows and q_pairs: q_scaled)
  AmxOperand ak_op, av_op;  // aK, aV transposed (kept while the same rows come back)
  AmxOperand k_pairs;       // K_J as pairs where cut short
  AmxHeadTiles k_head_t, v_head_t, k_head_pairs;  // a head's K_J, V_J transposed and K_J as
                                                  // pairs, kept for its query blocks
  AmxBuffer p_t, ds_rows, ds_t;                   // P^T, dS and dS^T of the tile
  const uint16_t* k_packed_t = nullptr;      // the current tile's K_J, V_J (transposed) and K_J
  const uint16_t* v_packed_t = nullptr;      // (pairs; nullptr where the causal mask cuts the tile)
  const uint16_t* k_packed_pairs = nullptr;  // as packed operands

  BackwardGemms(const BackwardShape& sh, HalfGemms gemms, TileGemm tile_gemms) {
    q_wide.resize(sh.BQ * sh.D);
    do_wide.resize(sh.BQ * sh.Dv);
    dk_acc.resize(sh.S_max * sh.D);
    dv_acc.resize(sh.S_max * sh.Dv);
    if (gemms.low) {
      gemms16 = true;
      if (tile_gemms != kNoTiles) {
        tiles = tile_gemms;
        const int64_t kq = amx_kblocks(sh.BQ), kk = amx_kblocks(sh.BK);
        q_rows.resize(amx_tiles_of(sh.BQ) * amx_kblocks(sh.D) * kTileElems);
        do_rows.resize(amx_tiles_of(sh.BQ) * amx_kblocks(sh.Dv) * kTileElems);
        q_pairs.resize(amx_tiles_of(sh.D) * kq * kTileElems);
        do_pairs.resize(amx_tiles_of(sh.Dv) * kq * kTileElems);
        k_pairs.buf.resize(amx_tiles_of(sh.D) * kk * kTileElems);
        ak_op.buf.resize(sh.keys ? amx_tiles_of(sh.R) * amx_kblocks(sh.D) * kTileElems : 0);
        av_op.buf.resize(sh.values ? amx_tiles_of(sh.R) * amx_kblocks(sh.Dv) * kTileElems : 0);
        p_t.resize(amx_tiles_of(sh.BK) * kq * kTileElems);
        ds_rows.resize(amx_tiles_of(sh.BQ) * kk * kTileElems);
        ds_t.resize(amx_tiles_of(sh.BK) * kq * kTileElems);
      }
      if (!tiles) {
        p_reduced.resize(sh.tile);
        ds_reduced.resize(sh.tile);
      }
    } else {
      k_wide_buf.resize(sh.BK * sh.D);
      v_wide_buf.resize(sh.BK * sh.Dv);
    }
  }

  // Where dK and dV accumulate: in float, rounded once at the end (finish_key_gradients).
  std::pair<accum_t*, accum_t*> key_gradients(scalar_t*, scalar_t*) {
    return {dk_acc.data(), dv_acc.data()};
  }
  void finish_key_gradients(int64_t S, int64_t D, int64_t Dv, scalar_t* dk, scalar_t* dv) {
    convert(dk_acc.data(), dk, S * D);
    convert(dv_acc.data(), dv, S * Dv);
  }

  // Q_I and dO_I widened (for the table terms and the widened tiles' GEMMs) and, on packed
  // tiles, packed as row tiles and as pairs (Q times the scale where it is a power of two:
  // exact).
  std::pair<const accum_t*, const accum_t*> begin_block(const scalar_t* q_block,
                                                        const scalar_t* do_block, int64_t nq,
                                                        int64_t D, int64_t Dv, accum_t scale) {
    convert(q_block, q_wide.data(), nq * D);
    convert(do_block, do_wide.data(), nq * Dv);
    if (tiles) {
#ifdef RELPOS_HAVE_BF16_TILES
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        q_scaled = power_of_two(scale);
        const float q_scale = q_scaled ? scale : 1.0f;
        amx_pack_rows(bits_of(q_block), nq, D, D, q_rows.p, q_scale);
        amx_pack_pairs(bits_of(q_block), nq, D, q_pairs.p, q_scale);
        amx_pack_rows(bits_of(do_block), nq, Dv, Dv, do_rows.p);
        amx_pack_pairs(bits_of(do_block), nq, Dv, do_pairs.p);
      }
#else
      (void)scale;
#endif
    }
    return {q_wide.data(), do_wide.data()};
  }

  // QA_I (nq, R) = scale · Q_I (nq, D) @ aK^T (16-bit operands where the tables come in
  // scalar_t, as the forward computed it)
  void table_scores(const Head<accum_t, scalar_t>& hd, int64_t nq, int64_t R, int64_t D,
                    accum_t scale, const scalar_t* q_block, const accum_t* q_wide_block,
                    accum_t* qa) {
    table_scores_reduced(tiles, &ak_op, hd, nq, R, D, scale, q_rows, q_scaled, q_block,
                         q_wide_block, qa);
  }
  // dOA_I (nq, R) = dO_I (nq, Dv) @ aV^T
  void table_output_grads(const Head<accum_t, scalar_t>& hd, int64_t nq, int64_t R, int64_t Dv,
                          const scalar_t* do_block, const accum_t* do_wide_block, accum_t* doa) {
    if (hd.av_low)
      scores_reduced(tiles, &av_op, nq, R, Dv, accum_t(1), do_rows, false, do_block, hd.av_low,
                     doa);
    else
      gemm_nt<accum_t>(nq, R, Dv, accum_t(1), do_wide_block, hd.av, accum_t(0), doa);
  }

  // The head's K_J, V_J (transposed) and K_J (pairs) as packed operands, on packed tiles.
  void key_tile(const Head<accum_t, scalar_t>& hd, int64_t S, int64_t BK, int64_t j0, int64_t nk,
                int64_t D, int64_t Dv) {
    k_packed_t = v_packed_t = k_packed_pairs = nullptr;
#ifdef RELPOS_HAVE_BF16_TILES
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (tiles) {
        k_packed_t = amx_head_tile_transposed(k_head_t, hd.k, S, BK, j0, D);
        v_packed_t = amx_head_tile_transposed(v_head_t, hd.v, S, BK, j0, Dv);
        k_packed_pairs = amx_head_tile_pairs(k_head_pairs, hd.k, S, BK, j0, nk, D);
      }
    }
#else
    (void)hd, (void)S, (void)BK, (void)j0, (void)nk, (void)D, (void)Dv;
#endif
  }

  // S_IJ (nq, nk) = scale · Q_I (nq, D) @ K_J^T; dP_IJ (nq, nk) = dO_I (nq, Dv) @ V_J^T
  void scores(int64_t nq, int64_t nk, int64_t D, int64_t Dv, accum_t scale, const scalar_t* q_block,
              const scalar_t* do_block, const accum_t* q_wide_block, const accum_t* do_wide_block,
              const scalar_t* k_tile, const scalar_t* v_tile, accum_t* s, accum_t* dp) {
    if (gemms16) {
      scores_reduced(tiles, nullptr, nq, nk, D, scale, q_rows, q_scaled, q_block, k_tile, s,
                     k_packed_t);
      scores_reduced(tiles, nullptr, nq, nk, Dv, accum_t(1), do_rows, false, do_block, v_tile, dp,
                     v_packed_t);
      return;
    }
    convert(k_tile, k_wide_buf.data(), nk * D);
    convert(v_tile, v_wide_buf.data(), nk * Dv);
    k_wide = k_wide_buf.data();
    gemm_nt<accum_t>(nq, nk, D, scale, q_wide_block, k_wide, accum_t(0), s);
    gemm_nt<accum_t>(nq, nk, Dv, accum_t(1), do_wide_block, v_wide_buf.data(), accum_t(0), dp);
  }

  // Rows [r0, r1) of P (pd) and dS (ds), done, rounded to bfloat16 into their packed operands
  // while in cache: dS as rows, and where r1 ends a 32-row k-block (or the block), that k-block
  // of P^T and dS^T.
  bool packs_rows() const { return tiles != kNoTiles; }
  void rows_done(int64_t nq, int64_t nk, const accum_t* pd, const accum_t* ds, int64_t r0,
                 int64_t r1) {
#ifdef RELPOS_HAVE_BF16_TILES
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      for (int64_t r = r0; r < r1; ++r) amx_pack_row(ds + r * nk, nk, r, ds_rows.p);
      if (r1 % 32 == 0 || r1 == nq) {
        amx_pack_rows_t(pd, nq, nk, p_t.p, (r1 - 1) / 32);
        amx_pack_rows_t(ds, nq, nk, ds_t.p, (r1 - 1) / 32);
      }
    }
#else
    (void)nq, (void)nk, (void)pd, (void)ds, (void)r0, (void)r1;
#endif
  }

  // dV_J (nk, Dv) += P_IJ^T @ dO_I; dq_acc_I (nq, D) += dS_IJ @ K_J; dK_J (nk, D) += scale ·
  // dS_IJ^T @ Q_I
  void gradients(int64_t nq, int64_t nk, int64_t D, int64_t Dv, accum_t scale, const accum_t* pd,
                 const accum_t* ds, const scalar_t* q_block, const scalar_t* do_block,
                 const accum_t* q_wide_block, const accum_t* do_wide_block, const scalar_t* k_tile,
                 accum_t* dv_tile, accum_t* dk_tile, accum_t* dq_acc) {
    if (tiles) {
      gradients_packed(nq, nk, D, Dv, scale, k_tile, dv_tile, dk_tile, dq_acc);
    } else if (gemms16) {
      convert(pd, p_reduced.data(), nq * nk);
      convert(ds, ds_reduced.data(), nq * nk);
      gemm16<scalar_t>(true, false, nk, Dv, nq, accum_t(1), p_reduced.data(), do_block, accum_t(1),
                       dv_tile);
      gemm16<scalar_t>(false, false, nq, D, nk, accum_t(1), ds_reduced.data(), k_tile, accum_t(1),
                       dq_acc);
      gemm16<scalar_t>(true, false, nk, D, nq, scale, ds_reduced.data(), q_block, accum_t(1),
                       dk_tile);
    } else {
      gemm_tn<accum_t>(nk, Dv, nq, accum_t(1), pd, do_wide_block, accum_t(1), dv_tile);
      gemm_nn<accum_t>(nq, D, nk, accum_t(1), ds, k_wide, accum_t(1), dq_acc);
      gemm_tn<accum_t>(nk, D, nq, scale, ds, q_wide_block, accum_t(1), dk_tile);
    }
  }

 private:
  // The three tile gradients on packed tiles, P and dS packed by rows_done, K_J as pairs (the
  // head's cache; else packed unless held).
  void gradients_packed(int64_t nq, int64_t nk, int64_t D, int64_t Dv, accum_t scale,
                        const scalar_t* k_tile, accum_t* dv_tile, accum_t* dk_tile,
                        accum_t* dq_acc) {
#ifdef RELPOS_HAVE_BF16_TILES
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      const int64_t kq = amx_kblocks(nq);
      const uint16_t* k_packed =
          packed_into(k_packed_pairs, &k_pairs, k_tile, nk,
                      [&](uint16_t* p) { amx_pack_pairs(bits_of(k_tile), nk, D, p); });
      amx_pack_row_padding(nq, nk, ds_rows.p);
      tile_gemm_add(tiles, nk, Dv, kq, p_t.p, do_pairs.p, dv_tile);
      tile_gemm_add(tiles, nq, D, amx_kblocks(nk), ds_rows.p, k_packed, dq_acc);
      tile_gemm_add(tiles, nk, D, kq, ds_t.p, q_pairs.p, dk_tile, q_scaled ? 1.0f : scale);
      return;
    }
#else
    (void)nq, (void)nk, (void)D, (void)Dv, (void)scale, (void)k_tile, (void)dv_tile, (void)dk_tile,
        (void)dq_acc;
#endif
    TORCH_CHECK(false, "relpos native: no bfloat16 tile GEMMs in this build");
  }
};

}  // namespace relpos_native
