// One decode step of a relpos language model's layers in C++: the per-layer ATen calls of
// relpos.models.decoding.StepDecoder (layer norms, the fused QKV projection, the cache writes,
// the band's relative rows, one attention call, the output projection, the GELU block) in the
// same order on the same operators, so the result is the Python step's bit for bit, without
// the interpreter between the calls. At batch 1 the step is a few hundred small calls around
// the weight reads, and the interpreter's share of it is what this removes.
//
// Shape legend: B batch, H heads, D head dim, E d_model, S cached positions after the step,
// C cache capacity, R table rows.

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

// How a linear reads its weight (relpos.models.decoding.decode_linear's choice, made once).
enum class LinearKind : int64_t {
  kLinear = 0,        // at::linear(x, weight, bias)
  kTransposed = 1,    // at::addmm(bias, x, weight^T) / at::mm(x, weight^T) with weight^T stored
  kMklPacked = 2,     // mkl::_mkl_linear(x, packed, weight, bias, batch)
  kOneDnnPacked = 3,  // mkldnn::_linear_pointwise(x, packed, bias, "none", [], "")
  kPanels = 4,        // panel_linear(x, pack_panels(weight), bias, out)
};

struct Linear {
  LinearKind kind;
  Tensor weight;               // (out, in)
  std::optional<Tensor> bias;  // (out)
  Tensor layout;  // weight^T (in, out), MKL's, oneDNN's or pack_panels' weight, or empty
  int64_t batch;

  Tensor operator()(const Tensor& x) const {
    switch (kind) {
      case LinearKind::kTransposed: return bias ? at::addmm(*bias, x, layout) : at::mm(x, layout);
      case LinearKind::kMklPacked: {
        static auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkl::_mkl_linear", "")
                             .typed<Tensor(const Tensor&, const Tensor&, const Tensor&,
                                           const std::optional<Tensor>&, int64_t)>();
        return op.call(x, layout, weight, bias, batch);
      }
      case LinearKind::kOneDnnPacked: {
        static auto op =
            c10::Dispatcher::singleton()
                .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                              c10::string_view, c10::List<std::optional<at::Scalar>>,
                              std::optional<c10::string_view>)>();
        return op.call(x, layout, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
      }
      case LinearKind::kPanels: return panel_linear(x, layout, bias, weight.size(0));
      case LinearKind::kLinear:
      default: return at::linear(x, weight, bias);
    }
  }
};

struct Norm {
  Tensor weight;
  std::optional<Tensor> bias;
  double eps;
};

struct Layer {
  Norm norm1, norm2;
  Linear qkv, out, ff1, ff2;
  std::optional<Tensor> rel_keys;    // (R, D) or (H, R, D)
  std::optional<Tensor> rel_values;  // (R, Dv) or (H, R, Dv)
};

static Linear make_linear(int64_t kind, Tensor weight, std::optional<Tensor> bias, Tensor layout,
                          int64_t batch) {
  TORCH_CHECK(kind >= 0 && kind <= 4, "linear kind must be 0 to 4, got ", kind);
  return Linear{static_cast<LinearKind>(kind), std::move(weight), std::move(bias),
                std::move(layout), batch};
}

// The layers of one model, as StepDecoder.start prepared them (weights, their decode layouts,
// tables); built once per decoder and cache batch size.
class LayerStack {
 public:
  // native_attention: the attention call is decode_attention (float32), else SDPA.
  LayerStack(int64_t E, int64_t H, bool native_attention)
      : E_(E), H_(H), native_attention_(native_attention) {
    TORCH_CHECK(E > 0 && H > 0 && E % H == 0, "d_model ", E, " must be a multiple of heads ", H);
  }

