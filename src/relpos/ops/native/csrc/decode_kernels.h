// The decode step's kernels (declared in decode.h for decode.cpp): its attention, one query
// per (batch, head) over the cached keys, and its linears on packed weight panels.

#pragma once

#include "config.h"
#include "decode.h"
#include "gemm_vec.h"
#include "row_phases.h"
#include "vec.h"

#include <ATen/Parallel.h>

namespace relpos_native {

// One query per (batch, head) over S cached keys, float32: out[b, h] = softmax(scale · q ·
// k_j^T, the keys key_mask hides at -inf) @ v (a decode step's attention over keys and values
// that already hold their relative rows). q (B, H, D) and out (B, H, Dv) any strides of whole
// rows; k (B, H, S, D) and v (B, H, S, Dv) with contiguous rows (a cache's first S positions);
// key_mask (B, S) bool or null. Each head streams its keys once for the scores and its values
// once for the sum (SDPA's CPU kernel, blocking for many queries, read them at about half the
// memory's rate at one query). A head whose keys are all hidden gets zeros.
void decode_attention_f32(const float* q, const int64_t q_s[2], const float* k,
                          const int64_t k_s[3], const float* v, const int64_t v_s[3],
                          const bool* key_mask, int64_t B, int64_t H, int64_t S, int64_t D,
                          int64_t Dv, float scale, float* out, const int64_t o_s[2]) {
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(static_cast<size_t>(std::max<int64_t>(S, 1)));
    std::vector<float> acc(static_cast<size_t>(Dv));
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* qr = q + b * q_s[0] + h * q_s[1];
      const float* kh = k + b * k_s[0] + h * k_s[1];
      const float* vh = v + b * v_s[0] + h * v_s[1];
      const bool* mk = key_mask != nullptr ? key_mask + b * S : nullptr;
      float mx = ninf;
      for (int64_t j = 0; j < S; ++j) {
        const float* kr = kh + j * k_s[2];
        float dot = 0.0f;
#if defined(RELPOS_VEC_FLOAT)
        VecF::V a = VecF::set1(0.0f);
        int64_t d = 0;
        for (; d + VecF::W <= D; d += VecF::W)
          a = VecF::fmadd(VecF::load(qr + d), VecF::load(kr + d), a);
        if (d < D) {
          const auto m = VecF::tail(D - d);
          a = VecF::fmadd(VecF::load_tail(qr + d, m, VecF::set1(0.0f)),
                          VecF::load_tail(kr + d, m, VecF::set1(0.0f)), a);
        }
        dot = VecF::reduce_add(a);
#else
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
#endif
        s[j] = mk != nullptr && !mk[j] ? ninf : dot * scale;
        mx = std::max(mx, s[j]);
      }
      float* o = out + b * o_s[0] + h * o_s[1];
      if (mx == ninf) {
        std::fill(o, o + Dv, 0.0f);
        continue;
      }
      const float sum = exp_sum<float>(s.data(), S, mx);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < S; ++j) {
        const float pj = s[j];
        if (pj == 0.0f) continue;
        const float* vr = vh + j * v_s[2];
#if defined(RELPOS_VEC_FLOAT)
        const VecF::V pv = VecF::set1(pj);
        int64_t d = 0;
        for (; d + VecF::W <= Dv; d += VecF::W)
          VecF::store(acc.data() + d,
                      VecF::fmadd(pv, VecF::load(vr + d), VecF::load(acc.data() + d)));
        for (; d < Dv; ++d) acc[d] = std::fma(pj, vr[d], acc[d]);
#else
        for (int64_t d = 0; d < Dv; ++d) acc[d] = std::fma(pj, vr[d], acc[d]);
#endif
      }
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < Dv; ++d) o[d] = acc[d] * inv;
    }
  });
}

// The panel linears of a decode step (decode.cpp's pack_panels: panel t holds, for
// k = 0 .. K-1, the 16 weights w[16t .. 16t + 15, k]). acc[r, 0..15] = x[r, :] @ panel for
// the R rows of x (row stride K): each x[r, k] broadcast against the panel's row k, the
// panel read once as a stream.
template <int R>
static inline void panel_rows(const float* x, int64_t K, const float* panel, float* acc) {
#if defined(RELPOS_VEC_FLOAT)
  // the float32 GEMMs' register block: acc (R, 16) = x (R, K) @ panel (K, 16), streamed
  vec_gemm_block<R, kPanel / VecF::W, false, true>(K, x, K, 1, panel, kPanel, acc, kPanel, 1.0f,
                                                   false, VecF::tail(VecF::W));
#else
  float a[R][kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kPanel; ++c) a[r][c] += x[r * K + k] * panel[k * kPanel + c];
  for (int r = 0; r < R; ++r) std::copy(a[r], a[r] + kPanel, acc + r * kPanel);
#endif
}

// y (M, N; row stride N) = x (M, K) @ weight^T + bias (or none) from NP panels: each panel's
// outputs for 8 rows at a time, the panels split over the threads.
void panel_linear_f32(const float* x, int64_t M, int64_t K, const float* panels, int64_t NP,
                      const float* bias, int64_t N, float* y) {
  at::parallel_for(0, NP, 4, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[8 * kPanel];
    for (int64_t t = begin; t < end; ++t) {
      const float* panel = panels + t * K * kPanel;
      const int64_t c0 = t * kPanel, nc = std::min(kPanel, N - c0);
      for (int64_t r0 = 0; r0 < M; r0 += 8) {
        const int64_t rows = std::min<int64_t>(8, M - r0);
        const float* xr = x + r0 * K;
        switch (rows) {
          case 1: panel_rows<1>(xr, K, panel, acc); break;
          case 2: panel_rows<2>(xr, K, panel, acc); break;
          case 3: panel_rows<3>(xr, K, panel, acc); break;
          case 4: panel_rows<4>(xr, K, panel, acc); break;
          case 5: panel_rows<5>(xr, K, panel, acc); break;
          case 6: panel_rows<6>(xr, K, panel, acc); break;
          case 7: panel_rows<7>(xr, K, panel, acc); break;
          default: panel_rows<8>(xr, K, panel, acc); break;
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = y + (r0 + r) * N + c0;
          for (int64_t c = 0; c < nc; ++c)
            dst[c] = bias != nullptr ? acc[r * kPanel + c] + bias[c0 + c] : acc[r * kPanel + c];
        }
      }
    }
  });
}

}  // namespace relpos_native
