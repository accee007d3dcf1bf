// Matmuls of few rows (decode steps) for CPUs with AVX2 + FMA + F16C: y = x @ W^T + bias, over
//   dense_linear: a dense [N, K] fp32 / bf16 / fp16 weight, F.linear's own layout (nothing packed);
//   int8_linear:  mooncake_ops.linear's packed int8 weight [N, K + 4] (a row's K int8 values, then
//                 its float32 scale in 4 bytes), the contract of the AVX-512 module's entry.
// Torch has no bf16 arithmetic on these CPUs: its bf16 F.linear of one row converts as it goes
// and streams the weight at ~5 GB/s per thread (Zen 3), a third of what the memory gives. Here
// every weight byte is read from memory once per call and widened to fp32 in registers: 4 weight
// rows at a time against the x rows in pairs (8 accumulators + 4 weight vectors + x: AVX2's 16
// registers). With more than 2 x rows, each block of 4 weight rows is first widened into an
// fp32 buffer (16 K bytes: L1-sized for K up to ~2,000), so the widening is done once per block,
// not once per pair of x rows.
// Sums are fp32 (x is converted to fp32 first), each output rounded once to x's dtype; an int8
// row's sum is multiplied by its scale. K must be a multiple of 8, else the entry declines (None).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../csrc/dispatch.h"
#include "vec_avx2.h"

namespace mops {
namespace {

constexpr int64_t kRows = 4;  // weight rows per block
constexpr int64_t kCols = 2;  // x rows per inner block
// Fewer multiply-adds run on the calling thread: waking the pool costs more than it saves. A
// lower bound than the AVX-512 kernels' 2^21 (mooncake_ops.linear.ONE_THREAD_MAX_MACS): one
// thread streams ~8 GB/s here, and on a Zen 3 the 120 decode matmuls of the default model's 30
// layers (0.3-1.8 M multiply-adds each, 212 MB of bf16) took ~32 ms on one thread, ~24 on two.
constexpr int64_t kOneThreadMaxMacs = int64_t{1} << 17;
constexpr int64_t kAhead = 4;  // blocks of weight rows prefetched ahead

// The 4 sums of a[0..3]'s lanes.
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// sums[m * kRows + r] = dot(x row m, weight row r), m < MB. `ahead` (or null): `lines` cache
// lines to prefetch, spread over the steps: the weight rows are short, so the hardware
// prefetcher gets no run to lock on to (one Zen 3 thread read bf16 rows at ~4.4 GB/s without,
// ~8.5 with it, as fast as a plain fp32 sum over memory in the same microbenchmark).
template <int MB, typename WT>
inline void dot_block(const float* x, int64_t K, const WT* const (&w)[kRows], float* sums, const char* ahead,
                      int64_t lines) {
  __m256 acc[MB][kRows];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t steps = K / 8;
  for (int64_t k = 0, step = 0; k < K; k += 8, ++step) {
    if (ahead != nullptr)
      for (int64_t line = step * lines / steps; line < (step + 1) * lines / steps; ++line)
        _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
    __m256 wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = load8(w[r] + k);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    _mm_storeu_ps(sums + m * kRows, sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

template <typename WT>
inline void dot_rows(const float* x, int64_t mb, int64_t K, const WT* const (&w)[kRows], float* sums,
                     const char* ahead = nullptr, int64_t lines = 0) {
  if (mb == 1)
    dot_block<1>(x, K, w, sums, ahead, lines);
  else
    dot_block<2>(x, K, w, sums, ahead, lines);
}

// y [M, N] = xf [M, K] @ W^T (+ bias); W rows `ldw` elements apart. Scaled: the row's float32
// scale is stored right after its K values (the packed int8 layout).
template <typename XT, typename WT, bool Scaled>
void linear_rows(const float* xf, const WT* w, int64_t ldw, const XT* bias, XT* y, int64_t M, int64_t N,
                 int64_t K) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t grain = at::get_num_threads() > 1 && M * N * K >= kOneThreadMaxMacs ? 16 : blocks;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> wide(M > kCols ? kRows * K : 0);
    alignas(16) float sums[kCols * kRows];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRows, nr = std::min<int64_t>(kRows, N - n0);
      const WT* rows[kRows];
      for (int64_t r = 0; r < kRows; ++r)  // past the last row: row n0 again, its sums unused
        rows[r] = w + (n0 + (r < nr ? r : 0)) * ldw;
      float scale[kRows], add[kRows];
      for (int64_t r = 0; r < nr; ++r) {
        scale[r] = 1.0f;
        if constexpr (Scaled) std::memcpy(&scale[r], rows[r] + K, sizeof(float));
        add[r] = bias != nullptr ? static_cast<float>(bias[n0 + r]) : 0.0f;
      }
      // The block kAhead blocks on (the rows of a block and of the next ones are contiguous).
      const char* ahead = reinterpret_cast<const char*>(w + (n0 + kAhead * kRows) * ldw);
      const int64_t lines = (kRows * ldw * static_cast<int64_t>(sizeof(WT)) + 63) / 64;
      const float* wide_rows[kRows];
      if (M > kCols) {
        for (int64_t r = 0; r < kRows; ++r) {
          for (int64_t line = r * lines / kRows; line < (r + 1) * lines / kRows; ++line)
            _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
          for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(wide.data() + r * K + k, load8(rows[r] + k));
          wide_rows[r] = wide.data() + r * K;
        }
      }
      for (int64_t m0 = 0; m0 < M; m0 += kCols) {
        const int64_t mb = std::min<int64_t>(kCols, M - m0);
        if (M > kCols)
          dot_rows(xf + m0 * K, mb, K, wide_rows, sums);
        else
          dot_rows(xf + m0 * K, mb, K, rows, sums, ahead, lines);
        for (int64_t m = 0; m < mb; ++m)
          for (int64_t r = 0; r < nr; ++r)
            y[(m0 + m) * N + n0 + r] = static_cast<XT>(sums[m * kRows + r] * scale[r] + add[r]);
      }
    }
  });
}

// The call's x as fp32 rows, y of x's dtype, and the bias check; false when it does not fit.
bool fits(const at::Tensor& x, int64_t N, int64_t K, const std::optional<at::Tensor>& bias) {
  if (x.dim() != 2 || K % 8 || x.size(0) == 0 || N == 0) return false;
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kHalf)
    return false;
  return !bias || (bias->scalar_type() == x.scalar_type() && bias->numel() == N && bias->is_contiguous());
}

}  // namespace

