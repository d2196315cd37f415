// relpos native CPU kernels: flash attention with Toeplitz buckets (docs/design.md §6).
//
// Exact clipped relative attention (Shaw et al., 2018), forward and backward, in one pass over
// the scores per direction, with O(L·R) extra state per head (R = left + right + 1 table rows),
// never O(L·S):
//
//   QA = scale * q @ aK^T                                   (L, R)
//   tile (query block I, key block J):
//     s_ij = scale * q_i . k_j + QA[i, r_ij] + bias_j       far keys add QA[i, 0] or QA[i, R-1]
//     online softmax (m_i, l_i), acc_i += p_ij v_j, Pb[i, r_ij] += p_ij
//   out_i = (acc_i + Pb_i @ aV) / l_i,  lse_i = m_i + log l_i
//
// Backward, with delta_i = dO_i . out_i and dOA = dO @ aV^T:
//   p_ij = exp(s_ij - lse_i), dp_ij = dO_i . v_j + dOA[i, r_ij], ds_ij = p_ij (dp_ij - delta_i)
//   dq = scale (dS @ K + dSb @ aK), dk = scale dS^T @ Q, dv = P^T @ dO,
//   daK = scale dSb^T @ q, daV = Pb^T @ dO         (dSb, Pb: per-row bucket sums of dS and P)
//
// Row i at position p = query_start + i splits each key block into three segments:
//   far-left  j <= p - left                 table row 0
//   band      p - left < j < p + right      table row j - p + left
//   far-right j >= p + right (and past the band)   table row R - 1
// Only the band gathers; the far segments add one constant per row.
//
// Attention dropout uses a counter-based hash of (seed, dropout row, key), so the backward
// regenerates the forward's mask and `dropout_mask` / `dropout_mask_varlen` expose it.
//
// Two layouts share the work of one head of one sequence (a task, given its Geometry: L, S,
// query_start, and its pointers): padded batches (B, H, L, D), whose tasks are (batch, head,
// query block) forward and (batch, head) backward; and packed variable-length batches
// ("varlen", flash-attention's layout): q (Tq, H, D), k and v (Tk, H, ·), sequence s the query
// rows [cu_q[s], cu_q[s+1]) and key rows [cu_k[s], cu_k[s+1]), each aligned bottom-right
// (query_start = S_s - L_s); with seqused_k (flash-attention's: a KV cache with spare capacity)
// sequence s uses only the first S_s = seqused_k[s] rows of its key region, the rest is never
// read and gets a zero gradient. Varlen tasks are (sequence, head, query block) forward and
// (sequence, head) backward, with each sequence's own block sizes; no work crosses sequences.
//
// Table gradients: one partial per (batch, head) task, reduced afterwards in a fixed order:
// deterministic whatever the thread count. dk and dv are owned by their (batch, head) task.
// Varlen: one partial per (group of consecutive sequences, head), the groups fixed by the
// sequence lengths alone (varlen_gradient_groups), so the same order at every thread count.
//
// GEMMs (gemm.h decides, once per call): float32 on the kernels' own AVX-512 vectors where the
// build has them, else on libtorch's brgemm; float64 on MKL's dgemm_ as exported by libtorch
// (RELPOS_HAVE_BLAS; MKL runs on the task's thread, as in torch's own flash kernel, also for a
// lone task that at::parallel_for runs inline: SingleThreadedBlas), or libtorch's own matrix
// multiply (at::cpu::addmm_out) where it exports none; 16-bit calls on packed tiles, brgemm or
// widened tiles.
//
// The entry points release the GIL: nothing below them touches a Python object.
//
// The files: this one is the kernels' translation unit. It includes the headers bottom up, each
// once, so the compiler sees every phase, task and loop of the kernels together and inlines
// them as in one file; it holds the entry points (the checked tensors, the dtype dispatch,
// padded and varlen), gemm_engines and build_info. bindings.cpp binds them for Python (the module's
// second translation unit); decode.cpp (the third) reaches the decode kernels through
// decode.h. docs/design.md §6 has the map.
//
//   attention.h       AttentionOptions and the entry points, as bindings.cpp sees them
//   config.h          standard headers, intrinsics, RELPOS_INLINE, the instruction-set flags
//   blocks.h          block sizes
//   gemm.h            the GEMM front and the engine choice, over the engines:
//     gemm_blas.h       the BLAS's sgemm_/dgemm_, libtorch's matrix multiply
//     gemm_brgemm.h     libtorch's brgemm (oneDNN's micro-kernels), float32 and bfloat16
//     vec.h             exp, the float vectors and their row passes, bfloat16 rounding of P
//     gemm_tiles.h      bfloat16 GEMMs on packed tiles (AMX, VDPBF16PS)
//     gemm_vec.h        float32 GEMMs on the kernels' vectors
//   convert.h         conversions between floating types
//   dropout.h         the counter-based dropout hash
//   geometry.h        a call's geometry, inputs, heads and varlen packing
//   row_phases.h      row primitives and the row phases both directions share
//   forward.h         the forward's phases, task and task loops
//   backward.h        the backward's phases, task and task loops
//   checks.h          from tensors to Geometry, Inputs and VarlenCall, checked
//   decode.h          what decode.cpp takes from here
//   decode_kernels.h  the decode step's attention and panel linears
//
// Each phase is one function, forced inline into the task that calls it, and each task into its
// loops, so the compiled loops are those of a single loop body.

