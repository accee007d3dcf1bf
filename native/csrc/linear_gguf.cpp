// GGUF quantized matmul for small row counts (decode): y = x @ W^T + bias, W a packed GGUF weight
// (gguf_blocks.h) dequantised in registers. x (fp32 / bf16 / fp16) is widened to fp32 once; all
// arithmetic is fp32, y rounded once to x's dtype. Each weight byte is read once per call (per 4
// x rows the values are decoded again from cache).
//
// Grouped layout (Q8_0 / Q4_0 / Q4_1, 16 rows side by side): lane r of every vector is output row
// 16g + r. Per block, the 16 rows' integers at one position are one 16-byte load, widened and
// converted (the 4-bit ones by a lookup in the constant table 0..15, or -8..7 for Q4_0: vpermps
// reads each lane's low 4 bits, so the high nibble needs only a shift), and multiplied by the
// broadcast x value: s = sum_j x_j q_j per row, in 4 independent chains. Then y += d * s, and for
// Q4_1 y += m * sum_j x_j (the block's x sum, computed once per call): the same real number as
// x . (d q + m), the products regrouped (the rounding analysis is in mooncake_ops.gguf_linear).
// About 6 vector instructions per 32 weights, no horizontal sums.
//
// Rows layout (every type; the K-quants always): 4 weight rows at a time, each block's 16-value
// chunks dequantised to exactly the float32 values of the reference (one rounding of a * q + b):
// the 4-bit types build the block's table a * i + b (i = 0..15) and look each nibble up in it,
// Q8_0 / Q5_K / Q6_K convert the integers and multiply; then fp32 FMAs against x and one
// horizontal sum per output. Larger row counts are compute-bound: the Python side dequantises
// (gguf_dequantize here) and runs a dense matmul.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "dispatch.h"
#include "gguf_blocks.h"
#include "gguf_decoders.h"
#include "step_parts.h"
#include "vec.h"

