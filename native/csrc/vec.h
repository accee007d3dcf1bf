// AVX-512 helpers shared by the kernels: 16-lane loads of fp32 / bf16 / fp16 / int8 as fp32,
// stores with round-to-nearest-even, and a vector exp. Needs AVX512F/BW/VL/DQ only (no
// AVX512_BF16), so any AVX-512 x86 CPU that torch runs at "AVX512" capability can use it.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace mops {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 load16(const int8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// fp32 -> bf16, round to nearest even, NaN kept quiet (as c10::BFloat16 does).
inline void store16(c10::BFloat16* p, __m512 v) {
  __m512i x = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// exp(x) = 2^n * e^f, n = round(x log2 e), f = x - n ln2 (Cody-Waite, |f| <= ln2 / 2);
// degree-6 Taylor of e^f (relative error ~1.2e-7).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // below: exp underflows to 0 anyway
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Sums of 16 vectors at once: result lane i = sum of a[i]'s 16 lanes (a transpose-and-add tree:
// ~3 instructions per vector instead of ~10 for a horizontal reduction each).
inline __m512 sum16x16(const __m512 (&a)[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a2i: lanes 0,2 | a2i+1: lanes 1,3] partials
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: lane-local sums of a4i .. a4i+3
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Across 128-bit lanes: pair lanes (0,1) and (2,3), twice.
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// m[i] lane j -> m[j] lane i (32-bit lanes).
inline void transpose16x16(__m512i (&m)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    m[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    m[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    m[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    m[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // m[4q + r], 128-bit block L: column 4L + r, rows 4q .. 4q + 3; gather each column's blocks
  for (int r = 0; r < 4; ++r) {
    t[r] = _mm512_shuffle_i32x4(m[r], m[4 + r], 0x88);           // blocks 0, 2 of rows 0-3, 4-7
    t[4 + r] = _mm512_shuffle_i32x4(m[r], m[4 + r], 0xDD);       // blocks 1, 3
    t[8 + r] = _mm512_shuffle_i32x4(m[8 + r], m[12 + r], 0x88);  // rows 8-11, 12-15
    t[12 + r] = _mm512_shuffle_i32x4(m[8 + r], m[12 + r], 0xDD);
  }
  for (int r = 0; r < 4; ++r) {
    m[r] = _mm512_shuffle_i32x4(t[r], t[8 + r], 0x88);
    m[8 + r] = _mm512_shuffle_i32x4(t[r], t[8 + r], 0xDD);
    m[4 + r] = _mm512_shuffle_i32x4(t[4 + r], t[12 + r], 0x88);
    m[12 + r] = _mm512_shuffle_i32x4(t[4 + r], t[12 + r], 0xDD);
  }
}

}  // namespace mops
