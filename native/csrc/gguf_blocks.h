// GGUF block formats both builds' quantized matmuls read (linear_gguf.cpp,
// ../csrc_avx2/linear_gguf_avx2.cpp): ggml's type numbers, block sizes, and the scalar parts of a
// block (fp16 scales, the 6-bit scales of Q4_K / Q5_K). The layouts are drawn in
// mooncake_ops/gguf_quants.py, whose PyTorch dequantisation is the kernels' reference.
//
// A packed weight is uint8 and 3-D, in one of two layouts (drawn in gguf_quants.py):
//   rows     [N, K / block_size, block_bytes]: the file's bytes as they are (every type);
//   grouped  [N / 16, K / 32, 16 * block_bytes]: Q8_0 / Q4_0 / Q4_1, 16 rows side by side (per
//            block: the 16 rows' fp16 d, Q4_1's 16 m, then the quant bytes position by position). Every value dequantises as fma(a, q, b) of two float32
// scale terms and a small integer (the product a * q is exact in float32), i.e. one rounding of
// the exact formula: the same float32 value the reference (and the gguf package) computes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace mops::gguf {

enum Type : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct Format {
  int block_size;
  int block_bytes;
};

// {0, 0} for a type no kernel reads.
inline Format format_of(int type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

// Q4_K / Q5_K: a * q + b per sub-block s of 32 values, a = d * sc[s], b = -(dmin * mn[s]), from
// d, dmin and the 12 bytes of eight 6-bit scales and mins (layout: gguf_quants._k_scales).
inline void k_scales(const uint8_t* block, float (&a)[8], float (&b)[8]) {
  const float d = f16(block), dmin = f16(block + 2);
  const uint8_t* s = block + 4;
  for (int j = 0; j < 4; ++j) {
    a[j] = d * static_cast<float>(s[j] & 0x3F);
    b[j] = -(dmin * static_cast<float>(s[j + 4] & 0x3F));
    a[j + 4] = d * static_cast<float>((s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30));
    b[j + 4] = -(dmin * static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30)));
  }
}

constexpr int64_t kGroup = 16;  // rows side by side in the grouped layout

inline bool is_groupable(int type) { return type == kQ4_0 || type == kQ4_1 || type == kQ8_0; }

// The weight's layout, checked against its type and x's K; throws std::invalid_argument
// (ValueError) for a type without a kernel or a weight of another shape.
struct Layout {
  Format format;
  bool grouped;
  int64_t rows;  // N
};

inline Layout check_weight(int type, const at::Tensor& w, int64_t K) {
  const Format f = format_of(type);
  if (f.block_size == 0)
    throw std::invalid_argument("gguf_linear: GGUF type " + std::to_string(type) +
                                " has no kernel; allowed: Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), "
                                "Q5_K (13), Q6_K (14)");
  const bool grouped = w.dim() == 3 && is_groupable(type) && w.size(2) == kGroup * f.block_bytes;
  if (w.dim() != 3 || (!grouped && w.size(2) != f.block_bytes))
    throw std::invalid_argument("gguf_linear: a weight of GGUF type " + std::to_string(type) + " is uint8 [N, K / " +
                                std::to_string(f.block_size) + ", " + std::to_string(f.block_bytes) +
                                (is_groupable(type) ? "] or [N / 16, K / 32, " + std::to_string(kGroup * f.block_bytes)
                                                    : std::string()) + "]");
  if (w.size(1) * f.block_size != K)
    throw std::invalid_argument("gguf_linear: x has " + std::to_string(K) + " features; the weight's " +
                                std::to_string(w.size(1)) + " blocks per row hold " +
                                std::to_string(w.size(1) * f.block_size));
  return {f, grouped, w.size(0) * (grouped ? kGroup : 1)};
}

}  // namespace mops::gguf