#include "attention.h"  // first: its declarations are the definitions' below

#include "config.h"
#include "blocks.h"
#include "gemm.h"
#include "convert.h"
#include "dropout.h"
#include "geometry.h"
#include "row_phases.h"
#include "forward.h"
#include "backward.h"
#include "checks.h"
#include "decode.h"
#include "decode_kernels.h"

namespace relpos_native {

// Sums the partials (n, H, R, width) of a table gradient (one per padded (batch, head) task, or
// per varlen (group, head) unit) into (Hr, R, width), in a fixed order.
template <typename T>
static Tensor reduce_table_gradient(const Tensor& part, int64_t Hr) {
  const int64_t n_outer = part.size(0), H = part.size(1), n = part.size(2) * part.size(3);
  auto res = at::zeros({Hr, part.size(2), part.size(3)}, part.options());
  const T* src = part.data_ptr<T>();
  T* dst = res.data_ptr<T>();
  for (int64_t b = 0; b < n_outer; ++b)
    for (int64_t h = 0; h < H; ++h) {
      T* d = dst + (Hr == 1 ? 0 : h) * n;
      const T* s = src + (b * H + h) * n;
      for (int64_t x = 0; x < n; ++x) d[x] += s[x];
    }
  return res;
}

// Returns out (B, H, L, Dv) and the logsumexp (B, H, L) (+inf where a row sees no key).
std::vector<Tensor> forward(const Tensor& query, const Tensor& key, const Tensor& value,
                            const c10::optional<Tensor>& rel_keys,
                            const c10::optional<Tensor>& rel_values,
                            const c10::optional<Tensor>& key_bias,
                            const c10::optional<Tensor>& attn_bias,
                            const c10::optional<Tensor>& seed, const AttentionOptions& options) {
  choose_float_engine();
  auto q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  auto ak = contig(rel_keys), av = contig(rel_values), kb = contig(key_bias);
  check_same_type(q, k, v);
  const Geometry g = geometry(q, k, v, ak, av, attn_bias, options);
  auto out = at::empty({g.B, g.H, g.L, g.Dv}, q.options());
  auto lse = at::empty({g.B, g.H, g.L}, q.options().dtype(compute_type(q.scalar_type())));
  const Dropout drop(options.dropout_p, seed);
  if (is_half_precision(q.scalar_type())) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "relpos_native_forward_half", [&] {
      std::pair<c10::optional<Tensor>, c10::optional<Tensor>> low_tables;
      const auto [gemms, in] = reduced_call<scalar_t>(forward_query_block(g.L, g.B * g.H), q, k, v,
                                                      ak, av, kb, attn_bias, low_tables);
      forward_impl<float, scalar_t>(g, in, static_cast<float>(options.scale), drop,
                                    out.data_ptr<scalar_t>(), lse.data_ptr<float>(), gemms);
    });
    return {out, lse};
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_native_forward", [&] {
    const auto in = inputs<scalar_t>(q, k, v, ak, av, kb, attn_bias);
    forward_impl<scalar_t>(g, in, static_cast<scalar_t>(options.scale), drop,
                           out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
  });
  return {out, lse};
}

