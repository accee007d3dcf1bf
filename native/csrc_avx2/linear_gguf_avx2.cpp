// GGUF quantized matmul for small row counts on CPUs with AVX2 + FMA + F16C: the contract of the
// AVX-512 module's gguf_linear / gguf_dequantize (../csrc/linear_gguf.cpp), 8 lanes at a time.
//
// x is widened to fp32 once; all arithmetic is fp32, y rounded once to x's dtype.
//
// Grouped layout (Q8_0 / Q4_0 / Q4_1, 16 rows side by side): as the AVX-512 kernel, each 16-row
// group as two 8-lane halves, lane r of a half being one output row. The integers at one position
// of 8 rows are widened, converted and multiplied by the broadcast x value; per block y += d * s
// (+ m * the block's x sum for Q4_1).
//
// Rows layout (every type): 4 weight rows at a time against every x row (2 at a time), each
// block's 8-value chunks dequantised to exactly the reference's float32 values (fma(a, q, b) or
// a * q with the block's float32 scale terms, the product exact: ../csrc/gguf_blocks.h), fp32
// FMAs, one horizontal sum per output.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "../csrc/dispatch.h"
#include "../csrc/gguf_blocks.h"
#include "../csrc/step_parts.h"
#include "vec_avx2.h"

namespace mops {
namespace {

using namespace gguf;

constexpr int64_t kRows = 4;  // weight rows per block
constexpr int64_t kCols = 2;  // x rows per inner block
constexpr int64_t kAhead = 4;  // blocks of weight rows prefetched ahead
// One thread streams ~8 GB/s on a Zen 3: the AVX2 kernels' bound (linear_avx2.cpp).
constexpr int64_t kOneThreadMaxMacs = int64_t{1} << 17;

// 8 bytes at p, each shifted right by `shift` and masked to `mask`, as int32 lanes.
inline __m256i bits8(const uint8_t* p, int shift, int mask) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(shift)), _mm256_set1_epi32(mask));
}

// Each decoder reads one block; chunk(i) is its values 8i .. 8i + 7 in float32.
struct Q8_0 {
  static constexpr int kBlock = 32, kBytes = 34, kChunks = 4;
  __m256 d;
  const uint8_t* q;
  explicit Q8_0(const uint8_t* b) : d(_mm256_set1_ps(f16(b))), q(b + 2) {}
  __m256 chunk(int i) const {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
  }
};

// Q4_1 (w = d q + m) and Q4_0 (w = d (q - 8) = d q - 8 d, exact). Chunks 0-1: the low nibbles of
// bytes 0-15; chunks 2-3: their high nibbles.
template <bool kMin>
struct Q4 {
  static constexpr int kBlock = 32, kBytes = kMin ? 20 : 18, kChunks = 4;
  __m256 d, m;
  const uint8_t* qs;
  explicit Q4(const uint8_t* b) : qs(b + (kMin ? 4 : 2)) {
    const float df = f16(b);
    d = _mm256_set1_ps(df);
    m = _mm256_set1_ps(kMin ? f16(b + 2) : -8.0f * df);
  }
  __m256 chunk(int i) const {
    return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(bits8(qs + 8 * (i & 1), 4 * (i >> 1), 0x0F)), m);
  }
};

struct Q4K {
  static constexpr int kBlock = 256, kBytes = 144, kChunks = 32;
  float a[8], b[8];
  const uint8_t* qs;
  explicit Q4K(const uint8_t* blk) : qs(blk + 16) { k_scales(blk, a, b); }
  __m256 chunk(int i) const {  // sub-block s = i / 4, its part i % 4
    const int s = i >> 2;
    const __m256 q = _mm256_cvtepi32_ps(bits8(qs + 32 * (s >> 1) + 8 * (i & 3), 4 * (s & 1), 0x0F));
    return _mm256_fmadd_ps(_mm256_set1_ps(a[s]), q, _mm256_set1_ps(b[s]));
  }
};

