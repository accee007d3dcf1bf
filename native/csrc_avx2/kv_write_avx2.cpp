// KV cache write (reshape-and-cache) with optional int8 quantisation, AVX2: the int8
// quantisation of one row; everything else is ../csrc/kv_write_common.h's (see there).
#include <immintrin.h>

#include <cstdint>

namespace mops {
constexpr int64_t kKvLanes = 8;
}  // namespace mops

#include "../csrc/kv_write_common.h"
#include "vec_avx2.h"

namespace mops {
namespace {

template <typename ST>
void quantize_row(const ST* x, int64_t d, int8_t* q, float* scale) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, load8(x + c)));
  const float absmax = hmax8(vmax);
  const __m256 inv = _mm256_set1_ps(absmax > 0.0f ? 127.0f / absmax : 0.0f);
  for (int64_t c = 0; c < d; c += 8) {
    __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + c), inv));  // nearest even
    r = _mm256_max_epi32(_mm256_min_epi32(r, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
    const __m128i r16 = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + c), _mm_packs_epi16(r16, r16));
  }
  *scale = absmax / 127.0f;
}

}  // namespace
}  // namespace mops
