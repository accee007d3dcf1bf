// Python module mooncake_ops_native_avx2: the kernels mooncake_ops loads on a CPU with AVX2 but
// no AVX-512 (where mooncake_ops_native cannot load). Only paged decode attention so far; it
// returns None when a call does not fit, and bad values raise ValueError, as in the AVX-512
// module.
#include <torch/extension.h>

#include <optional>

namespace mops {
std::optional<at::Tensor> paged_decode_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const at::Tensor&, double,
                                                 const std::optional<at::Tensor>&,
                                                 const std::optional<at::Tensor>&,
                                                 const std::optional<at::Tensor>&,
                                                 const std::optional<at::Tensor>&);
}  // namespace mops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mooncake_ops native CPU kernels (AVX2: paged decode attention)";
  m.attr("isa") = "avx2";
  m.def("paged_decode_attention", &mops::paged_decode_attention, py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("k_scale"), py::arg("v_scale"), py::arg("out"), py::arg("lse") = py::none());
}
