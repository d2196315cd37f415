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

#include <cstdint>
#include <optional>
#include <vector>

namespace relpos_decode {

using at::Tensor;

// How a linear reads its weight (relpos.models.decoding.decode_linear's choice, made once).
enum class LinearKind : int64_t {
  kLinear = 0,     // at::linear(x, weight, bias)
  kTransposed = 1, // at::addmm(bias, x, weight^T) / at::mm(x, weight^T) with weight^T stored
  kMklPacked = 2,  // mkl::_mkl_linear(x, packed, weight, bias, batch)
  kOneDnnPacked = 3,  // mkldnn::_linear_pointwise(x, packed, bias, "none", [], "")
};

struct Linear {
  LinearKind kind;
  Tensor weight;               // (out, in)
  std::optional<Tensor> bias;  // (out)
  Tensor layout;               // weight^T (in, out), MKL's or oneDNN's packed weight, or empty
  int64_t batch;

  Tensor operator()(const Tensor& x) const {
    switch (kind) {
      case LinearKind::kTransposed:
        return bias ? at::addmm(*bias, x, layout) : at::mm(x, layout);
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
      case LinearKind::kLinear:
      default:
        return at::linear(x, weight, bias);
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
  TORCH_CHECK(kind >= 0 && kind <= 3, "linear kind must be 0, 1, 2 or 3, got ", kind);
  return Linear{static_cast<LinearKind>(kind), std::move(weight), std::move(bias),
                std::move(layout), batch};
}

// The layers of one model, as StepDecoder.start prepared them (weights, their decode layouts,
// tables); built once per decoder and cache batch size.
class LayerStack {
 public:
  LayerStack(int64_t E, int64_t H) : E_(E), H_(H) {
    TORCH_CHECK(E > 0 && H > 0 && E % H == 0, "d_model ", E, " must be a multiple of heads ",
                H);
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
      TORCH_CHECK(k.dim() == 4 && k.size(2) == S && v.dim() == 4 && v.size(2) == S,
                  "layer ", i, ": the cache views must hold S = ", S, " positions");
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
      std::optional<Tensor> mask;
      if (masks[i]) mask = masks[i]->unsqueeze(1).unsqueeze(1);  // (B, 1, 1, S)
      Tensor out = at::scaled_dot_product_attention(qkv.select(1, 0).unsqueeze(2), k, v, mask);
      x = x + layer.out(out.view({B, E_}));
      h = at::layer_norm(x, {E_}, layer.norm2.weight, layer.norm2.bias, layer.norm2.eps);
      h = at::gelu(layer.ff1(h));
      x = x + layer.ff2(h);
    }
    return x;
  }

 private:
  int64_t E_, H_;
  std::vector<Layer> layers_;
};

void bind(pybind11::module& m) {
  // module_local, as the kernels' other types: two builds may be loaded in one process
  pybind11::class_<LayerStack>(m, "DecodeLayers", pybind11::module_local(),
                               "The layers of a decode step in C++ (relpos.models.decoding)")
      .def(pybind11::init<int64_t, int64_t>(), pybind11::arg("d_model"), pybind11::arg("heads"))
      .def("add_layer", &LayerStack::add_layer)
      .def("__len__", &LayerStack::size)
      .def("run", &LayerStack::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace relpos_decode
