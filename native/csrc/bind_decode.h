// The Python binding of paged_decode_attention, the same in both modules (bindings.cpp,
// ../csrc_avx2/bindings_avx2.cpp).
#pragma once

#include <torch/python.h>

#include "decode_common.h"

namespace mops {

inline void def_paged_decode_attention(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("k_scale"),
        py::arg("v_scale"), py::arg("out"), py::arg("lse") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace mops
