// KV cache write (reshape-and-cache) with optional int8 quantisation, AVX-512: the int8
// quantisation of one row; everything else is kv_write_common.h's (see there for the method).
#include <cstdint>

namespace mops {
constexpr int64_t kKvLanes = 16;
}  // namespace mops

#include "kv_write_common.h"
#include "vec.h"

namespace mops {
namespace {

template <typename ST>
void quantize_row(const ST* x, int64_t d, int8_t* q, float* scale) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x + c)));
  const float absmax = _mm512_reduce_max_ps(vmax);
  const __m512 inv = _mm512_set1_ps(absmax > 0.0f ? 127.0f / absmax : 0.0f);
  for (int64_t c = 0; c < d; c += 16) {
    __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + c), inv));  // nearest even
    r = _mm512_max_epi32(_mm512_min_epi32(r, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c), _mm512_cvtepi32_epi8(r));
  }
  *scale = absmax / 127.0f;
}

}  // namespace
}  // namespace mops
