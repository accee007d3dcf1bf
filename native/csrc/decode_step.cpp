// The AVX-512 build's fused decode step (decode_step.h): bf16 weights packed by bf16_pack_weight,
// whose matmul (and gate / up with SiLU) needs AVX512_BF16, as does the bf16 decode attention.
#include "decode_step.h"

namespace mops::step {

void check_cpu() {
  if (!cpu_has_avx512_bf16()) refuse("this CPU has no AVX512_BF16");
}

Weight bf16_weight(const at::Tensor& w, int64_t kind, const std::string& name, int64_t K) {
  if (kind != kPackedBf16 || w.scalar_type() != at::kBFloat16 || !w.is_contiguous() || w.dim() != 4 ||
      w.size(2) != 16 || w.size(3) != 2 || w.size(1) * 2 != K)
    refuse(name + " must be a bf16 weight packed by bf16_pack_weight with " + std::to_string(K) +
           " input features (kind -1; a dense bf16 weight, kind -3, is the AVX2 build's)");
  Weight y{w, kind};
  y.n = w.size(0) * 16;
  return y;
}

void bf16_matmul(const Weight& w, const bf16* x, int64_t k, const bf16* bias, bf16* y, int64_t M, int64_t r0,
                 int64_t r1) {
  parts::bf16_linear_blocks(x, k, reinterpret_cast<const uint32_t*>(w.w.data_ptr<bf16>()), bias, y, w.n, k / 2, M,
                            r0 / 16, r1 / 16, w.unit == 32);
}

}  // namespace mops::step