// x [M, K] (fp32 / bf16 / fp16), weight dense [N, K] (fp32 / bf16 / fp16, rows contiguous),
// bias [N] of x's dtype or None. None when the call does not fit (K % 8, other dtypes / layouts).
std::optional<at::Tensor> dense_linear(const at::Tensor& x, const at::Tensor& w,
                                       const std::optional<at::Tensor>& bias) {
  if (w.dim() != 2 || w.stride(1) != 1) return std::nullopt;
  const int64_t K = x.size(-1), N = w.size(0);
  if (w.size(1) != K)
    throw std::invalid_argument("dense_linear: weight is [" + std::to_string(N) + ", " + std::to_string(w.size(1)) +
                                "]; x has " + std::to_string(K) + " features");
  if (!fits(x, N, K, bias)) return std::nullopt;
  const auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({x.size(0), N}, x.options());
  bool done = false;
  with_float_type(x.scalar_type(), [&](auto xt) {
    using XT = decltype(xt);
    done = with_float_type(w.scalar_type(), [&](auto wt) {
      using WT = decltype(wt);
      linear_rows<XT, WT, false>(xf.data_ptr<float>(), w.data_ptr<WT>(), w.stride(0),
                                 bias ? bias->data_ptr<XT>() : nullptr, y.data_ptr<XT>(), x.size(0), N, K);
    });
  });
  if (!done) return std::nullopt;
  return y;
}

// The AVX-512 module's int8_linear contract: x [M, K] (fp32 / bf16 / fp16), weight int8
// [N, K + 4] contiguous, bias [N] of x's dtype or None; None when the call does not fit.
std::optional<at::Tensor> int8_linear(const at::Tensor& x, const at::Tensor& w,
                                      const std::optional<at::Tensor>& bias) {
  if (x.dim() != 2 || w.dim() != 2 || w.scalar_type() != at::kChar || !w.is_contiguous()) return std::nullopt;
  const int64_t K = x.size(1), N = w.size(0);
  if (w.size(1) != K + 4)
    throw std::invalid_argument("int8_linear: weight is [" + std::to_string(N) + ", " + std::to_string(w.size(1)) +
                                "]; x's " + std::to_string(K) + " features need [N, " + std::to_string(K + 4) + "]");
  if (!fits(x, N, K, bias)) return std::nullopt;
  const auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({x.size(0), N}, x.options());
  with_float_type(x.scalar_type(), [&](auto xt) {
    using XT = decltype(xt);
    linear_rows<XT, int8_t, true>(xf.data_ptr<float>(), w.data_ptr<int8_t>(), K + 4,
                                  bias ? bias->data_ptr<XT>() : nullptr, y.data_ptr<XT>(), x.size(0), N, K);
  });
  return y;
}

}  // namespace mops
