// Python module mooncake_ops_native_avx2: the kernels mooncake_ops loads on a CPU with AVX2 but
// no AVX-512 (where mooncake_ops_native cannot load): paged decode attention, the KV write, the
// per-token layer ops, int8, GGUF and dense matmuls of few rows, prefill attention with fp32
// arithmetic (the packed bf16 matmul needs AVX512_BF16), and the fused decode step over them. Each returns None when a call does not
// fit and bad values raise ValueError, as in the AVX-512 module.
#include <torch/python.h>

#include <optional>

#include "../csrc/bind_decode.h"
#include "../csrc/bind_gguf.h"
#include "../csrc/bind_layer.h"
#include "../csrc/bind_prefill.h"

namespace mops {
std::optional<at::Tensor> dense_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
void def_decode_step(pybind11::module_&);
}  // namespace mops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mooncake_ops native CPU kernels (AVX2)";
  m.attr("isa") = "avx2";
  mops::def_paged_decode_attention(m);
  m.def("dense_linear", &mops::dense_linear, py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  mops::def_paged_prefill_attention(m);
  mops::def_layer_ops(m);
  mops::def_gguf(m);
  mops::def_decode_step(m);
}
