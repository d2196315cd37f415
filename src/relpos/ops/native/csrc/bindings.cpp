// The kernels' Python module: pybind11 bindings of the entry points (attention.h) and of the
// decode kernels' entry points (decode.cpp), and build_info.

#include <string>

#include <torch/extension.h>
#include <pybind11/stl.h>

#include "attention.h"
#include "decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  relpos_decode::bind(m);
  using relpos_native::AttentionOptions;
  // module_local: two builds of these kernels (two variants, a cache's and a prebuilt one)
  // can be loaded in one process without their types colliding.
  py::class_<AttentionOptions>(m, "AttentionOptions", py::module_local(),
                               "The scalar options of one call (keywords only, read-only).")
      .def(py::init([](int64_t left, int64_t right, bool is_causal, double scale,
                       int64_t query_start, double dropout_p) {
             return AttentionOptions{left, right, is_causal, scale, query_start, dropout_p};
           }),
           py::kw_only(), py::arg("left"), py::arg("right"), py::arg("is_causal"), py::arg("scale"),
           py::arg("query_start"), py::arg("dropout_p"))
      .def_readonly("left", &AttentionOptions::left)
      .def_readonly("right", &AttentionOptions::right)
      .def_readonly("is_causal", &AttentionOptions::is_causal)
      .def_readonly("scale", &AttentionOptions::scale)
      .def_readonly("query_start", &AttentionOptions::query_start)
      .def_readonly("dropout_p", &AttentionOptions::dropout_p)
      .def("__repr__", [](const AttentionOptions& o) {
        return "AttentionOptions(left=" + std::to_string(o.left) +
               ", right=" + std::to_string(o.right) +
               ", is_causal=" + (o.is_causal ? "True" : "False") +
               ", scale=" + std::to_string(o.scale) +
               ", query_start=" + std::to_string(o.query_start) +
               ", dropout_p=" + std::to_string(o.dropout_p) + ")";
      });
  // The kernels run without the GIL (arguments are converted before, results after), so
  // Python threads calling them run concurrently.
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.def("forward", &relpos_native::forward, "relpos native forward", py::arg("query"),
        py::arg("key"), py::arg("value"), py::arg("rel_keys"), py::arg("rel_values"),
        py::arg("key_bias"), py::arg("attn_bias"), py::arg("seed"), py::arg("options"), no_gil());
  m.def("backward", &relpos_native::backward, "relpos native backward", py::arg("grad_out"),
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("rel_keys"),
        py::arg("rel_values"), py::arg("key_bias"), py::arg("attn_bias"), py::arg("seed"),
        py::arg("out"), py::arg("lse"), py::arg("options"), no_gil());
  m.def("dropout_mask", &relpos_native::dropout_mask, "the keep mask of a dropout seed", no_gil());
  m.def("forward_varlen", &relpos_native::forward_varlen, "relpos native varlen forward",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::arg("seqused_k"), py::arg("rel_keys"), py::arg("rel_values"),
        py::arg("seed"), py::arg("options"), no_gil());
  m.def("backward_varlen", &relpos_native::backward_varlen, "relpos native varlen backward",
        py::arg("grad_out"), py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("seqused_k"), py::arg("rel_keys"),
        py::arg("rel_values"), py::arg("seed"), py::arg("out"), py::arg("lse"), py::arg("options"),
        no_gil());
  m.def("dropout_mask_varlen", &relpos_native::dropout_mask_varlen,
        "the keep masks of a dropout seed over a varlen call, one (H, L, S) per sequence",
        py::arg("seed"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("seqused_k"),
        py::arg("num_heads"), py::arg("dropout_p"), no_gil());
  m.def("build_info", &relpos_native::build_info, "how the kernels were built");
  m.def("bf16_gemm", &relpos_native::bf16_gemm_name,
        "what a bfloat16 call runs its GEMMs on now: amx, avx512bf16, brgemm or widened");
  m.def("gemm_engines", &relpos_native::gemm_engines,
        "what a call made now runs its GEMMs on, per dtype (the kernels decide; relpos asks)");
}
