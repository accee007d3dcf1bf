// The Python bindings both modules share (bindings.cpp, ../csrc_avx2/bindings_avx2.cpp): the
// KV write, the per-token layer ops and the int8 matmul, each with the same contract in both.
#pragma once

#include <torch/python.h>

#include <optional>
#include <vector>

namespace mops {

bool write_kv(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);
std::optional<std::vector<at::Tensor>> rms_norm(const at::Tensor&, const at::Tensor&, double,
                                                const std::optional<at::Tensor>&);
std::optional<std::vector<at::Tensor>> rotary_embedding(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&);
std::optional<at::Tensor> silu_and_mul(const at::Tensor&);
std::optional<at::Tensor> int8_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);

inline void def_layer_ops(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("write_kv", &write_kv, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rotary_embedding", &rotary_embedding, py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, py::call_guard<py::gil_scoped_release>());
  m.def("int8_linear", &int8_linear, py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace mops