struct Q5K {
  static constexpr int kBlock = 256, kBytes = 176, kChunks = 32;
  float a[8], b[8];
  const uint8_t* blk;
  explicit Q5K(const uint8_t* p) : blk(p) { k_scales(p, a, b); }
  __m256 chunk(int i) const {
    const int s = i >> 2, part = i & 3;
    const __m256i nib = bits8(blk + 48 + 32 * (s >> 1) + 8 * part, 4 * (s & 1), 0x0F);
    const __m256i bit = bits8(blk + 16 + 8 * part, s, 1);
    const __m256 q = _mm256_cvtepi32_ps(_mm256_or_si256(nib, _mm256_slli_epi32(bit, 4)));
    return _mm256_fmadd_ps(_mm256_set1_ps(a[s]), q, _mm256_set1_ps(b[s]));
  }
};

struct Q6K {
  static constexpr int kBlock = 256, kBytes = 210, kChunks = 32;
  float a[16];
  const uint8_t* blk;
  explicit Q6K(const uint8_t* p) : blk(p) {
    const float d = f16(p + 208);
    for (int g = 0; g < 16; ++g) a[g] = d * static_cast<float>(static_cast<int8_t>(p[192 + g]));
  }
  __m256 chunk(int i) const {  // row of 32 r = i / 4 (half r / 4, t = r % 4), its part i % 4
    const int r = i >> 2, part = i & 3, half = r >> 2, t = r & 3;
    const __m256i low = bits8(blk + 64 * half + 32 * (t & 1) + 8 * part, 4 * (t >> 1), 0x0F);
    const __m256i high = bits8(blk + 128 + 32 * half + 8 * part, 2 * t, 3);
    const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
    return _mm256_mul_ps(_mm256_set1_ps(a[i >> 1]), _mm256_cvtepi32_ps(q));
  }
};

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

// sums[m * kRows + r] = dot(x row m, weight row r), m < MB; rows past nr repeat the last one.
template <typename D, int MB>
inline void dot_block(const float* x, int64_t K, const uint8_t* w, int64_t ldw, int64_t nr, float* sums,
                      const char* ahead, int64_t lines) {
  __m256 acc[MB][kRows];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_setzero_ps();
  const uint8_t* rows[kRows];
  for (int r = 0; r < kRows; ++r) rows[r] = w + std::min<int64_t>(r, nr - 1) * ldw;
  const int64_t nb = K / D::kBlock;
  int64_t line = 0, due = 0, next = nb;  // the lines spread evenly over the blocks, as linear_avx2.cpp
  for (int64_t b = 0; b < nb; ++b) {
    if (ahead != nullptr)
      for (due += lines; next <= due; next += nb) _mm_prefetch(ahead + 64 * line++, _MM_HINT_T0);
    const int64_t at = b * D::kBytes;
    const D dec[kRows] = {D(rows[0] + at), D(rows[1] + at), D(rows[2] + at), D(rows[3] + at)};
    for (int i = 0; i < D::kChunks; ++i) {
      __m256 wv[kRows];
      for (int r = 0; r < kRows; ++r) wv[r] = dec[r].chunk(i);
      const float* xb = x + b * D::kBlock + 8 * i;
      for (int m = 0; m < MB; ++m) {
        const __m256 xv = _mm256_loadu_ps(xb + m * K);
        for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) sums[m * kRows + r] = hsum8(acc[m][r]);
}

// Blocks [b0, b1) of kRows outputs of y [M, N] = xf [M, K] @ W^T (+ bias), W in the rows layout.
template <typename D, typename XT>
void gguf_row_blocks(const float* xf, const uint8_t* w, const XT* bias, XT* y, int64_t M, int64_t N, int64_t K,
                     int64_t b0, int64_t b1) {
  const int64_t ldw = K / D::kBlock * D::kBytes;
  const int64_t lines = (kRows * ldw + 63) / 64;
  float sums[kCols * kRows];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * kRows, nr = std::min<int64_t>(kRows, N - n0);
    const uint8_t* wb = w + n0 * ldw;
    const char* ahead = b + kAhead < b1 ? reinterpret_cast<const char*>(wb + kAhead * kRows * ldw) : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kCols) {
      const int64_t mb = std::min<int64_t>(kCols, M - m0);
      if (mb == 1)
        dot_block<D, 1>(xf + m0 * K, K, wb, ldw, nr, sums, m0 == 0 ? ahead : nullptr, lines);
      else
        dot_block<D, 2>(xf + m0 * K, K, wb, ldw, nr, sums, m0 == 0 ? ahead : nullptr, lines);
      for (int64_t m = 0; m < mb; ++m)
        for (int64_t r = 0; r < nr; ++r)
          y[(m0 + m) * N + n0 + r] =
              static_cast<XT>(sums[m * kRows + r] + (bias != nullptr ? static_cast<float>(bias[n0 + r]) : 0.0f));
    }
  }
}