// Returns dq, dk, dv, d rel_keys, d rel_values (the last two empty for absent tables).
std::vector<Tensor> backward(const Tensor& grad_out, const Tensor& query, const Tensor& key,
                             const Tensor& value, const c10::optional<Tensor>& rel_keys,
                             const c10::optional<Tensor>& rel_values,
                             const c10::optional<Tensor>& key_bias,
                             const c10::optional<Tensor>& attn_bias,
                             const c10::optional<Tensor>& seed, const Tensor& out,
                             const Tensor& lse, const AttentionOptions& options) {
  choose_float_engine();
  auto q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  auto go = grad_out.contiguous(), o = out.contiguous(), ls = lse.contiguous();
  auto ak = contig(rel_keys), av = contig(rel_values), kb = contig(key_bias);
  check_same_type(q, k, v);
  check_backward_types(q, go, o, ls);
  const Geometry g = geometry(q, k, v, ak, av, attn_bias, options);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const auto part = q.options().dtype(compute_type(q.scalar_type()));
  Tensor dak_part, dav_part, dak, dav;
  if (ak) dak_part = at::empty({g.B, g.H, g.R, g.D}, part);
  if (av) dav_part = at::empty({g.B, g.H, g.R, g.Dv}, part);
  const Dropout drop(options.dropout_p, seed);
  if (is_half_precision(q.scalar_type())) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "relpos_native_backward_half", [&] {
      std::pair<c10::optional<Tensor>, c10::optional<Tensor>> low_tables;
      const auto [gemms, in] = reduced_call<scalar_t>(backward_query_block(g.L), q, k, v, ak, av,
                                                      kb, attn_bias, low_tables);
      backward_impl<float, scalar_t>(
          g, in, go.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(), ls.data_ptr<float>(),
          static_cast<float>(options.scale), drop, dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
          dv.data_ptr<scalar_t>(), ak ? dak_part.data_ptr<float>() : nullptr,
          av ? dav_part.data_ptr<float>() : nullptr, gemms);
      if (ak) dak = reduce_table_gradient<float>(dak_part, g.Hr_k);
      if (av) dav = reduce_table_gradient<float>(dav_part, g.Hr_v);
    });
    return {dq, dk, dv, ak ? dak : at::empty({0}, part), av ? dav : at::empty({0}, part)};
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_native_backward", [&] {
    auto in = inputs<scalar_t>(q, k, v, ak, av, kb, attn_bias);
    if (ak) in.ak_finite = all_finite(in.ak, ak->numel());
    backward_impl<scalar_t>(g, in, go.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(),
                            ls.data_ptr<scalar_t>(), static_cast<scalar_t>(options.scale), drop,
                            dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                            dv.data_ptr<scalar_t>(), ak ? dak_part.data_ptr<scalar_t>() : nullptr,
                            av ? dav_part.data_ptr<scalar_t>() : nullptr);
    if (ak) dak = reduce_table_gradient<scalar_t>(dak_part, g.Hr_k);
    if (av) dav = reduce_table_gradient<scalar_t>(dav_part, g.Hr_v);
  });
  return {dq, dk, dv, ak ? dak : at::empty({0}, q.options()),
          av ? dav : at::empty({0}, q.options())};
}

// The keep mask of dropout row `row` over keys [0, S) (all kept without dropout).
static void keep_row(const Dropout& drop, int64_t row, int64_t S, bool* keep) {
  uint32_t k1 = 0, k2 = 0;
  if (drop.on) drop.row_keys(row, k1, k2);
  for (int64_t j = 0; j < S; ++j)
    keep[j] = !drop.on ||
              Dropout::keep(static_cast<uint32_t>(drop.key_offset + j), k1, k2, drop.threshold);
}

