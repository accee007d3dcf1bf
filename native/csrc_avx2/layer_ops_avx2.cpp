// Per-token layer ops in one pass each, AVX2 + FMA + F16C: RMSNorm (+ fused residual add), NeoX
// RoPE, SiLU-and-mul, as ../csrc/layer_ops.cpp does them with 16-lane vectors. All compute in
// fp32 and round once to the input dtype. The entries (checks, dispatch) are
// ../csrc/layer_ops_common.h's; sizes are multiples of 8 here.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace mops {
constexpr int64_t kLayerLanes = 8;
}  // namespace mops

#include "../csrc/layer_ops_common.h"
#include "vec_avx2.h"

namespace mops {
namespace {

template <typename XT, typename WT>
void rms_rows(const XT* x, const XT* res, const WT* w, XT* out, XT* res_out, int64_t rows, int64_t hidden,
              float eps) {
  at::parallel_for(0, rows, is_parallel(rows * hidden) ? 1 : rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const XT* xr = x + r * hidden;
      if (res != nullptr) {  // h = round(x + residual), then the norm of h as rounded
        for (int64_t c = 0; c < hidden; c += 8)
          store8(res_out + r * hidden + c, _mm256_add_ps(load8(xr + c), load8(res + r * hidden + c)));
        xr = res_out + r * hidden;
      }
      __m256 ss = _mm256_setzero_ps();
      for (int64_t c = 0; c < hidden; c += 8) {
        const __m256 v = load8(xr + c);
        ss = _mm256_fmadd_ps(v, v, ss);
      }
      const __m256 rstd = _mm256_set1_ps(1.0f / std::sqrt(hsum8(ss) / hidden + eps));
      for (int64_t c = 0; c < hidden; c += 8)
        store8(out + r * hidden + c, _mm256_mul_ps(_mm256_mul_ps(load8(xr + c), rstd), load8(w + c)));
    }
  });
}

template <typename XT>
void rope_rows(const int64_t* pos, const float* cache, int64_t rot, const XT* src, int64_t s0, int64_t s1,
               XT* dst, int64_t tokens, int64_t heads, int64_t d) {
  const int64_t half = rot / 2;
  at::parallel_for(0, tokens, is_parallel(tokens * heads * d) ? 1 : tokens, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* cs = cache + pos[t] * rot;
      for (int64_t h = 0; h < heads; ++h) {
        const XT* xh = src + t * s0 + h * s1;
        XT* oh = dst + (t * heads + h) * d;
        for (int64_t i = 0; i < half; i += 8) {
          const __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(cs + half + i);
          const __m256 x1 = load8(xh + i), x2 = load8(xh + half + i);
          store8(oh + i, _mm256_fmsub_ps(x1, c, _mm256_mul_ps(x2, s)));
          store8(oh + half + i, _mm256_fmadd_ps(x2, c, _mm256_mul_ps(x1, s)));
        }
        for (int64_t i = rot; i < d; ++i) oh[i] = xh[i];  // partial rotary: the rest passes through
      }
    }
  });
}

template <typename XT>
void silu_rows(const XT* x, XT* out, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, is_parallel(rows * d) ? 1 : rows, [&](int64_t r0, int64_t r1) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 a = load8(x + r * 2 * d + c), b = load8(x + r * 2 * d + d + c);
        const __m256 silu = _mm256_div_ps(a, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), a))));
        store8(out + r * d + c, _mm256_mul_ps(silu, b));
      }
  });
}

}  // namespace
}  // namespace mops