template <typename D, typename XT>
void gguf_rows(const float* xf, const uint8_t* w, const XT* bias, XT* y, int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t grain = at::get_num_threads() > 1 && M * N * K >= kOneThreadMaxMacs ? 16 : blocks;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    gguf_row_blocks<D, XT>(xf, w, bias, y, M, N, K, b0, b1);
  });
}


// ---- grouped layout: 16 rows side by side, two halves of 8 lanes --------------------------------
template <int kType>
constexpr int64_t group_bytes() { return kGroup * (kType == kQ4_1 ? 20 : kType == kQ4_0 ? 18 : 34); }

// acc[m][h] (lane r: row 16g + 8h + r) += this group's sums for x rows m < MB (see the AVX-512
// kernel for the arguments). Q4: pair p, half h: 8 rows' byte pairs widened to 32-bit lanes, whose
// four nibbles are values 2p, 2p + 16, 2p + 1, 2p + 17 (Q4_0 minus 8); Q8_0: one position at a time.
template <int kType, int MB>
inline void group_block(const float* x, const float* xsum, int64_t K, const uint8_t* w, __m256 (&acc)[MB][2]) {
  constexpr int64_t kHead = kType == kQ4_1 ? 64 : 32;
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = w + b * group_bytes<kType>();
    const float* xb = x + b * 32;
    __m256 s[MB][2][2];
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < 2; ++h) s[m][h][0] = s[m][h][1] = _mm256_setzero_ps();
    if constexpr (kType == kQ8_0) {
      for (int j = 0; j < 32; j += 2)
        for (int c = 0; c < 2; ++c)  // constant chain indices: the sums stay in registers
          for (int h = 0; h < 2; ++h) {
            const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kHead + 16 * (j + c) + 8 * h));
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
            for (int m = 0; m < MB; ++m) s[m][h][c] = _mm256_fmadd_ps(_mm256_set1_ps(xb[m * K + j + c]), q, s[m][h][c]);
          }
    } else {
      for (int pr = 0; pr < 8; ++pr)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kHead + 32 * pr + 16 * h)));
          const int at[4] = {2 * pr, 2 * pr + 16, 2 * pr + 1, 2 * pr + 17};
          for (int c = 0; c < 4; ++c) {
            __m256i q = _mm256_and_si256(_mm256_srli_epi32(v, 4 * c), _mm256_set1_epi32(0x0F));
            if constexpr (kType == kQ4_0) q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
            const __m256 qf = _mm256_cvtepi32_ps(q);
            for (int m = 0; m < MB; ++m) s[m][h][c & 1] = _mm256_fmadd_ps(_mm256_set1_ps(xb[m * K + at[c]]), qf, s[m][h][c & 1]);
          }
        }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
      for (int m = 0; m < MB; ++m) acc[m][h] = _mm256_fmadd_ps(d, _mm256_add_ps(s[m][h][0], s[m][h][1]), acc[m][h]);
      if constexpr (kType == kQ4_1) {
        const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * h)));
        for (int m = 0; m < MB; ++m) acc[m][h] = _mm256_fmadd_ps(mins, _mm256_set1_ps(xsum[m * nb + b]), acc[m][h]);
      }
    }
  }
}

template <int kType, int MB, typename XT>
inline void group_rows(const float* x, const float* xsum, int64_t K, const uint8_t* w, const XT* bias, XT* y,
                       int64_t N) {
  __m256 acc[MB][2];
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < 2; ++h) acc[m][h] = bias != nullptr ? load8(bias + 8 * h) : _mm256_setzero_ps();
  group_block<kType, MB>(x, xsum, K, w, acc);
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < 2; ++h) store8(y + m * N + 8 * h, acc[m][h]);
}

// Each 32-value block's sum of the x rows (Q4_1's min term): xsum [M * K / 32].
inline void block_sums(const float* xf, int64_t n, float* xsum) {
  for (int64_t i = 0; i < n; ++i)
    xsum[i] = hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xf + i * 32), _mm256_loadu_ps(xf + i * 32 + 8)),
                                  _mm256_add_ps(_mm256_loadu_ps(xf + i * 32 + 16), _mm256_loadu_ps(xf + i * 32 + 24))));
}

