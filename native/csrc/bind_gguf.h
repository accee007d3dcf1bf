// The GGUF quantized matmul's bindings, the same contract in both modules (bindings.cpp,
// ../csrc_avx2/bindings_avx2.cpp; kernels in linear_gguf.cpp and ../csrc_avx2/linear_gguf_avx2.cpp).
#pragma once

#include <torch/python.h>

#include <optional>

namespace mops {

std::optional<at::Tensor> gguf_linear(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&);
bool gguf_dequantize(const at::Tensor&, int64_t, at::Tensor&);

inline void def_gguf(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("gguf_linear", &gguf_linear, py::arg("x"), py::arg("weight"), py::arg("type"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_dequantize", &gguf_dequantize, py::arg("weight"), py::arg("type"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace mops