namespace mops {
namespace {

using namespace gguf;

constexpr int64_t kRows = 4;  // weight rows per block
constexpr int64_t kCols = 4;  // x rows per inner block
constexpr int64_t kAhead = 4;  // blocks of weight rows prefetched ahead
// Fewer multiply-adds run on the calling thread (see mooncake_ops.linear.ONE_THREAD_MAX_MACS).
constexpr int64_t kOneThreadMaxMacs = int64_t{1} << 21;

// sums[m * kRows + r] = dot(x row m, weight row r), m < MB; rows past nr repeat the last one
// (their sums are never stored). `ahead` (or null): `lines` cache lines to prefetch, spread over
// the blocks (the rows are short: the hardware prefetcher gets no run to lock on to).
template <typename D, int MB>
inline void dot_block(const float* x, int64_t K, const uint8_t* w, int64_t ldw, int64_t nr, float* sums,
                      const char* ahead, int64_t lines) {
  __m512 acc[MB][kRows];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint8_t* rows[kRows];
  for (int r = 0; r < kRows; ++r) rows[r] = w + std::min<int64_t>(r, nr - 1) * ldw;
  const int64_t nb = K / D::kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    if (ahead != nullptr)
      for (int64_t line = b * lines / nb; line < (b + 1) * lines / nb; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
    const int64_t at = b * D::kBytes;
    const D dec[kRows] = {D(rows[0] + at), D(rows[1] + at), D(rows[2] + at), D(rows[3] + at)};
    for (int i = 0; i < D::kChunks; ++i) {
      __m512 wv[kRows];
      for (int r = 0; r < kRows; ++r) wv[r] = dec[r].chunk(i);
      const float* xb = x + b * D::kBlock + 16 * i;
      for (int m = 0; m < MB; ++m) {
        const __m512 xv = _mm512_loadu_ps(xb + m * K);
        for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) sums[m * kRows + r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <typename D>
void dot_rows(const float* x, int64_t mb, int64_t K, const uint8_t* w, int64_t ldw, int64_t nr, float* sums,
              const char* ahead, int64_t lines) {
  switch (mb) {
    case 1: dot_block<D, 1>(x, K, w, ldw, nr, sums, ahead, lines); break;
    case 2: dot_block<D, 2>(x, K, w, ldw, nr, sums, ahead, lines); break;
    case 3: dot_block<D, 3>(x, K, w, ldw, nr, sums, ahead, lines); break;
    default: dot_block<D, 4>(x, K, w, ldw, nr, sums, ahead, lines); break;
  }
}

// Weight row blocks [b0, b1) (kRows rows each) of the rows-layout matmul.
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
      dot_rows<D>(xf + m0 * K, mb, K, wb, ldw, nr, sums, m0 == 0 ? ahead : nullptr, lines);
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
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { gguf_row_blocks<D, XT>(xf, w, bias, y, M, N, K, b0, b1); });
}


// ---- grouped layout: 16 rows side by side -------------------------------------------------------
template <int kType>
constexpr int64_t group_bytes() { return kGroup * (kType == kQ4_1 ? 20 : kType == kQ4_0 ? 18 : 34); }
template <int kType>
constexpr int64_t group_head() { return kType == kQ4_1 ? 64 : 32; }  // the 16 rows' fp16 d (and m)

// A grouped block's quant sums, lane r = row r of the group: s = sum_j x_j q_j (q - 8 for Q4_0),
// in 4 chains per x row (sums(m) adds them): FMAs over the integers converted to fp32.
template <int kType, int MB>
struct GroupSums {
  __m512 s[MB][4];
  GroupSums() {
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < 4; ++c) s[m][c] = _mm512_setzero_ps();
  }
  __m512 sums(int m) const { return _mm512_add_ps(_mm512_add_ps(s[m][0], s[m][1]), _mm512_add_ps(s[m][2], s[m][3])); }

  // x: block b's 32 values of each x row (rows K apart).
  void run(const uint8_t* qs, const float* x, int64_t K) {
    if constexpr (kType == kQ8_0) {
      for (int j = 0; j < 32; j += 4)
        for (int c = 0; c < 4; ++c) {  // constant chain indices: the sums stay in registers
          const __m512 q = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * (j + c)))));
          for (int m = 0; m < MB; ++m) s[m][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + j + c]), q, s[m][c]);
        }
    } else {  // pair p: lane r = byte 2p | byte 2p + 1 << 8; their nibbles are values 2p, 2p + 16, 2p + 1, 2p + 17
      const __m512 table = kType == kQ4_0 ? _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f)) : iota16();
      for (int p = 0; p < 8; ++p) {
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p)));
        const __m512 q[4] = {_mm512_permutexvar_ps(v, table), _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table),
                             _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), table),
                             _mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), table)};
        const int at[4] = {2 * p, 2 * p + 16, 2 * p + 1, 2 * p + 17};
        for (int m = 0; m < MB; ++m)
          for (int c = 0; c < 4; ++c) s[m][c] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + at[c]]), q[c], s[m][c]);
      }
    }
  }
};

// Q4 with bf16 x on AVX512_BF16 (every function MOPS_GGUF_BF16, run after a CPU check): each
// 32-bit lane holds a row's byte pair; their nibbles become bf16 by a 16-entry lookup (vpermw),
// and vdpbf16ps adds q(2p) x(2p) + q(2p+1) x(2p+1) per row, the products exact in fp32 (bf16 x,
// 4-bit q), the sums fp32 (denormals flushed): ~3.5 instructions per 32 weights instead of 6.
#define MOPS_GGUF_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// word i = bf16 of i (Q4_1) or i - 8 (Q4_0), i < 16 (exact: small integers)
template <int kType>
__m512i bf16_table() {
  alignas(64) uint16_t t[32] = {};
  for (int i = 0; i < 16; ++i) {
    const float f = static_cast<float>(kType == kQ4_0 ? i - 8 : i);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    t[i] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(t);
}

// s[m][c] += the block's pair products; qs: the block's quant bytes, x: its 16 bf16 pairs per x
// row (rows `step` pairs apart).
template <int MB>
MOPS_GGUF_BF16 inline void q4_block_bf16(const uint8_t* qs, const uint32_t* x, int64_t step, __m512i table,
                                         __m512 (&s)[MB][4]) {
  for (int p = 0; p < 8; ++p) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p)));
    const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x0F)), table);
    const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
    const int c = 2 * (p & 1);
    for (int m = 0; m < MB; ++m) {
      s[m][c] = _mm512_dpbf16_ps(s[m][c], lo, (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * step + p])));
      s[m][c + 1] = _mm512_dpbf16_ps(s[m][c + 1], hi, (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * step + 8 + p])));
    }
  }
}

