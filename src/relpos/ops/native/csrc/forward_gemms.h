// The forward's GEMM policy: ForwardGemms<accum_t, scalar_t> owns a thread's GEMM operands and
// runs the forward's four GEMMs (QA = scale · Q_I aK^T, S = scale · Q_I K_J^T, acc += P V_J,
// acc += Pb aV) on the engines gemm.h chose for the call, so that forward_task reads as the
// sequence of its GEMMs. scalar_t is the inputs' type, accum_t the type the kernels compute in:
// float32 and float64 calls (scalar_t == accum_t) call the GEMM front on the inputs as they
// are; 16-bit calls (reduced: scalar_t bfloat16 or float16, accum_t float) widen their tiles to
// float for the front, or run 16-bit GEMMs on packed tiles (AMX, VDPBF16PS) or brgemm, with P
// and Pb rounded to scalar_t.

#pragma once

#include "config.h"
#include "convert.h"
#include "gemm.h"
#include "geometry.h"

namespace relpos_native {

// The 16-bit GEMMs both directions share.
#ifdef RELPOS_HAVE_BF16_TILES
// B's packed operand: `packed` where the caller has one, else op's, packed there by pack(op's
// buffer) unless op holds B already.
template <typename Pack>
static inline const uint16_t* packed_into(const uint16_t* packed, AmxOperand* op, const void* b,
                                          int64_t n, Pack pack) {
  if (packed != nullptr) return packed;
  if (!op->holds(b, n)) {
    pack(op->buf.p);
    op->mark(b, n);
  }
  return op->buf.p;
}
#endif

// out (nq, n) = scale · A (nq, K) @ B^T for rows A and B (n, K) in scalar_t (Q_I against K_J
// or aK), 16-bit operands: on packed tiles, A packed as rows in a_rows (the scale already in
// it where a_scaled) and B packed into op unless it holds B already (or b_packed: packed
// already, op null); else brgemm on a_reduced and b.
template <typename scalar_t>
static inline void scores_reduced(TileGemm tiles, AmxOperand* op, int64_t nq, int64_t n, int64_t K,
                                  float scale, const AmxBuffer& a_rows, bool a_scaled,
                                  const scalar_t* a_reduced, const scalar_t* b, float* out,
                                  const uint16_t* b_packed = nullptr) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (tiles) {
      const auto pack = [&](uint16_t* p) { amx_pack_transposed(bits_of(b), n, K, p); };
      tile_gemm_scaled(tiles, nq, n, amx_kblocks(K), a_scaled ? 1.0f : scale, a_rows.p,
                       packed_into(b_packed, op, b, n, pack), out);
      return;
    }
  }
#else
  (void)op, (void)a_rows, (void)a_scaled, (void)b_packed;
#endif
  gemm16<scalar_t>(false, true, nq, n, K, scale, a_reduced, b, float(0), out);
}

// acc (nq, Dv) += A (nq, n) @ B (n, Dv), A float (P or Pb, row stride n) rounded to scalar_t
// (into a_pack for the packed tiles, a_reduced for brgemm), B in scalar_t (V_J or aV; packed
// into op unless it holds B already). Packed tiles with a_rows: A is there already, in
// bfloat16 rows of stride lda (zeros past n; a_pack null); with b_packed, B too (op null).
template <typename scalar_t>
static inline void values_reduced(TileGemm tiles, AmxOperand* op, int64_t nq, int64_t n, int64_t Dv,
                                  const float* a, AmxBuffer* a_pack, scalar_t* a_reduced,
                                  const scalar_t* b, float* acc, const uint16_t* a_rows = nullptr,
                                  int64_t lda = 0, const uint16_t* b_packed = nullptr) {
#ifdef RELPOS_HAVE_BF16_TILES
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (tiles) {
      b_packed = packed_into(b_packed, op, b, n,
                             [&](uint16_t* p) { amx_pack_pairs(bits_of(b), n, Dv, p); });
      if (a_rows != nullptr) {
        tile_gemm_add(tiles, nq, Dv, amx_kblocks(n), a_rows, b_packed, acc, 1.0f, lda);
      } else {
        amx_pack_rows(a, nq, n, n, a_pack->p);
        tile_gemm_add(tiles, nq, Dv, amx_kblocks(n), a_pack->p, b_packed, acc);
      }
      return;
    }
  }
