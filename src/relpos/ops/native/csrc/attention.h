// The kernels' entry points (attention.cpp), as the bindings (bindings.cpp) and the checks
// (checks.h) see them: a call's scalar options, the padded and varlen forward and backward, the
// dropout keep masks, and what the build and the engine choice say about themselves.

#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <torch/extension.h>

namespace relpos_native {

using at::Tensor;

// A call's scalar options (relpos.ops.native.op builds them once per set of values; the
// geometry derived from them and the tensors' shapes is geometry.h's Geometry).
struct AttentionOptions {
  int64_t left = 0, right = 0;  // offsets clipped to [-left, +right]; table row r + left
  bool is_causal = false;
  double scale = 1.0;       // multiplies q . k and q . aK alike
  int64_t query_start = 0;  // position of query 0 (bottom-right alignment: S - L)
  double dropout_p = 0.0;   // attention dropout; its stream is the `seed` tensor
};

// Returns out (B, H, L, Dv) and the logsumexp (B, H, L) (+inf where a row sees no key).
std::vector<Tensor> forward(const Tensor& query, const Tensor& key, const Tensor& value,
                            const c10::optional<Tensor>& rel_keys,
                            const c10::optional<Tensor>& rel_values,
                            const c10::optional<Tensor>& key_bias,
                            const c10::optional<Tensor>& attn_bias,
                            const c10::optional<Tensor>& seed, const AttentionOptions& options);

// Returns dq, dk, dv, d rel_keys, d rel_values (the last two empty for absent tables).
std::vector<Tensor> backward(const Tensor& grad_out, const Tensor& query, const Tensor& key,
                             const Tensor& value, const c10::optional<Tensor>& rel_keys,
                             const c10::optional<Tensor>& rel_values,
                             const c10::optional<Tensor>& key_bias,
                             const c10::optional<Tensor>& attn_bias,
                             const c10::optional<Tensor>& seed, const Tensor& out,
                             const Tensor& lse, const AttentionOptions& options);

// Returns the keep mask (B, H, L, S) of a padded call.
Tensor dropout_mask(const Tensor& seed, int64_t B, int64_t H, int64_t L, int64_t S,
                    double dropout_p);

// Returns out (Tq, H, Dv) and the logsumexp (H, Tq) of a varlen call.
std::vector<Tensor> forward_varlen(const Tensor& query, const Tensor& key, const Tensor& value,
                                   const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                   const c10::optional<Tensor>& seqused_k,
                                   const c10::optional<Tensor>& rel_keys,
                                   const c10::optional<Tensor>& rel_values,
                                   const c10::optional<Tensor>& seed,
                                   const AttentionOptions& options);

// Returns dq (Tq, H, D), dk (Tk, H, D), dv (Tk, H, Dv), d rel_keys, d rel_values of a varlen
// call.
std::vector<Tensor> backward_varlen(const Tensor& grad_out, const Tensor& query, const Tensor& key,
                                    const Tensor& value, const Tensor& cu_seqlens_q,
                                    const Tensor& cu_seqlens_k,
                                    const c10::optional<Tensor>& seqused_k,
                                    const c10::optional<Tensor>& rel_keys,
                                    const c10::optional<Tensor>& rel_values,
                                    const c10::optional<Tensor>& seed, const Tensor& out,
                                    const Tensor& lse, const AttentionOptions& options);

// Returns the keep masks of a varlen call with H heads, one (H, L_s, S_s) per sequence.
std::vector<Tensor> dropout_mask_varlen(const Tensor& seed, const Tensor& cu_seqlens_q,
                                        const Tensor& cu_seqlens_k,
                                        const c10::optional<Tensor>& seqused_k, int64_t H,
                                        double dropout_p);

// What a bfloat16 call made now runs its GEMMs on: "amx", "avx512bf16", "brgemm" or "widened".
std::string bf16_gemm_name();

// What a call made now runs its GEMMs on, per dtype (float32, float64, bfloat16, float16): the
// engine policy's one answer.
std::map<std::string, std::string> gemm_engines();

// How the kernels were built, e.g. "blas=mkl amx=none avx512bf16=bf16 brgemm=f32,bf16
// vectors=avx512".
std::string build_info();

}  // namespace relpos_native
