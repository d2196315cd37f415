// What decode.cpp (its own translation unit: the decode kernels' tensor entry points) takes from
// the kernels' (attention.cpp: decode_kernels.h), and what the bindings take from it: one
// declaration of each.

#pragma once

#include <cstdint>

#include <torch/extension.h>

namespace relpos_native {

// The outputs of one weight panel (decode.cpp's pack_panels: panel t holds, for k = 0 ..
// K-1, the 16 weights w[16t .. 16t + 15, k], zeros past N).
constexpr int64_t kPanel = 16;

// A decode step's attention, float32: one query per (batch, head) over S cached keys
// (decode_kernels.h says how).
void decode_attention_f32(const float* q, const int64_t q_s[2], const float* k,
                          const int64_t k_s[3], const float* v, const int64_t v_s[3],
                          const bool* key_mask, int64_t B, int64_t H, int64_t S, int64_t D,
                          int64_t Dv, float scale, float* out, const int64_t o_s[2]);

// y (M, N) = x (M, K) @ weight^T + bias (or none) from the NP panels of weight.
void panel_linear_f32(const float* x, int64_t M, int64_t K, const float* panels, int64_t NP,
                      const float* bias, int64_t N, float* y);

}  // namespace relpos_native

namespace relpos_decode {

void bind(pybind11::module& m);  // decode.cpp: decode_attention, pack_panels, panel_linear

}  // namespace relpos_decode