#else
  (void)op, (void)a_pack, (void)a_rows, (void)lda, (void)b_packed;
#endif
  convert(a, a_reduced, nq * n);
  gemm16<scalar_t>(false, false, nq, Dv, n, float(1), a_reduced, b, float(1), acc);
}

// QA_I (nq, R) = scale · Q_I (nq, D) @ aK^T in a 16-bit call: on 16-bit operands where the
// tables come in scalar_t (Q_I as the tiles' rows in q_rows where on packed tiles), else on Q_I
// widened (q_wide).
template <typename scalar_t>
static inline void table_scores_reduced(TileGemm tiles, AmxOperand* ak_op,
                                        const Head<float, scalar_t>& hd, int64_t nq, int64_t R,
                                        int64_t D, float scale, const AmxBuffer& q_rows,
                                        bool q_scaled, const scalar_t* q_block, const float* q_wide,
                                        float* qa) {
  if (hd.ak_low)
    scores_reduced(tiles, ak_op, nq, R, D, scale, q_rows, q_scaled, q_block, hd.ak_low, qa);
  else
    gemm_nt<float>(nq, R, D, scale, q_wide, hd.ak, 0.0f, qa);
}

// A thread's forward operands for blocks of at most BQ query rows, tiles of at most BK keys
// (`tile` = BQ · BK scores, a varlen call's largest), R table rows, head dims D and Dv.
struct ForwardShape {
  int64_t BQ, tile, R, D, Dv, BK;
  bool keys, values;
};

// float32 and float64: the front on the inputs themselves.
template <typename accum_t, typename scalar_t, bool reduced = !std::is_same_v<accum_t, scalar_t>>
struct ForwardGemms {
  static_assert(std::is_same_v<accum_t, scalar_t>, "the 16-bit policy is specialized below");
  int64_t p_ld = 0;

  ForwardGemms(const ForwardShape&, HalfGemms, TileGemm) {}

  // Q_I as accum_t: the block itself.
  const accum_t* begin_block(const Head<accum_t, scalar_t>&, const scalar_t* q_block, int64_t,
                             int64_t, accum_t) {
    return q_block;
  }
  // QA_I (nq, R) = scale · Q_I (nq, D) @ aK^T
  void table_scores(const Head<accum_t, scalar_t>& hd, int64_t nq, int64_t R, int64_t D,
                    accum_t scale, const scalar_t*, const accum_t* q_wide, accum_t* qa) {
    gemm_nt<accum_t>(nq, R, D, scale, q_wide, hd.ak, accum_t(0), qa);
  }
  void key_tile(const Head<accum_t, scalar_t>&, int64_t, int64_t, int64_t, int64_t, int64_t,
                int64_t) {}
  // S_IJ (nq, nk) = scale · Q_I (nq, D) @ K_J^T
  void scores(int64_t nq, int64_t nk, int64_t D, accum_t scale, const scalar_t* q_block,
              const accum_t*, const scalar_t* k_tile, accum_t* s) {
    gemm_nt<accum_t>(nq, nk, D, scale, q_block, k_tile, accum_t(0), s);
  }
  // The softmax's P rows in bfloat16 for packed tiles: none here.
  uint16_t* p_row(int64_t) { return nullptr; }
  void dropped_row(const accum_t*, int64_t, uint16_t*) {}
  // acc_I (nq, Dv) += P_IJ (nq, nk) @ V_J (nk, Dv)
  void values(int64_t nq, int64_t nk, int64_t Dv, const accum_t* p, const scalar_t* v_tile,
              accum_t* acc) {
    gemm_nn<accum_t>(nq, Dv, nk, accum_t(1), p, v_tile, accum_t(1), acc);
  }
  // acc_I (nq, Dv) += Pb_I (nq, R) @ aV (R, Dv)
  void table_values(const Head<accum_t, scalar_t>& hd, int64_t nq, int64_t R, int64_t Dv,
                    const accum_t* pb, accum_t* acc) {
    gemm_nn<accum_t>(nq, Dv, R, accum_t(1), pb, hd.av, accum_t(1), acc);
  }
};

