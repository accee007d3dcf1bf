// AVX-512 decoders of the GGUF blocks in the rows layout (gguf_blocks.h), and the vector helpers
// the grouped kernels share (linear_gguf.cpp). Each decoder reads one block; chunk(i) is its
// values 16i .. 16i + 15, exactly the reference's float32 (mooncake_ops/gguf_quants.py): the
// 4-bit types look each nibble up in the block's table a * i + b (vpermps reads a lane's low 4
// bits), the others convert the integers and multiply (the products are exact).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "gguf_blocks.h"

namespace mops::gguf {

inline __m512i load_bytes16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m512 iota16() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

struct Q8_0 {
  static constexpr int kBlock = 32, kBytes = 34, kChunks = 2;
  __m512 d;
  const uint8_t* q;
  explicit Q8_0(const uint8_t* b) : d(_mm512_set1_ps(f16(b))), q(b + 2) {}
  __m512 chunk(int i) const {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), d);
  }
};

// Q4_1 (w = d q + m) and Q4_0 (w = d (q - 8) = d q - 8 d, exact).
template <bool kMin>
struct Q4 {
  static constexpr int kBlock = 32, kBytes = kMin ? 20 : 18, kChunks = 2;
  __m512 table;
  __m512i v;
  explicit Q4(const uint8_t* b) {
    const float d = f16(b), m = kMin ? f16(b + 2) : -8.0f * d;
    table = _mm512_fmadd_ps(_mm512_set1_ps(d), iota16(), _mm512_set1_ps(m));
    v = load_bytes16(b + (kMin ? 4 : 2));
  }
  __m512 chunk(int i) const { return _mm512_permutexvar_ps(i == 0 ? v : _mm512_srli_epi32(v, 4), table); }
};

struct Q4K {
  static constexpr int kBlock = 256, kBytes = 144, kChunks = 16;
  float a[8], b[8];
  const uint8_t* qs;
  explicit Q4K(const uint8_t* blk) : qs(blk + 16) { k_scales(blk, a, b); }
  __m512 chunk(int i) const {  // sub-block s = i / 2, its half i % 2
    const int s = i >> 1;
    const __m512i v = _mm512_srlv_epi32(load_bytes16(qs + 32 * (s >> 1) + 16 * (i & 1)), _mm512_set1_epi32(4 * (s & 1)));
    return _mm512_permutexvar_ps(v, _mm512_fmadd_ps(_mm512_set1_ps(a[s]), iota16(), _mm512_set1_ps(b[s])));
  }
};

struct Q5K {
  static constexpr int kBlock = 256, kBytes = 176, kChunks = 16;
  float a[8], b[8];
  const uint8_t* blk;
  explicit Q5K(const uint8_t* p) : blk(p) { k_scales(p, a, b); }
  __m512 chunk(int i) const {
    const int s = i >> 1, h = i & 1;
    const __m512i nib = _mm512_and_si512(
        _mm512_srlv_epi32(load_bytes16(blk + 48 + 32 * (s >> 1) + 16 * h), _mm512_set1_epi32(4 * (s & 1))),
        _mm512_set1_epi32(0x0F));
    const __m512i bit = _mm512_and_si512(_mm512_srlv_epi32(load_bytes16(blk + 16 + 16 * h), _mm512_set1_epi32(s)),
                                         _mm512_set1_epi32(1));
    const __m512 q = _mm512_cvtepi32_ps(_mm512_or_si512(nib, _mm512_slli_epi32(bit, 4)));
    return _mm512_fmadd_ps(_mm512_set1_ps(a[s]), q, _mm512_set1_ps(b[s]));
  }
};

struct Q6K {
  static constexpr int kBlock = 256, kBytes = 210, kChunks = 16;
  float a[16];
  const uint8_t* blk;
  explicit Q6K(const uint8_t* p) : blk(p) {
    const float d = f16(p + 208);
    for (int g = 0; g < 16; ++g) a[g] = d * static_cast<float>(static_cast<int8_t>(p[192 + g]));
  }
  __m512 chunk(int i) const {  // row of 32 r = i / 2 (half r / 4, t = r % 4), its half i % 2
    const int r = i >> 1, h = i & 1, half = r >> 2, t = r & 3;
    const __m512i low = _mm512_and_si512(
        _mm512_srlv_epi32(load_bytes16(blk + 64 * half + 32 * (t & 1) + 16 * h), _mm512_set1_epi32(4 * (t >> 1))),
        _mm512_set1_epi32(0x0F));
    const __m512i high = _mm512_and_si512(
        _mm512_srlv_epi32(load_bytes16(blk + 128 + 32 * half + 16 * h), _mm512_set1_epi32(2 * t)),
        _mm512_set1_epi32(3));
    const __m512i q = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
    return _mm512_mul_ps(_mm512_set1_ps(a[i]), _mm512_cvtepi32_ps(q));
  }
};

// f(std::type_identity<Decoder>{}) for a GGUF type; false for a type without one.
template <typename F>
bool with_decoder(int64_t type, F&& f) {
  switch (type) {
    case kQ8_0: f(std::type_identity<Q8_0>{}); return true;
    case kQ4_0: f(std::type_identity<Q4<false>>{}); return true;
    case kQ4_1: f(std::type_identity<Q4<true>>{}); return true;
    case kQ4_K: f(std::type_identity<Q4K>{}); return true;
    case kQ5_K: f(std::type_identity<Q5K>{}); return true;
    case kQ6_K: f(std::type_identity<Q6K>{}); return true;
    default: return false;
  }
}

}  // namespace mops::gguf
