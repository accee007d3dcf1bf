// Weight-only int8 linear for small row counts (decode): y = x @ (q * scale)^T + bias.
//
// The weight is the packed form of mooncake_ops.linear (pack_int8_weight): int8 [N, K + 4],
// each row K int8 values then its float32 scale in 4 bytes (per output channel, symmetric).
// Each weight byte is read once per call: 4 output rows at a time, every x row against them,
// the weight scale applied to each row's sum. Two inner loops:
//   bf16 / fp16 x on a CPU with AVX512_VNNI (checked at run time): each x row becomes 15-bit
//   integers (scale = absmax / 16383, error <= absmax / 32766 per element, finer than bf16's
//   own rounding), and vpdpwssd multiplies 32 int16 x values by 32 sign-extended weights per
//   instruction, summing into int32 (no overflow: a lane sums K / 16 products < 2^31 for
//   K <= 8192); the sum is scaled once. About twice the weights per cycle of the fp32 loop.
//   fp32 x (or no VNNI): int8 -> fp32 in registers and fp32 FMAs, exact up to fp32 rounding.
// Larger row counts are compute-bound; the Python side runs them elsewhere.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"
#include "step_parts.h"
#include "vec.h"

namespace mops {
namespace {

constexpr int64_t kRows = 4;  // output rows (weight rows) per inner block
// Fewer multiply-adds run on the calling thread: waking the pool costs more (see
// mooncake_ops.linear.ONE_THREAD_MAX_MACS, the same bound for the bf16 kernel).
constexpr int64_t kOneThreadMaxMacs = int64_t{1} << 21;
constexpr int64_t kCols = 4;  // x rows per inner block (kRows * kCols accumulators)

template <int MB>
inline void dot_block(const float* x, int64_t K, const int8_t* w, int64_t ldw, int64_t nr,
                      float* sums /* [MB][kRows] */) {
  __m512 acc[MB][kRows];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[kRows];
    for (int r = 0; r < kRows; ++r)
      wv[r] = r < nr ? load16(w + r * ldw + k) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) sums[m * kRows + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// A weight block's per-row scales (the 4 bytes after each row's K values) and bias.
template <typename XT>
inline void block_scales(const int8_t* wb, int64_t ldw, int64_t K, int64_t nr, const XT* bias,
                         float* scale, float* add) {
  for (int64_t r = 0; r < nr; ++r) {
    std::memcpy(&scale[r], wb + r * ldw + K, sizeof(float));
    add[r] = bias != nullptr ? static_cast<float>(bias[r]) : 0.0f;
  }
}

// ---- bf16 / fp16 x: int16 activations, VNNI -----------------------------------------------------
constexpr float kXLevels = 16383.0f;
constexpr int64_t kVnniMaxK = 8192;
// Blocks of kRows weight rows prefetched ahead. One: the model's int8 decode step (SmolLM2,
// batch 1, 2 threads, Zen 4) took 4.61 ms with 1, 4.78 with 2, 4.84 with 3 and 4.96 with 4,
// the distances switched every step in one process (2026-12-07). Why further is slower was not
// measured (perhaps lines that arrive early crowd the L1 before they are read).
constexpr int64_t kAhead = 1;

template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
inline void dot_block_vnni(const int16_t* x, int64_t K, const int8_t* w, int64_t ldw, int64_t nr,
                           int32_t* sums /* [MB][kRows] */) {
  __m512i acc[MB][kRows];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_si512();
  // Prefetch the block kAhead blocks on, spread over this block's steps (the rows are short:
  // the hardware prefetcher gets no run to lock on to; without it the kernel runs at half speed).
  const char* ahead = reinterpret_cast<const char*>(w + kAhead * kRows * ldw);
  const int64_t lines = (kRows * ldw + 63) / 64, steps = K / 32;
  for (int64_t k = 0, step = 0; k < K; k += 32, ++step) {
    __m512i wv[kRows];
    for (int64_t line = step * lines / steps; line < (step + 1) * lines / steps; ++line)
      _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
    for (int r = 0; r < kRows; ++r)
      wv[r] = r < nr ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                           reinterpret_cast<const __m256i*>(w + r * ldw + k)))
                     : _mm512_setzero_si512();
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_dpwssd_epi32(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) sums[m * kRows + r] = _mm512_reduce_add_epi32(acc[m][r]);
}

// The same over weights already widened to int16 (rows of K), for x with many rows: the
// widening is done once per weight block instead of once per block of x rows.
template <int MB>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
inline void dot_block_vnni16(const int16_t* x, int64_t K, const int16_t* w, int32_t* sums) {
  __m512i acc[MB][kRows];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 32) {
    __m512i wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = _mm512_load_si512(w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_dpwssd_epi32(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) sums[m * kRows + r] = _mm512_reduce_add_epi32(acc[m][r]);
}

template <typename XT>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void int8_vnni_blocks(const int16_t* xq, const float* xscale, const int8_t* w, const XT* bias, XT* y,
                      int64_t M, int64_t N, int64_t K, int64_t b0, int64_t b1) {  // weight row blocks [b0, b1)
  const int64_t ldw = K + 4;
  int32_t sums[kCols * kRows];
  alignas(64) int16_t wide[kRows * kVnniMaxK];  // this weight block widened (M > kCols)
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * kRows, nr = std::min<int64_t>(kRows, N - n0);
    const int8_t* wb = w + n0 * ldw;
    float scale[kRows], add[kRows];
    block_scales(wb, ldw, K, nr, bias == nullptr ? nullptr : bias + n0, scale, add);
    const bool widen = M > kCols;
    if (widen) {  // rows past nr are zeros: their sums are never stored
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t k = 0; k < K; k += 32)
          _mm512_store_si512(wide + r * K + k, r < nr ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(wb + r * ldw + k))) : _mm512_setzero_si512());
    }
    for (int64_t m0 = 0; m0 < M; m0 += kCols) {
      const int64_t mb = std::min<int64_t>(kCols, M - m0);
      const int16_t* xb = xq + m0 * K;
      switch (widen ? mb : -mb) {
        case 1: dot_block_vnni16<1>(xb, K, wide, sums); break;
        case 2: dot_block_vnni16<2>(xb, K, wide, sums); break;
        case 3: dot_block_vnni16<3>(xb, K, wide, sums); break;
        case 4: dot_block_vnni16<4>(xb, K, wide, sums); break;
        case -1: dot_block_vnni<1>(xb, K, wb, ldw, nr, sums); break;
        case -2: dot_block_vnni<2>(xb, K, wb, ldw, nr, sums); break;
        case -3: dot_block_vnni<3>(xb, K, wb, ldw, nr, sums); break;
        default: dot_block_vnni<4>(xb, K, wb, ldw, nr, sums); break;
      }
      for (int64_t m = 0; m < mb; ++m)
        for (int64_t r = 0; r < nr; ++r)
          y[(m0 + m) * N + n0 + r] = static_cast<XT>(
              static_cast<float>(sums[m * kRows + r]) * xscale[m0 + m] * scale[r] + add[r]);
    }
  }
}