// Returns the keep mask (B, H, L, S) of a padded call.
Tensor dropout_mask(const Tensor& seed, int64_t B, int64_t H, int64_t L, int64_t S,
                    double dropout_p) {
  const Dropout drop(dropout_p, seed);
  auto mask = at::empty({B, H, L, S}, at::TensorOptions().dtype(at::kBool));
  bool* mp = mask.data_ptr<bool>();
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < L; ++i)
      keep_row(drop, drop.first_row(bh, L) + i, S, mp + (bh * L + i) * S);
  return mask;
}

// Returns out (Tq, H, Dv) and the logsumexp (H, Tq) (+inf where a row sees no key) of a varlen
// call: query (Tq, H, D), key (Tk, H, D), value (Tk, H, Dv) in any strides; sequence s holds
// the query rows [cu_seqlens_q[s], cu_seqlens_q[s+1]) and the key rows [cu_seqlens_k[s],
// cu_seqlens_k[s+1]) (only the first seqused_k[s] of them with seqused_k, an (N) int64 tensor,
// or None), bottom-right aligned (options.query_start must be 0). The kernels hold q, k, v and
// out as (H, T, ·) contiguous, one block of rows per (sequence, head): one copy of each input
// unless it is given so, and one of out back to (Tq, H, Dv).
std::vector<Tensor> forward_varlen(const Tensor& query, const Tensor& key, const Tensor& value,
                                   const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                   const c10::optional<Tensor>& seqused_k,
                                   const c10::optional<Tensor>& rel_keys,
                                   const c10::optional<Tensor>& rel_values,
                                   const c10::optional<Tensor>& seed,
                                   const AttentionOptions& options) {
  choose_float_engine();
  auto cu_q = checked_cu_seqlens(cu_seqlens_q, "cu_seqlens_q");
  auto cu_k = checked_cu_seqlens(cu_seqlens_k, "cu_seqlens_k");
  Tensor used;
  const VarlenCall vc =
      varlen_call(query, key, value, cu_q, cu_k, seqused_k, used, rel_keys, rel_values, options);
  auto q = query.transpose(0, 1).contiguous(), k = key.transpose(0, 1).contiguous(),
       v = value.transpose(0, 1).contiguous();
  auto ak = contig(rel_keys), av = contig(rel_values);
  check_same_type(q, k, v);
  auto out = at::empty({vc.pk.H, vc.pk.Tq, vc.Dv}, q.options());
  auto lse = at::empty({vc.pk.H, vc.pk.Tq}, q.options().dtype(compute_type(q.scalar_type())));
  const Dropout drop(options.dropout_p, seed);
  TORCH_CHECK(!drop.placed, "a varlen call takes a dropout seed of two int64 (no placement)");
  if (is_half_precision(q.scalar_type())) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "relpos_native_forward_varlen_half", [&] {
      std::pair<c10::optional<Tensor>, c10::optional<Tensor>> low_tables;
      const auto [gemms, in] =
          reduced_call<scalar_t>(vc.BQ, q, k, v, ak, av, c10::nullopt, c10::nullopt, low_tables);
      forward_varlen_impl<float, scalar_t>(vc, in, static_cast<float>(options.scale), drop,
                                           out.data_ptr<scalar_t>(), lse.data_ptr<float>(), gemms);
    });
    return {out.transpose(0, 1).contiguous(), lse};
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_native_forward_varlen", [&] {
    const auto in = inputs<scalar_t>(q, k, v, ak, av, c10::nullopt, c10::nullopt);
    forward_varlen_impl<scalar_t>(vc, in, static_cast<scalar_t>(options.scale), drop,
                                  out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>());
  });
  return {out.transpose(0, 1).contiguous(), lse};
}

