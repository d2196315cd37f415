// The decode kernels' tensor entry points: a decode step's attention (decode_attention: one
// query per head over the cache) and the panel linears (pack_panels, panel_linear) that
// relpos.models.decoding's StepDecoder calls in float32 on the CPU. The kernels themselves are
// in decode_kernels.h (reached through decode.h); the step's other calls run in Python.
//
// Shape legend: B batch, H heads, D head dim, S cached positions.

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "decode.h"  // the kernels it calls: decode_attention_f32, panel_linear_f32

namespace relpos_decode {

using at::Tensor;

// A decode step's attention, float32: query (B, H, D), key (B, H, S, D), value (B, H, S, Dv)
// (rows contiguous: a cache's first S positions), key_mask (B, S) bool or None; softmax at
// scale 1 / sqrt(D). Returns (B, H, Dv).
Tensor decode_attention(const Tensor& query, const Tensor& key, const Tensor& value,
                        const std::optional<Tensor>& key_mask) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 4 && value.dim() == 4,
              "decode_attention takes query (B, H, D), key (B, H, S, D), value (B, H, S, Dv), ",
              "got ", query.sizes(), ", ", key.sizes(), ", ", value.sizes());
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2), S = key.size(2);
  const int64_t Dv = value.size(3);
  TORCH_CHECK(key.size(0) == B && key.size(1) == H && key.size(3) == D && value.size(0) == B &&
                  value.size(1) == H && value.size(2) == S,
              "decode_attention: key ", key.sizes(), " and value ", value.sizes(),
              " do not fit query ", query.sizes());
  for (const Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                "decode_attention takes float32 CPU tensors, got ", t->scalar_type(), " on ",
                t->device());
  const Tensor q = query.stride(2) == 1 ? query : query.contiguous();
  const Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  Tensor mask;
  if (key_mask) {
    TORCH_CHECK(key_mask->scalar_type() == at::kBool && key_mask->dim() == 2 &&
                    key_mask->size(0) == B && key_mask->size(1) == S,
                "decode_attention's key_mask must be bool (", B, ", ", S, "), got ",
                key_mask->scalar_type(), " ", key_mask->sizes());
    mask = key_mask->contiguous();
  }
  Tensor out = at::empty({B, H, Dv}, q.options());
  const int64_t q_s[2] = {q.stride(0), q.stride(1)};
  const int64_t k_s[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t v_s[3] = {v.stride(0), v.stride(1), v.stride(2)};
  const int64_t o_s[2] = {out.stride(0), out.stride(1)};
  relpos_native::decode_attention_f32(
      q.data_ptr<float>(), q_s, k.data_ptr<float>(), k_s, v.data_ptr<float>(), v_s,
      mask.defined() ? mask.data_ptr<bool>() : nullptr, B, H, S, D, Dv,
      static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))), out.data_ptr<float>(), o_s);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Linears for a few rows (a decode step's batch): the weight read once, as a stream.
//
// At 8 rows a float32 linear is a stream of its weight: each weight takes part in 8
// multiply-adds, about what a core's FMA units do while the memory delivers it. The packed
// GEMMs of MKL and oneDNN read 512-2048 x 512 weights at about 12 GB/s on an AMD EPYC (Zen 4),
// where a plain sum streams 25 GB/s; these panels read them at 16-23 GB/s
// (benchmarks/ct2_decode_epyc.md). A weight (N, K) is stored as panels of 16 outputs: panel t
// holds, for k = 0 .. K-1, the 16 weights w[16t .. 16t + 15, k] (zeros past N), so a panel is
// one contiguous stream; each row of x broadcasts x[r, k] against it into 16 accumulators.

using relpos_native::kPanel;  // decode.h

// (ceil(N / 16), K, 16) panels of a float32 weight (N, K).
Tensor pack_panels(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_panels takes a float32 CPU weight (N, K), got ", weight.scalar_type(), " ",
              weight.sizes(), " on ", weight.device());
  const int64_t N = weight.size(0), K = weight.size(1), NP = (N + kPanel - 1) / kPanel;
  Tensor padded = at::zeros({NP * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({NP, kPanel, K}).transpose(1, 2).contiguous();
}

// y (M, N) = x (M, K) @ weight^T + bias from pack_panels(weight) (N its rows).
Tensor panel_linear(const Tensor& x, const Tensor& panels, const std::optional<Tensor>& bias,
                    int64_t N) {
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.scalar_type() == at::kFloat &&
                  panels.is_contiguous(),
              "panel_linear takes pack_panels' (N / 16, K, 16) float32 panels, got ",
              panels.sizes());
  const int64_t NP = panels.size(0), K = panels.size(1);
  TORCH_CHECK(
      x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat && x.device().is_cpu(),
      "panel_linear takes float32 CPU rows (M, ", K, "), got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(N > (NP - 1) * kPanel && N <= NP * kPanel, "N = ", N, " does not fit ", NP,
              " panels of ", kPanel);
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N &&
                        bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "panel_linear's bias must be float32 (", N, ")");
  const Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  Tensor y = at::empty({M, N}, xc.options());
  relpos_native::panel_linear_f32(xc.data_ptr<float>(), M, K, panels.data_ptr<float>(), NP,
                                  bias ? bias->data_ptr<float>() : nullptr, N, y.data_ptr<float>());
  return y;
}

void bind(pybind11::module& m) {
  m.def("decode_attention", &decode_attention,
        "a decode step's attention, float32: one query per (batch, head) over S keys",
        pybind11::arg("query"), pybind11::arg("key"), pybind11::arg("value"),
        pybind11::arg("key_mask") = std::nullopt,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pack_panels", &pack_panels, "a float32 weight (N, K) as (N / 16, K, 16) panels",
        pybind11::arg("weight"));
  m.def("panel_linear", &panel_linear, "x @ weight^T + bias from pack_panels(weight)",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("bias"), pybind11::arg("n"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace relpos_decode