// Groups [g0, g1) of 16 outputs of y [M, N] = xf [M, K] @ W^T (+ bias), W grouped; xsum: the x
// rows' block sums (Q4_1; else unused).
template <int kType, typename XT>
void grouped_groups(const float* xf, const float* xsum, const uint8_t* w, const XT* bias, XT* y, int64_t M,
                    int64_t N, int64_t K, int64_t g0, int64_t g1) {
  const int64_t nb = K / 32, gbytes = nb * group_bytes<kType>();
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m0 = 0; m0 < M; m0 += kCols) {
      const float* sm = xsum + (kType == kQ4_1 ? m0 * nb : 0);
      const XT* bg = bias != nullptr ? bias + g * kGroup : nullptr;
      if (M - m0 == 1)
        group_rows<kType, 1>(xf + m0 * K, sm, K, w + g * gbytes, bg, y + m0 * N + g * kGroup, N);
      else
        group_rows<kType, 2>(xf + m0 * K, sm, K, w + g * gbytes, bg, y + m0 * N + g * kGroup, N);
    }
}

template <int kType, typename XT>
void grouped_linear(const float* xf, const uint8_t* w, const XT* bias, XT* y, int64_t M, int64_t N, int64_t K) {
  const int64_t nb = K / 32, groups = N / kGroup;
  std::vector<float> xsum(kType == kQ4_1 ? M * nb : 0);
  block_sums(xf, static_cast<int64_t>(xsum.size()), xsum.data());
  const int64_t grain = at::get_num_threads() > 1 && M * N * K >= kOneThreadMaxMacs ? 16 : groups;
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    grouped_groups<kType, XT>(xf, xsum.data(), w, bias, y, M, N, K, g0, g1);
  });
}

// One grouped block's half h (rows 8h .. 8h + 7) dequantised: tile[j] lane r = value j of row
// 8h + r, exactly the reference's float32 (one rounding).
template <int kType>
inline void group_tile(const uint8_t* p, int h, __m256 (&tile)[32]) {
  constexpr int64_t kHead = kType == kQ4_1 ? 64 : 32;
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
  const __m256 m = kType == kQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * h)))
                                  : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
  if constexpr (kType == kQ8_0) {
    for (int j = 0; j < 32; ++j)
      tile[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                     _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kHead + 16 * j + 8 * h)))));
  } else {  // pair j: values 2j, 2j + 16, 2j + 1, 2j + 17
    for (int j = 0; j < 8; ++j) {
      const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kHead + 32 * j + 16 * h)));
      const int at[4] = {2 * j, 2 * j + 16, 2 * j + 1, 2 * j + 17};
      for (int c = 0; c < 4; ++c)
        tile[at[c]] = _mm256_fmadd_ps(
            d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4 * c), _mm256_set1_epi32(0x0F))), m);
    }
  }
}