// 16-bit inputs (scalar_t bfloat16 or float16, accum_t float).
template <typename scalar_t>
struct ForwardGemms<float, scalar_t, true> {
  using accum_t = float;
  // Q_I widened (BQ, D); without 16-bit GEMMs, K_J (BK, D) and V_J (BK, Dv) widened
  std::vector<accum_t> q_wide, k_wide, v_wide;
  std::vector<scalar_t> p_reduced, pb_reduced;  // P and Pb rounded for the 16-bit GEMMs
  bool gemms16 = false;                         // the tile GEMMs take 16-bit operands
  TileGemm tiles = kNoTiles;                    // ... on packed tiles (bfloat16, AMX or VDPBF16PS):
  AmxBuffer q_pack, pb_pack;  // Q_I (rows; times a power-of-two scale: q_scaled), Pb as it is
  bool q_scaled = false;      // rounded
  AmxBuffer p_rows;  // P in bfloat16, row-major (row stride p_ld), the P @ V GEMM's A as it is
  int64_t p_ld = 0;  // (the tile GEMMs read it with that stride): zeros past each row's keys
  AmxOperand v_op, ak_op, av_op;       // V_J cut short and aV (pairs), aK (transposed)
  AmxHeadTiles k_head, v_head;         // a head's K_J (transposed) and V_J (pairs), kept
  const uint16_t* k_packed = nullptr;  // the current tile's K_J and V_J as packed operands (V_J
  const uint16_t* v_packed = nullptr;  // cut by the causal mask: nullptr, packed alone)

  ForwardGemms(const ForwardShape& sh, HalfGemms gemms, TileGemm tile_gemms) {
    q_wide.resize(sh.BQ * sh.D);
    if (gemms.low) {
      gemms16 = true;
      pb_reduced.resize(sh.values ? sh.BQ * sh.R : 0);
      if (tile_gemms != kNoTiles) {
        tiles = tile_gemms;
        q_pack.resize(amx_tiles_of(sh.BQ) * amx_kblocks(sh.D) * kTileElems);
        p_ld = amx_kblocks(sh.BK) * 32;
        p_rows.resize(amx_tiles_of(sh.BQ) * 16 * p_ld);
        pb_pack.resize(sh.values ? amx_tiles_of(sh.BQ) * amx_kblocks(sh.R) * kTileElems : 0);
        v_op.buf.resize(amx_tiles_of(sh.Dv) * amx_kblocks(sh.BK) * kTileElems);
        ak_op.buf.resize(sh.keys ? amx_tiles_of(sh.R) * amx_kblocks(sh.D) * kTileElems : 0);
        av_op.buf.resize(sh.values ? amx_tiles_of(sh.Dv) * amx_kblocks(sh.R) * kTileElems : 0);
      } else {
        p_reduced.resize(sh.tile);
      }
    } else {
      k_wide.resize(sh.BK * sh.D);
      v_wide.resize(sh.BK * sh.Dv);
    }
  }