  // norm: (weight, bias or None, eps); each linear: (kind, weight, bias or None, layout or an
  // empty tensor, batch).
  void add_layer(const Tensor& n1_w, const std::optional<Tensor>& n1_b, double n1_eps,
                 const Tensor& n2_w, const std::optional<Tensor>& n2_b, double n2_eps,
                 const std::vector<int64_t>& kinds, const std::vector<Tensor>& weights,
                 const std::vector<std::optional<Tensor>>& biases,
                 const std::vector<Tensor>& layouts, int64_t batch,
                 const std::optional<Tensor>& rel_keys, const std::optional<Tensor>& rel_values) {
    TORCH_CHECK(kinds.size() == 4 && weights.size() == 4 && biases.size() == 4 &&
                    layouts.size() == 4,
                "a layer has four linears (qkv, out, ff1, ff2)");
    Layer layer;
    layer.norm1 = Norm{n1_w, n1_b, n1_eps};
    layer.norm2 = Norm{n2_w, n2_b, n2_eps};
    Linear* lin[4] = {&layer.qkv, &layer.out, &layer.ff1, &layer.ff2};
    for (size_t i = 0; i < 4; ++i)
      *lin[i] = make_linear(kinds[i], weights[i], biases[i], layouts[i], batch);
    layer.rel_keys = rel_keys;
    layer.rel_values = rel_values;
    layers_.push_back(std::move(layer));
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // Runs every layer on x (B, E) for the token at position p (S = p + 1 keys after it):
  // keys[n], values[n] are layer n's cache views (B, H, S, D) (position p written here);
  // plus_keys[n] / plus_values[n] its storages of k_j + rel_keys[row of j] (B, H, C, D) or
  // None without that table; masks[n] its key mask (B, S) or None. Returns x after the last
  // layer (before the final norm).
  Tensor run(Tensor x, int64_t p, int64_t left, const std::vector<Tensor>& keys,
             const std::vector<Tensor>& values, const std::vector<std::optional<Tensor>>& plus_keys,
             const std::vector<std::optional<Tensor>>& plus_values,
             const std::vector<std::optional<Tensor>>& masks) const {
    const auto n = layers_.size();
    TORCH_CHECK(keys.size() == n && values.size() == n && plus_keys.size() == n &&
                    plus_values.size() == n && masks.size() == n,
                "one cache view of each kind per layer: ", n, " layers");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == E_, "x must be (B, ", E_, "), got ", x.sizes());
    const int64_t B = x.size(0), D = E_ / H_, S = p + 1;
    const int64_t m = std::min(S, left + 1);  // the band: keys whose table row changes
    const int64_t band0 = S - m, row0 = left + 1 - m;
    for (size_t i = 0; i < n; ++i) {
      const Layer& layer = layers_[i];
      Tensor k = keys[i], v = values[i];
      TORCH_CHECK(k.dim() == 4 && k.size(2) == S && v.dim() == 4 && v.size(2) == S, "layer ", i,
                  ": the cache views must hold S = ", S, " positions");
      Tensor h = at::layer_norm(x, {E_}, layer.norm1.weight, layer.norm1.bias, layer.norm1.eps);
      Tensor qkv = layer.qkv(h).view({B, 3, H_, D});
      k.select(2, p).copy_(qkv.select(1, 1));
      v.select(2, p).copy_(qkv.select(1, 2));
      if (plus_keys[i] && layer.rel_keys) {
        const Tensor& pk = *plus_keys[i];
        Tensor band = pk.narrow(2, band0, m);
        at::add_out(band, k.narrow(2, band0, m), layer.rel_keys->narrow(-2, row0, m));
        k = pk.narrow(2, 0, S);
      }
      if (plus_values[i] && layer.rel_values) {
        const Tensor& pv = *plus_values[i];
        Tensor band = pv.narrow(2, band0, m);
        at::add_out(band, v.narrow(2, band0, m), layer.rel_values->narrow(-2, row0, m));
        v = pv.narrow(2, 0, S);
      }
      Tensor out;
      if (native_attention_) {
        out = decode_attention(qkv.select(1, 0), k, v, masks[i]);  // (B, H, D)
      } else {
        std::optional<Tensor> mask;
        if (masks[i]) mask = masks[i]->unsqueeze(1).unsqueeze(1);  // (B, 1, 1, S)
        out = at::scaled_dot_product_attention(qkv.select(1, 0).unsqueeze(2), k, v, mask);
      }
      x = x + layer.out(out.view({B, E_}));
      h = at::layer_norm(x, {E_}, layer.norm2.weight, layer.norm2.bias, layer.norm2.eps);
      h = at::gelu(layer.ff1(h));
      x = x + layer.ff2(h);
    }
    return x;
  }

 private:
  int64_t E_, H_;
  bool native_attention_;
  std::vector<Layer> layers_;
};

void bind(pybind11::module& m) {
  // module_local, as the kernels' other types: two builds may be loaded in one process
  pybind11::class_<LayerStack>(m, "DecodeLayers", pybind11::module_local(),
                               "The layers of a decode step in C++ (relpos.models.decoding)")
      .def(pybind11::init<int64_t, int64_t, bool>(), pybind11::arg("d_model"),
           pybind11::arg("heads"), pybind11::arg("native_attention") = false)
      .def("add_layer", &LayerStack::add_layer)
      .def("__len__", &LayerStack::size)
      .def("run", &LayerStack::run, pybind11::call_guard<pybind11::gil_scoped_release>());
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
