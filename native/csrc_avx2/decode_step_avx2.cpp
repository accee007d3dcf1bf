// The AVX2 build's fused decode step (../csrc/decode_step.h): bf16 weights dense [N, K], as its
// dense_linear takes them, computed in fp32 by the same row kernel (linear_avx2.cpp); gate / up
// as [gate; up] rows, SiLU-and-mul a phase of its own. The module loads only where AVX2 runs, so
// there is no CPU check beyond that.
#include "../csrc/decode_step.h"

namespace mops::step {

void check_cpu() {}

Weight bf16_weight(const at::Tensor& w, int64_t kind, const std::string& name, int64_t K) {
  if (kind != kDenseBf16 || w.scalar_type() != at::kBFloat16 || !w.is_contiguous() || w.dim() != 2 ||
      w.size(1) != K)
    refuse(name + " must be a contiguous dense bf16 weight [N, " + std::to_string(K) +
           "] (kind -3): this build has no packed bf16 matmul (kind -1 is the AVX-512 build's)");
  Weight y{w, kind};
  y.n = w.size(0);
  y.unit = 4;
  return y;
}

void bf16_matmul(const Weight& w, const bf16* x, int64_t k, const bf16* bias, bf16* y, int64_t M, int64_t r0,
                 int64_t r1) {
  parts::dense_linear_rows(x, w.w.data_ptr<bf16>(), bias, y, M, w.n, k, r0, r1);
}

}  // namespace mops::step
