// Per-token layer ops in one pass each, AVX-512: RMSNorm (+ fused residual add), NeoX RoPE,
// SiLU-and-mul. All compute in fp32 and round once to the input dtype. Rows are contiguous
// [rows, hidden]. The entries (checks, dispatch) are layer_ops_common.h's.
#include <cmath>
#include <cstdint>

namespace mops {
constexpr int64_t kLayerLanes = 16;
}  // namespace mops

#include "layer_ops_common.h"
#include "vec.h"

namespace mops {
namespace {

template <typename XT, typename WT>
void rms_rows(const XT* x, const XT* res, const WT* w, XT* out, XT* res_out, int64_t rows,
              int64_t hidden, float eps) {
  at::parallel_for(0, rows, is_parallel(rows * hidden) ? 1 : rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const XT* xr = x + r * hidden;
      if (res != nullptr) {  // h = round(x + residual): the residual stream keeps x's dtype
        for (int64_t c = 0; c < hidden; c += 16)
          store16(res_out + r * hidden + c, _mm512_add_ps(load16(xr + c), load16(res + r * hidden + c)));
        xr = res_out + r * hidden;
      }
      __m512 ss = _mm512_setzero_ps();
      for (int64_t c = 0; c < hidden; c += 16) {
        const __m512 v = load16(xr + c);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const __m512 rstd = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / hidden + eps));
      for (int64_t c = 0; c < hidden; c += 16)
        store16(out + r * hidden + c, _mm512_mul_ps(_mm512_mul_ps(load16(xr + c), rstd), load16(w + c)));
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
        for (int64_t i = 0; i < half; i += 16) {
          const __m512 c = _mm512_loadu_ps(cs + i), s = _mm512_loadu_ps(cs + half + i);
          const __m512 x1 = load16(xh + i), x2 = load16(xh + half + i);
          store16(oh + i, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)));
          store16(oh + half + i, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)));
        }
        for (int64_t i = rot; i < d; ++i) oh[i] = xh[i];  // partial rotary: the rest passes through
      }
    }
  });
}

template <typename XT>
void silu_rows(const XT* x, XT* out, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, is_parallel(rows * d) ? 1 : rows, [&](int64_t r0, int64_t r1) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < d; c += 16) {
        const __m512 a = load16(x + r * 2 * d + c), b = load16(x + r * 2 * d + d + c);
        const __m512 silu = _mm512_div_ps(a, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
        store16(out + r * d + c, _mm512_mul_ps(silu, b));
      }
  });
}

}  // namespace
}  // namespace mops