template <typename XT>
void int8_rows_vnni(const int16_t* xq, const float* xscale, const int8_t* w, const XT* bias, XT* y,
                    int64_t M, int64_t N, int64_t K) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t grain = at::get_num_threads() > 1 && M * N * K >= kOneThreadMaxMacs ? 16 : blocks;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    int8_vnni_blocks<XT>(xq, xscale, w, bias, y, M, N, K, b0, b1);
  });
}

// Row m of x as int16: round(x / s) with s = absmax / 16383 (s = 0 for a zero row).
template <typename XT>
void quantize_rows16(const XT* x, int16_t* xq, float* xscale, int64_t M, int64_t K) {
  for (int64_t m = 0; m < M; ++m) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x + m * K + k)));
    const float absmax = _mm512_reduce_max_ps(mx);
    xscale[m] = absmax / kXLevels;
    const __m512 inv = _mm512_set1_ps(absmax > 0.0f ? kXLevels / absmax : 0.0f);
    for (int64_t k = 0; k < K; k += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + m * K + k), inv));  // nearest
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + k), _mm512_cvtsepi32_epi16(q));
    }
  }
}

bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni");
  return yes;
}

template <typename XT>
void int8_fp32_blocks(const float* xf, const int8_t* w, const XT* bias, XT* y, int64_t M, int64_t N,
                      int64_t K, int64_t b0, int64_t b1) {  // weight row blocks [b0, b1)
  const int64_t ldw = K + 4;
  float sums[kCols * kRows];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * kRows, nr = std::min<int64_t>(kRows, N - n0);
    const int8_t* wb = w + n0 * ldw;
    float scale[kRows], add[kRows];
    block_scales(wb, ldw, K, nr, bias == nullptr ? nullptr : bias + n0, scale, add);
    for (int64_t m0 = 0; m0 < M; m0 += kCols) {
      const int64_t mb = std::min<int64_t>(kCols, M - m0);
      const float* xb = xf + m0 * K;
      switch (mb) {
        case 1: dot_block<1>(xb, K, wb, ldw, nr, sums); break;
        case 2: dot_block<2>(xb, K, wb, ldw, nr, sums); break;
        case 3: dot_block<3>(xb, K, wb, ldw, nr, sums); break;
        default: dot_block<4>(xb, K, wb, ldw, nr, sums); break;
      }
      for (int64_t m = 0; m < mb; ++m)
        for (int64_t r = 0; r < nr; ++r)
          y[(m0 + m) * N + n0 + r] = static_cast<XT>(sums[m * kRows + r] * scale[r] + add[r]);
    }
  }
}