// Returns dq (Tq, H, D), dk (Tk, H, D), dv (Tk, H, Dv), d rel_keys, d rel_values (the last two
// empty for absent tables) of a varlen call: grad_out and out (Tq, H, Dv), lse (H, Tq), the
// rest as forward_varlen takes them (dk and dv are 0 in the rows past seqused_k). Layout
// inside as in forward_varlen.
std::vector<Tensor> backward_varlen(const Tensor& grad_out, const Tensor& query, const Tensor& key,
                                    const Tensor& value, const Tensor& cu_seqlens_q,
                                    const Tensor& cu_seqlens_k,
                                    const c10::optional<Tensor>& seqused_k,
                                    const c10::optional<Tensor>& rel_keys,
                                    const c10::optional<Tensor>& rel_values,
                                    const c10::optional<Tensor>& seed, const Tensor& out,
                                    const Tensor& lse, const AttentionOptions& options) {
  choose_float_engine();
  auto cu_q = checked_cu_seqlens(cu_seqlens_q, "cu_seqlens_q");
  auto cu_k = checked_cu_seqlens(cu_seqlens_k, "cu_seqlens_k");
  Tensor used;
  const VarlenCall vc =
      varlen_call(query, key, value, cu_q, cu_k, seqused_k, used, rel_keys, rel_values, options);
  const int64_t H = vc.pk.H, Tq = vc.pk.Tq, Tk = vc.pk.Tk;
  for (const Tensor* t : {&grad_out, &out})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == Tq && t->size(1) == H && t->size(2) == vc.Dv,
                "grad_out and out must be (Tq, H, Dv) = (", Tq, ", ", H, ", ", vc.Dv, "), got ",
                t->sizes());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == H && lse.size(1) == Tq, "lse must be (H, Tq) = (", H,
              ", ", Tq, "), got ", lse.sizes());
  auto q = query.transpose(0, 1).contiguous(), k = key.transpose(0, 1).contiguous(),
       v = value.transpose(0, 1).contiguous();
  auto go = grad_out.transpose(0, 1).contiguous(), o = out.transpose(0, 1).contiguous();
  auto ls = lse.contiguous();
  auto ak = contig(rel_keys), av = contig(rel_values);
  check_same_type(q, k, v);
  check_backward_types(q, go, o, ls);
  auto dq = at::empty({H, Tq, vc.D}, q.options()), dk = at::empty({H, Tk, vc.D}, q.options()),
       dv = at::empty({H, Tk, vc.Dv}, q.options());
  const std::vector<int64_t> groups = varlen_gradient_groups(vc, ak || av);
  const auto n_groups = static_cast<int64_t>(groups.size()) - 1;
  const auto part = q.options().dtype(compute_type(q.scalar_type()));
  Tensor dak_part, dav_part, dak, dav;
  if (ak) dak_part = at::empty({n_groups, H, vc.R, vc.D}, part);
  if (av) dav_part = at::empty({n_groups, H, vc.R, vc.Dv}, part);
  const Dropout drop(options.dropout_p, seed);
  TORCH_CHECK(!drop.placed, "a varlen call takes a dropout seed of two int64 (no placement)");
  auto grads = [&]() -> std::vector<Tensor> {
    return {dq.transpose(0, 1).contiguous(), dk.transpose(0, 1).contiguous(),
            dv.transpose(0, 1).contiguous(), ak ? dak : at::empty({0}, part),
            av ? dav : at::empty({0}, part)};
  };
  if (is_half_precision(q.scalar_type())) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "relpos_native_backward_varlen_half", [&] {
      std::pair<c10::optional<Tensor>, c10::optional<Tensor>> low_tables;
      const auto [gemms, in] =
          reduced_call<scalar_t>(vc.BQ, q, k, v, ak, av, c10::nullopt, c10::nullopt, low_tables);
      backward_varlen_impl<float, scalar_t>(
          vc, groups, in, go.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(), ls.data_ptr<float>(),
          static_cast<float>(options.scale), drop, dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
          dv.data_ptr<scalar_t>(), ak ? dak_part.data_ptr<float>() : nullptr,
          av ? dav_part.data_ptr<float>() : nullptr, gemms);
      if (ak) dak = reduce_table_gradient<float>(dak_part, ak->size(0));
      if (av) dav = reduce_table_gradient<float>(dav_part, av->size(0));
    });
    return grads();
  }
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "relpos_native_backward_varlen", [&] {
    auto in = inputs<scalar_t>(q, k, v, ak, av, c10::nullopt, c10::nullopt);
    if (ak) in.ak_finite = all_finite(in.ak, ak->numel());
    backward_varlen_impl<scalar_t>(
        vc, groups, in, go.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(), ls.data_ptr<scalar_t>(),
        static_cast<scalar_t>(options.scale), drop, dq.data_ptr<scalar_t>(),
        dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
        ak ? dak_part.data_ptr<scalar_t>() : nullptr, av ? dav_part.data_ptr<scalar_t>() : nullptr);
    if (ak) dak = reduce_table_gradient<scalar_t>(dak_part, ak->size(0));
    if (av) dav = reduce_table_gradient<scalar_t>(dav_part, av->size(0));
  });
  return grads();
}

