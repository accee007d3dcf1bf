// The Python binding of paged_prefill_attention, the same in both modules (bindings.cpp,
// ../csrc_avx2/bindings_avx2.cpp): attention_bf16.cpp in the AVX-512 one (bf16, AVX512_BF16),
// ../csrc_avx2/prefill_attention_avx2.cpp in the AVX2 one (fp32 arithmetic).
#pragma once

#include <torch/python.h>

#include <optional>

namespace mops {

std::optional<at::Tensor> paged_prefill_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&, double,
                                                  const std::optional<at::Tensor>&,
                                                  const std::optional<at::Tensor>&,
                                                  const std::optional<at::Tensor>&);

inline void def_paged_prefill_attention(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("paged_prefill_attention", &paged_prefill_attention, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("cached_lens"),
        py::arg("query_lens"), py::arg("scale"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
}

}  // namespace mops