  // Q_I's operands for the block: widened (returned: for QA where the tables are float, and the
  // score GEMM without 16-bit GEMMs; else nullptr) and, on packed tiles, packed, times the scale
  // where it is a power of two (1/8 for D = 64: exact, and the score tiles are then stored
  // straight from the tile registers, with no pass to scale them).
  const accum_t* begin_block(const Head<accum_t, scalar_t>& hd, const scalar_t* q_block, int64_t nq,
                             int64_t D, accum_t scale) {
    const accum_t* wide = nullptr;
    if (!gemms16 || (hd.ak != nullptr && hd.ak_low == nullptr)) {
      convert(q_block, q_wide.data(), nq * D);
      wide = q_wide.data();
    }
#ifdef RELPOS_HAVE_BF16_TILES
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (gemms16 && tiles) {
        q_scaled = power_of_two(scale);
        amx_pack_rows(bits_of(q_block), nq, D, D, q_pack.p, q_scaled ? scale : 1.0f);
      }
    }
#endif
    return wide;
  }

  // QA_I (nq, R) = scale · Q_I (nq, D) @ aK^T: 16-bit operands where the tables come in
  // scalar_t, else on Q_I widened.
  void table_scores(const Head<accum_t, scalar_t>& hd, int64_t nq, int64_t R, int64_t D,
                    accum_t scale, const scalar_t* q_block, const accum_t* q_wide_block,
                    accum_t* qa) {
    table_scores_reduced(tiles, &ak_op, hd, nq, R, D, scale, q_pack, q_scaled, q_block,
                         q_wide_block, qa);
  }

  // The head's K_J and V_J as packed operands, on packed tiles.
  void key_tile(const Head<accum_t, scalar_t>& hd, int64_t S, int64_t BK, int64_t j0, int64_t nk,
                int64_t D, int64_t Dv) {
    k_packed = v_packed = nullptr;
#ifdef RELPOS_HAVE_BF16_TILES
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (tiles) {
        k_packed = amx_head_tile_transposed(k_head, hd.k, S, BK, j0, D);
        v_packed = amx_head_tile_pairs(v_head, hd.v, S, BK, j0, nk, Dv);
      }
    }
#else
    (void)hd, (void)S, (void)BK, (void)j0, (void)nk, (void)D, (void)Dv;
#endif
  }

  // S_IJ (nq, nk) = scale · Q_I (nq, D) @ K_J^T
  void scores(int64_t nq, int64_t nk, int64_t D, accum_t scale, const scalar_t* q_block,
              const accum_t* q_wide_block, const scalar_t* k_tile, accum_t* s) {
    if (gemms16) {
      scores_reduced(tiles, nullptr, nq, nk, D, scale, q_pack, q_scaled, q_block, k_tile, s,
                     k_packed);
    } else {
      convert(k_tile, k_wide.data(), nk * D);
      gemm_nt<accum_t>(nq, nk, D, scale, q_wide_block, k_wide.data(), accum_t(0), s);
    }
  }

  // Row r of P in bfloat16, the P @ V GEMM's operand on packed tiles (the softmax writes it), or
  // nullptr.
  uint16_t* p_row(int64_t r) { return tiles ? p_rows.p + r * p_ld : nullptr; }

  // A row of P after dropout (s, nk entries), rounded into its bfloat16 row.
  void dropped_row(const accum_t* s, int64_t nk, uint16_t* row) {
#ifdef RELPOS_HAVE_BF16_TILES
    if (row != nullptr) {
      round_to_bf16(s, nk, row);
      std::fill(row + nk, row + p_ld, uint16_t(0));
    }
#else
    (void)s, (void)nk, (void)row;
#endif
  }

  // acc_I (nq, Dv) += P_IJ (nq, nk) @ V_J (nk, Dv)
  void values(int64_t nq, int64_t nk, int64_t Dv, accum_t* p, const scalar_t* v_tile,
              accum_t* acc) {
    if (gemms16) {
      values_reduced(tiles, &v_op, nq, nk, Dv, p, nullptr, p_reduced.data(), v_tile, acc, p_rows.p,
                     p_ld, v_packed);
    } else {
      convert(v_tile, v_wide.data(), nk * Dv);
      gemm_nn<accum_t>(nq, Dv, nk, accum_t(1), p, v_wide.data(), accum_t(1), acc);
    }
  }

  // acc_I (nq, Dv) += Pb_I (nq, R) @ aV (R, Dv) (Pb rounded to scalar_t where aV comes in it)
  void table_values(const Head<accum_t, scalar_t>& hd, int64_t nq, int64_t R, int64_t Dv,
                    accum_t* pb, accum_t* acc) {
    if (hd.av_low)
      values_reduced(tiles, &av_op, nq, R, Dv, pb, &pb_pack, pb_reduced.data(), hd.av_low, acc);
    else
      gemm_nn<accum_t>(nq, Dv, R, accum_t(1), pb, hd.av, accum_t(1), acc);
  }
};

}  // namespace relpos_native