// One group's outputs for x rows m0 .. m0 + MB - 1 (as group_rows below, bf16 x and y).
template <int kType, int MB>
MOPS_GGUF_BF16 void group_rows_bf16(const uint32_t* pairs, const float* xsum, int64_t K, const uint8_t* w,
                                    const c10::BFloat16* bias, c10::BFloat16* y, int64_t N) {
  const int64_t nb = K / 32;
  const __m512i table = bf16_table<kType>();
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = bias != nullptr ? load16(bias) : _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = w + b * group_bytes<kType>();
    __m512 s[MB][4];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < 4; ++c) s[m][c] = _mm512_setzero_ps();
    q4_block_bf16<MB>(p + group_head<kType>(), pairs + b * 16, K / 2, table, s);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm512_fmadd_ps(d, _mm512_add_ps(_mm512_add_ps(s[m][0], s[m][1]), _mm512_add_ps(s[m][2], s[m][3])), acc[m]);
    if constexpr (kType == kQ4_1) {
      const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
      for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xsum[m * nb + b]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) store16(y + m * N, acc[m]);
}

// acc[m] (lane r: row 16g + r) += the group's sums for x rows m < MB: per block y += d * s, and for
// Q4_1 y += m * sum_j x_j (xsum: MB rows of K / 32 block sums).
template <int kType, int MB>
inline void group_block(const float* x, const float* xsum, int64_t K, const uint8_t* w, __m512 (&acc)[MB]) {
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = w + b * group_bytes<kType>();
    GroupSums<kType, MB> sums;
    sums.run(p + group_head<kType>(), x + b * 32, K);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(d, sums.sums(m), acc[m]);
    if constexpr (kType == kQ4_1) {
      const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
      for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xsum[m * nb + b]), acc[m]);
    }
  }
}

// The x a group reads: fp32 rows, or (bf16 path) the bf16 rows as pairs.
struct GroupX {
  const float* xf;
  const uint32_t* pairs;  // null: the fp32 path
  const float* xsum;
  int64_t K, nb;
};

template <int kType, int MB, typename XT>
inline void group_rows(const GroupX& gx, int64_t m0, const uint8_t* w, const XT* bias, XT* y, int64_t N) {
  const float* xsum = gx.xsum == nullptr ? nullptr : gx.xsum + m0 * gx.nb;
  if constexpr (kType != kQ8_0 && std::is_same_v<XT, c10::BFloat16>) {
    if (gx.pairs != nullptr) return group_rows_bf16<kType, MB>(gx.pairs + m0 * gx.K / 2, xsum, gx.K, w, bias, y, N);
  }
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = bias != nullptr ? load16(bias) : _mm512_setzero_ps();
  group_block<kType, MB>(gx.xf + m0 * gx.K, xsum, gx.K, w, acc);
  for (int m = 0; m < MB; ++m) store16(y + m * N, acc[m]);
}

// out[i] = the sum of fp32 x values 32i .. 32i + 31 (Q4_1's block sums of x), i < n.
inline void block_sums(const float* xf, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(xf + i * 32), _mm512_loadu_ps(xf + i * 32 + 16)));
}

