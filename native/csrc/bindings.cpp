// Python module mooncake_ops_native: the CPU kernels mooncake_ops loads when present.
// Every entry returns None / False when a call does not fit the kernel, so the Python adapter
// runs the PyTorch reference instead; bad values raise ValueError (std::invalid_argument).
// Every kernel runs with the GIL released (py::call_guard<py::gil_scoped_release>: arguments
// are converted before and the result after, with the GIL held): the engine thread's kernels
// no longer stop the server's event loop, which then answers HTTP while a step computes.
#include <torch/python.h>

#include <optional>
#include <vector>

#include "bind_decode.h"
#include "bind_gguf.h"
#include "bind_layer.h"
#include "bind_prefill.h"

namespace mops {
std::optional<at::Tensor> bf16_linear(const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&);
at::Tensor bf16_pack_weight(const at::Tensor&);
std::optional<at::Tensor> bf16_gate_up_silu(const at::Tensor&, const at::Tensor&);
bool bf16_linear_supported();
std::optional<at::Tensor> bf16_int8_weight_linear(const at::Tensor&, const at::Tensor&,
                                                  const std::optional<at::Tensor>&);
std::optional<at::Tensor> bf16_int8_weight_gate_up_silu(const at::Tensor&, const at::Tensor&);
void def_decode_step(pybind11::module_&);
}  // namespace mops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mooncake_ops native CPU kernels (AVX-512)";
  m.attr("isa") = "avx512";
  mops::def_paged_decode_attention(m);
  mops::def_paged_prefill_attention(m);
  mops::def_layer_ops(m);
  mops::def_gguf(m);
  mops::def_decode_step(m);
  m.def("bf16_linear", &mops::bf16_linear, py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("bf16_pack_weight", &mops::bf16_pack_weight, py::call_guard<py::gil_scoped_release>());
  m.def("bf16_gate_up_silu", &mops::bf16_gate_up_silu, py::arg("x"), py::arg("weight"), py::call_guard<py::gil_scoped_release>());
  m.def("bf16_linear_supported", &mops::bf16_linear_supported);
  m.def("bf16_int8_weight_linear", &mops::bf16_int8_weight_linear, py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("bf16_int8_weight_gate_up_silu", &mops::bf16_int8_weight_gate_up_silu, py::arg("x"), py::arg("weight"),
        py::call_guard<py::gil_scoped_release>());
}