// m[i] lane j -> m[j] lane i.
inline void transpose8(__m256 (&m)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(m[i], m[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(m[i], m[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    m[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    m[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// out [N, K] of a grouped weight, through 8 x 8 transposes of each block half's tile.
template <int kType, typename OT>
void grouped_dequantize(const uint8_t* w, OT* out, int64_t N, int64_t K) {
  const int64_t nb = K / 32;
  at::parallel_for(0, N / kGroup, 1, [&](int64_t g0, int64_t g1) {
    __m256 tile[32];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int h = 0; h < 2; ++h) {
          group_tile<kType>(w + (g * nb + b) * group_bytes<kType>(), h, tile);
          for (int q = 0; q < 4; ++q) {  // values 8q .. 8q + 7 of the 8 rows
            __m256 t[8];
            for (int j = 0; j < 8; ++j) t[j] = tile[8 * q + j];
            transpose8(t);
            for (int r = 0; r < 8; ++r) store8(out + (g * kGroup + 8 * h + r) * K + b * 32 + 8 * q, t[r]);
          }
        }
  });
}

template <typename F>
bool with_grouped_type(int64_t type, F&& f) {
  switch (type) {
    case kQ8_0: f(std::integral_constant<int, kQ8_0>{}); return true;
    case kQ4_0: f(std::integral_constant<int, kQ4_0>{}); return true;
    case kQ4_1: f(std::integral_constant<int, kQ4_1>{}); return true;
    default: return false;
  }
}

}  // namespace

std::optional<at::Tensor> gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type,
                                      const std::optional<at::Tensor>& bias) {
  if (x.dim() != 2 || w.scalar_type() != at::kByte || !w.is_contiguous() || !x.device().is_cpu())
    return std::nullopt;
  const int64_t M = x.size(0), K = x.size(1);
  const Layout layout = check_weight(static_cast<int>(type), w, K);
  const int64_t N = layout.rows;
  if (M == 0 || N == 0) return std::nullopt;
  if (bias && (bias->scalar_type() != x.scalar_type() || bias->numel() != N || !bias->is_contiguous()))
    return std::nullopt;
  const auto xc = x.contiguous();
  const auto xf = xc.scalar_type() == at::kFloat ? xc : xc.to(at::kFloat);
  auto y = at::empty({M, N}, xc.options());
  const bool done = with_float_type(x.scalar_type(), [&](auto xt) {
    using XT = decltype(xt);
    const XT* b = bias ? bias->data_ptr<XT>() : nullptr;
    if (layout.grouped) {
      with_grouped_type(type, [&](auto kind) {
        grouped_linear<decltype(kind)::value, XT>(xf.data_ptr<float>(), w.data_ptr<uint8_t>(), b, y.data_ptr<XT>(), M, N, K);
      });
      return;
    }
    with_decoder(type, [&](auto tag) {
      using D = typename decltype(tag)::type;
      gguf_rows<D, XT>(xf.data_ptr<float>(), w.data_ptr<uint8_t>(), b, y.data_ptr<XT>(), M, N, K);
    });
  });
  if (!done) return std::nullopt;
  return y;
}

// The AVX-512 module's contract, rows ([N, K]) only: this build has no packed bf16 matmul.
bool gguf_dequantize(const at::Tensor& w, int64_t type, at::Tensor& out) {
  if (w.scalar_type() != at::kByte || !w.is_contiguous() || !out.is_contiguous() || out.dim() != 2) return false;
  const int64_t K = out.size(1);
  const Layout layout = check_weight(static_cast<int>(type), w, K);
  const int64_t N = layout.rows;
  if (out.size(0) != N) throw std::invalid_argument("gguf_dequantize: out has " + std::to_string(out.size(0)) +
                                                    " rows; the weight " + std::to_string(N));
  return with_float_type(out.scalar_type(), [&](auto ot) {
    using OT = decltype(ot);
    if (layout.grouped) {
      with_grouped_type(type, [&](auto kind) {
        grouped_dequantize<decltype(kind)::value, OT>(w.data_ptr<uint8_t>(), out.data_ptr<OT>(), N, K);
      });
      return;
    }
    with_decoder(type, [&](auto tag) {
      using D = typename decltype(tag)::type;
      const int64_t ldw = K / D::kBlock * D::kBytes;
      const uint8_t* wp = w.data_ptr<uint8_t>();
      OT* op = out.data_ptr<OT>();
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t b = 0; b < K / D::kBlock; ++b) {
            const D dec(wp + n * ldw + b * D::kBytes);
            for (int i = 0; i < D::kChunks; ++i) store8(op + n * K + b * D::kBlock + 8 * i, dec.chunk(i));
          }
      });
    });
  });
}

namespace parts {

void gguf_linear_rows(int64_t type, bool grouped, const bf16* x, const uint8_t* w, const bf16* bias, bf16* y,
                      int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  thread_local std::vector<float> xf, xsum;
  xf.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(x[i]);
  if (grouped) {
    xsum.resize(type == kQ4_1 ? M * (K / 32) : 0);
    block_sums(xf.data(), static_cast<int64_t>(xsum.size()), xsum.data());
    with_grouped_type(type, [&](auto kind) {
      grouped_groups<decltype(kind)::value, bf16>(xf.data(), xsum.data(), w, bias, y, M, N, K, n0 / kGroup,
                                                  n1 / kGroup);
    });
    return;
  }
  with_decoder(type, [&](auto tag) {
    using D = typename decltype(tag)::type;
    gguf_row_blocks<D, bf16>(xf.data(), w, bias, y, M, N, K, n0 / kRows, (n1 + kRows - 1) / kRows);
  });
}

}  // namespace parts
}  // namespace mops