// Groups [g0, g1) (16 output rows each) of the grouped-layout matmul.
template <int kType, typename XT>
void grouped_groups(const GroupX& gx, const uint8_t* w, const XT* bias, XT* y, int64_t M, int64_t N, int64_t g0,
                    int64_t g1) {
  const int64_t gbytes = gx.nb * group_bytes<kType>();
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m0 = 0; m0 < M; m0 += kCols) {
      const XT* bg = bias != nullptr ? bias + g * kGroup : nullptr;
      XT* yg = y + m0 * N + g * kGroup;
      switch (std::min<int64_t>(kCols, M - m0)) {
        case 1: group_rows<kType, 1>(gx, m0, w + g * gbytes, bg, yg, N); break;
        case 2: group_rows<kType, 2>(gx, m0, w + g * gbytes, bg, yg, N); break;
        case 3: group_rows<kType, 3>(gx, m0, w + g * gbytes, bg, yg, N); break;
        default: group_rows<kType, 4>(gx, m0, w + g * gbytes, bg, yg, N); break;
      }
    }
}

template <int kType, typename XT>
void grouped_linear(const float* xf, const void* xbf16, const uint8_t* w, const XT* bias, XT* y, int64_t M, int64_t N,
                    int64_t K) {
  const int64_t nb = K / 32, groups = N / kGroup;
  std::vector<float> xsum(kType == kQ4_1 ? M * nb : 0);
  block_sums(xf, static_cast<int64_t>(xsum.size()), xsum.data());
  const GroupX gx{xf, static_cast<const uint32_t*>(xbf16), xsum.empty() ? nullptr : xsum.data(), K, nb};
  const int64_t grain = at::get_num_threads() > 1 && M * N * K >= kOneThreadMaxMacs ? 16 : groups;
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) { grouped_groups<kType, XT>(gx, w, bias, y, M, N, g0, g1); });
}

// One grouped block dequantised: tile[j] lane r = value j of row r, exactly the reference's
// float32 (d (q - 8), d q + m, d q: one rounding).
template <int kType>
inline void group_tile(const uint8_t* p, __m512 (&tile)[32]) {
  const uint8_t* qs = p + group_head<kType>();
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512 m = kType == kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)))
                                  : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
  if constexpr (kType == kQ8_0) {
    for (int j = 0; j < 32; ++j)
      tile[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * j)))));
  } else {  // pair j: values 2j, 2j + 16, 2j + 1, 2j + 17
    for (int j = 0; j < 8; ++j) {
      const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j)));
      const int at[4] = {2 * j, 2 * j + 16, 2 * j + 1, 2 * j + 17};
      for (int c = 0; c < 4; ++c)
        tile[at[c]] = _mm512_fmadd_ps(
            d, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4 * c), _mm512_set1_epi32(0x0F))), m);
    }
  }
}

// bf16 bits of v (round to nearest even) in each 32-bit lane's low half; finite values only
// (a dequantised value is finite where the block's scales are).
inline __m512i bf16_bits(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
}

