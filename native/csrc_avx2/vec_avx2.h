// AVX2 + FMA + F16C helpers shared by the mooncake_ops_native_avx2 kernels: 8-lane loads of
// fp32 / bf16 / fp16 / int8 as fp32, stores rounded to the element type, horizontal sums and
// maxima, lane masks and a vector exp.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace mops {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Lanes i < n (n may be <= 0 or >= 8) all ones, the rest zero.
inline __m256 lanes_below(int64_t n) {
  const int32_t k = static_cast<int32_t>(std::clamp<int64_t>(n, 0, 8));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// exp(x) = 2^n e^f, n = round(x log2 e), f = x - n ln2 (Cody-Waite), degree-6 Taylor of e^f
// (relative error ~1.2e-7). x is clamped to [-87, 88] so that 2^n stays a normal float: a score
// more than 87 below the running max adds ~1.6e-38 instead of ~0 (to a sum that is >= 1: the
// AVX-512 exp underflows there instead), and callers zero the padded lanes themselves.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), f);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Lane i of the result = the sum of a[i]'s 8 lanes.
inline __m256 sum8x8(const __m256 (&a)[8]) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // t0 = [a0..a3 partial sums of lanes 0-3 | of lanes 4-7], t1 likewise for a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// fp32 -> bf16, round to nearest even, NaN kept quiet (as c10::BFloat16 does).
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // 8 x 32-bit lanes (values < 2^16) -> 8 x 16-bit: pack within 128-bit halves, then gather
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

}  // namespace mops