template <typename XT>
void int8_rows(const float* xf, const int8_t* w, const XT* bias, XT* y, int64_t M, int64_t N,
               int64_t K) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t grain = at::get_num_threads() > 1 && M * N * K >= kOneThreadMaxMacs ? 16 : blocks;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    int8_fp32_blocks<XT>(xf, w, bias, y, M, N, K, b0, b1);
  });
}

}  // namespace

// x [M, K] (fp32 / bf16 / fp16, contiguous), w int8 [N, K + 4], bias [N] of x's dtype or None.
// None when the call does not fit (K not a multiple of 16, other dtypes, non-contiguous).
std::optional<at::Tensor> int8_linear(const at::Tensor& x, const at::Tensor& w,
                                      const std::optional<at::Tensor>& bias) {
  if (x.dim() != 2 || w.dim() != 2 || w.scalar_type() != at::kChar || !w.is_contiguous())
    return std::nullopt;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (w.size(1) != K + 4)
    throw std::invalid_argument("int8_linear: weight is [" + std::to_string(N) + ", " +
                                std::to_string(w.size(1)) + "]; x's " + std::to_string(K) +
                                " features need [N, " + std::to_string(K + 4) + "]");
  if (K % 16 || M == 0 || N == 0) return std::nullopt;
  if (bias && (bias->scalar_type() != x.scalar_type() || bias->numel() != N || !bias->is_contiguous()))
    return std::nullopt;
  const auto xc = x.contiguous();
  auto y = at::empty({M, N}, xc.options());
  const bool vnni = xc.scalar_type() != at::kFloat && K % 32 == 0 && K <= kVnniMaxK && has_vnni();
  const bool done = with_float_type(x.scalar_type(), [&](auto xt) {
    using XT = decltype(xt);
    const XT* b = bias ? bias->data_ptr<XT>() : nullptr;
    if (vnni) {
      auto xq = at::empty({M, K}, xc.options().dtype(at::kShort));
      auto xs = at::empty({M}, xc.options().dtype(at::kFloat));
      quantize_rows16(xc.data_ptr<XT>(), xq.data_ptr<int16_t>(), xs.data_ptr<float>(), M, K);
      int8_rows_vnni<XT>(xq.data_ptr<int16_t>(), xs.data_ptr<float>(), w.data_ptr<int8_t>(), b,
                         y.data_ptr<XT>(), M, N, K);
    } else {
      const auto xf = xc.scalar_type() == at::kFloat ? xc : xc.to(at::kFloat);
      int8_rows<XT>(xf.data_ptr<float>(), w.data_ptr<int8_t>(), b, y.data_ptr<XT>(), M, N, K);
    }
  });
  if (!done) return std::nullopt;
  return y;
}

namespace parts {

void int8_linear_rows(const bf16* x, const int8_t* w, const bf16* bias, bf16* y, int64_t M, int64_t N, int64_t K,
                      int64_t n0, int64_t n1) {
  const int64_t b0 = n0 / kRows, b1 = (n1 + kRows - 1) / kRows;
  if (K % 32 == 0 && K <= kVnniMaxK && has_vnni()) {  // as int8_linear chooses for bf16 x
    thread_local std::vector<int16_t> xq;
    thread_local std::vector<float> xs;
    xq.resize(M * K);
    xs.resize(M);
    quantize_rows16(x, xq.data(), xs.data(), M, K);
    int8_vnni_blocks<bf16>(xq.data(), xs.data(), w, bias, y, M, N, K, b0, b1);
    return;
  }
  thread_local std::vector<float> xf;
  xf.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(x[i]);
  int8_fp32_blocks<bf16>(xf.data(), w, bias, y, M, N, K, b0, b1);
}

}  // namespace parts
}  // namespace mops