// out [N, K] (rows) or, for bf16 `packed`, the native bf16 matmul's layout [N / 16, K / 2, 16, 2]
// (linear_bf16.cpp: pair p of 16 output lanes), from a grouped weight.
template <int kType, typename OT>
void grouped_dequantize(const uint8_t* w, OT* out, int64_t N, int64_t K, bool packed) {
  const int64_t nb = K / 32;
  at::parallel_for(0, N / kGroup, 1, [&](int64_t g0, int64_t g1) {
    __m512 tile[32];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        group_tile<kType>(w + (g * nb + b) * group_bytes<kType>(), tile);
        if (packed) {  // pair p = values 2p, 2p + 1 of the 16 rows, one 32-bit lane per row
          auto* pairs = reinterpret_cast<uint32_t*>(out) + (g * (K / 2) + b * 16) * kGroup;
          for (int p = 0; p < 16; ++p)
            _mm512_storeu_si512(pairs + p * kGroup, _mm512_or_si512(bf16_bits(tile[2 * p]),
                                                                    _mm512_slli_epi32(bf16_bits(tile[2 * p + 1]), 16)));
          continue;
        }
        for (int half = 0; half < 2; ++half) {  // values 16 half .. + 15 of the 16 rows
          __m512i t[16];
          for (int j = 0; j < 16; ++j) t[j] = _mm512_castps_si512(tile[16 * half + j]);
          transpose16x16(t);  // t[r]: row r's 16 values
          for (int64_t r = 0; r < kGroup; ++r)
            store16(out + (g * kGroup + r) * K + b * 32 + 16 * half, _mm512_castsi512_ps(t[r]));
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

// x [M, K] (fp32 / bf16 / fp16), w a packed weight of GGUF type `type` (either layout),
// bias [N] of x's dtype or None. None when the call does not fit (other dtypes, a strided
// weight or bias); ValueError for a type without a kernel or a weight of the wrong shape.
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
      // bf16 x on AVX512_BF16: Q4's bf16 dot-product path reads x as it is (K even: whole pairs)
      const void* pairs = std::is_same_v<XT, c10::BFloat16> && cpu_has_avx512_bf16() ? xc.data_ptr() : nullptr;
      with_grouped_type(type, [&](auto kind) {
        grouped_linear<decltype(kind)::value, XT>(xf.data_ptr<float>(), pairs, w.data_ptr<uint8_t>(), b,
                                                  y.data_ptr<XT>(), M, N, K);
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

// out = the dequantised weight, each value exactly the reference's float32 (then rounded to out's
// dtype): [N, K] fp32 / bf16 / fp16, or for a grouped weight bf16 [N / 16, K / 2, 16, 2], the
// layout bf16_linear takes. False when out's dtype or shape is another.
bool gguf_dequantize(const at::Tensor& w, int64_t type, at::Tensor& out) {
  if (w.scalar_type() != at::kByte || !w.is_contiguous() || !out.is_contiguous()) return false;
  const bool packed = out.dim() == 4;
  if (!packed && out.dim() != 2) return false;
  const int64_t K = packed ? out.size(1) * 2 : out.size(1);
  const Layout layout = check_weight(static_cast<int>(type), w, K);
  const int64_t N = layout.rows;
  if (packed && (!layout.grouped || out.scalar_type() != at::kBFloat16 || out.size(0) * kGroup != N ||
                 out.size(2) != kGroup || out.size(3) != 2))
    return false;
  if (!packed && out.size(0) != N)
    throw std::invalid_argument("gguf_dequantize: out has " + std::to_string(out.size(0)) + " rows; the weight " +
                                std::to_string(N));
  return with_float_type(out.scalar_type(), [&](auto ot) {
    using OT = decltype(ot);
    if (layout.grouped) {
      with_grouped_type(type, [&](auto kind) {
        grouped_dequantize<decltype(kind)::value, OT>(w.data_ptr<uint8_t>(), out.data_ptr<OT>(), N, K, packed);
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
            for (int i = 0; i < D::kChunks; ++i) store16(op + n * K + b * D::kBlock + 16 * i, dec.chunk(i));
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
    const int64_t nb = K / 32;
    xsum.resize(type == kQ4_1 ? M * nb : 0);
    block_sums(xf.data(), static_cast<int64_t>(xsum.size()), xsum.data());
    const void* pairs = cpu_has_avx512_bf16() ? static_cast<const void*>(x) : nullptr;
    const GroupX gx{xf.data(), static_cast<const uint32_t*>(pairs), xsum.empty() ? nullptr : xsum.data(), K, nb};
    with_grouped_type(type, [&](auto kind) {
      grouped_groups<decltype(kind)::value, bf16>(gx, w, bias, y, M, N, n0 / kGroup, n1 / kGroup);
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