// Returns the keep masks of a varlen call with H heads, one (H, L_s, S_s) per sequence (S_s the
// keys it uses: seqused_k[s] with seqused_k): query i of sequence s, head h, is dropout row
// h * Tq + cu_seqlens_q[s] + i (Packing::q_row), key j its index within the sequence.
std::vector<Tensor> dropout_mask_varlen(const Tensor& seed, const Tensor& cu_seqlens_q,
                                        const Tensor& cu_seqlens_k,
                                        const c10::optional<Tensor>& seqused_k, int64_t H,
                                        double dropout_p) {
  TORCH_CHECK(H >= 0, "the number of heads must not be negative, got ", H);
  auto cu_q = checked_cu_seqlens(cu_seqlens_q, "cu_seqlens_q");
  auto cu_k = checked_cu_seqlens(cu_seqlens_k, "cu_seqlens_k");
  Packing pk = packing(cu_q, cu_k, H, -1, -1);
  const Tensor used = checked_seqused(seqused_k, pk);
  const Dropout drop(dropout_p, seed);
  TORCH_CHECK(!drop.placed, "a varlen call takes a dropout seed of two int64 (no placement)");
  std::vector<Tensor> masks;
  for (int64_t s = 0; s < pk.N; ++s) {
    const int64_t L = pk.queries(s), S = pk.keys(s);
    auto mask = at::empty({H, L, S}, at::TensorOptions().dtype(at::kBool));
    bool* mp = mask.data_ptr<bool>();
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) keep_row(drop, pk.q_row(s, h) + i, S, mp + (h * L + i) * S);
    masks.push_back(mask);
  }
  return masks;
}

// What a bfloat16 call made now (this environment) runs its GEMMs on: "amx", "avx512bf16",
// "brgemm" or "widened".
std::string bf16_gemm_name() {
  switch (bf16_gemm()) {
    case Bf16Gemm::kAmx: return "amx";
    case Bf16Gemm::kDot: return "avx512bf16";
    case Bf16Gemm::kBrgemm: return "brgemm";
    default: return "widened";
  }
}

// What a call made now (this environment) runs its GEMMs on, per dtype: float32 "vec" or
// "brgemm"; float64 "blas" or "aten"; bfloat16 as bf16_gemm_name(); float16 "widened". The one
// place the choice is made: relpos's Python asks here.
std::map<std::string, std::string> gemm_engines() {
#ifdef RELPOS_HAVE_BLAS
  const std::string blas = "blas";
#else
  const std::string blas = "aten";
#endif
  return {{"float32", float_gemm_now() == FloatGemm::kVec ? "vec" : "brgemm"},
          {"float64", blas},
          {"bfloat16", bf16_gemm_name()},
          {"float16", "widened"}};
}

// How the kernels were built: the BLAS, the tile engines and vectors this build has, e.g.
// "blas=mkl amx=none avx512bf16=bf16 vectors=avx512".
std::string build_info() {
#ifdef RELPOS_HAVE_BLAS
  std::string info = "blas=mkl";
#else
  std::string info = "blas=aten";
#endif
  // the packed-tile GEMMs of bfloat16 calls: AMX (built for this CPU and granted by the OS),
  // VDPBF16PS (built for a CPU with AVX512-BF16)
  info += amx_granted() ? " amx=bf16" : " amx=none";
#ifdef RELPOS_HAVE_BF16_TILES
  info += " avx512bf16=bf16";
#else
  info += " avx512bf16=none";
#endif
  info += brgemm_bf16_serves() ? " brgemm=f32,bf16" : " brgemm=f32";
  // the float32 vector code the row passes, the GEMM blocks and the decode kernels run on
#if defined(__AVX512F__)
  info += " vectors=avx512";
#elif defined(RELPOS_VEC_FLOAT)
  info += " vectors=avx2";
#else
  info += " vectors=none";
#endif
  return info;
}

}  // namespace relpos_native
