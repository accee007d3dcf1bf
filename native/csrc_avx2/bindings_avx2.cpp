// Python module mooncake_ops_native_avx2: the kernels mooncake_ops loads on a CPU with AVX2 but
// no AVX-512 (where mooncake_ops_native cannot load). Only paged decode attention so far; it
// returns None when a call does not fit, and bad values raise ValueError, as in the AVX-512
// module.
#include <torch/extension.h>

#include "../csrc/bind_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mooncake_ops native CPU kernels (AVX2: paged decode attention)";
  m.attr("isa") = "avx2";
  mops::def_paged_decode_attention(m);
}
