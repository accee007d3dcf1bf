// Matmuls for CPUs with AVX2 + FMA + F16C: y = x @ W^T + bias, over
//   dense_linear: a dense [N, K] fp32 / bf16 / fp16 weight, F.linear's own layout (nothing packed);
//   int8_linear:  mooncake_ops.linear's packed int8 weight [N, K + 4] (a row's K int8 values, then
//                 its float32 scale in 4 bytes), the contract of the AVX-512 module's entry.
// Torch has no bf16 arithmetic on these CPUs: its bf16 F.linear of one row converts as it goes
// and streams the weight at ~5 GB/s per thread (Zen 3), a third of what the memory gives, and
// its many-row bf16 matmuls run ~10x below its fp32 ones. Here the arithmetic is fp32 FMAs (x is
// converted to fp32 first, each output rounded once to x's dtype; an int8 row's sum is
// multiplied by its scale), and every weight byte is read from memory once per call (per 240 x
// rows beyond that):
//   * 1-2 x rows (batch-1 decode, a weight stream): dot products of 4 weight rows at a time
//     against the x rows, widened in registers, with software prefetch;
//   * more rows: 16-row weight panels widened and transposed into an fp32 buffer, then an
//     outer-product micro-kernel of 6 x rows x 16 outputs (below).
// K must be a multiple of 8, else the entry declines (None).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
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
#include "../csrc/step_parts.h"
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
  // line l is due at the step s where (s + 1) * lines first reaches (l + 1) * steps: the
  // lines spread evenly over the steps, counted without a division per step
  const int64_t steps = K / 8;
  int64_t line = 0, due = 0, next = steps;
  for (int64_t k = 0; k < K; k += 8) {
    if (ahead != nullptr)
      for (due += lines; next <= due; next += steps) _mm_prefetch(ahead + 64 * line++, _MM_HINT_T0);
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

// ---- more than kCols rows: an outer-product micro-kernel over 16-column panels ----------------
// Each panel of kPanel weight rows is widened to fp32 and transposed once per call into
// wp[k][c] = W[n0 + c][k] (K x 64 bytes: L1 / L2-sized for K up to a few thousand), then every
// block of up to kRowBlock x rows runs acc[r][h] += x[r][k] (broadcast) * wp[k][8h .. 8h + 7]:
// 2 x kRowBlock FMAs per k against 2 loads and kRowBlock broadcasts (12 of AVX2's 16
// registers accumulate), the fp32 FMA units' rate instead of the dot-product loop's, whose
// horizontal sums and 6 loads per 8 FMAs held it at ~60 % of it.
constexpr int64_t kPanel = 16;
constexpr int kRowBlock = 6;
constexpr int64_t kDepth = 256;      // K per slice of the panel (a multiple of 8)
constexpr int64_t kChunkRows = 240;  // x rows per task (40 blocks of 6; 540 KB of fp32 x at K = 576)

// m[i] lane j -> m[j] lane i.
inline void transpose8x8(__m256 (&m)[8]) {
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

// wp[k * kPanel + c] = rows[c][k] as fp32 (c < kPanel; rows past the weight's last are zeros).
template <typename WT>
void widen_panel(const WT* const (&rows)[kPanel], int64_t nr, int64_t K, float* wp) {
  for (int64_t k0 = 0; k0 < K; k0 += 8)
    for (int64_t c0 = 0; c0 < kPanel; c0 += 8) {
      __m256 m[8];
      for (int i = 0; i < 8; ++i) m[i] = c0 + i < nr ? load8(rows[c0 + i] + k0) : _mm256_setzero_ps();
      transpose8x8(m);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(wp + (k0 + i) * kPanel + c0, m[i]);
    }
}

// out[r * kPanel + c] = sum_k x[r][k] wp[k][c] for r < MB. The sums are named variables, not
// an array: GCC 12 kept an array of them in memory and stored all 12 on every k (~27 GFLOP/s
// on a Zen 3 core, ~60 with them in registers).
template <int MB>
inline void panel_block(const float* x, int64_t ldx, int64_t K, const float* wp, float* out, bool add) {
  static_assert(MB >= 1 && MB <= kRowBlock);
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  if (add) {
#define MOPS_PANEL_LOAD(r)                              \
  if constexpr (MB > r) {                               \
    a##r##0 = _mm256_loadu_ps(out + r * kPanel);        \
    a##r##1 = _mm256_loadu_ps(out + r * kPanel + 8);    \
  }
    MOPS_PANEL_LOAD(0)
    MOPS_PANEL_LOAD(1)
    MOPS_PANEL_LOAD(2)
    MOPS_PANEL_LOAD(3)
    MOPS_PANEL_LOAD(4)
    MOPS_PANEL_LOAD(5)
#undef MOPS_PANEL_LOAD
  }
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
#define MOPS_PANEL_ROW(r)                                      \
  if constexpr (MB > r) {                                      \
    const __m256 xb = _mm256_broadcast_ss(x##r + k);           \
    a##r##0 = _mm256_fmadd_ps(xb, w0, a##r##0);                \
    a##r##1 = _mm256_fmadd_ps(xb, w1, a##r##1);                \
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(wp + k * kPanel), w1 = _mm256_loadu_ps(wp + k * kPanel + 8);
    MOPS_PANEL_ROW(0)
    MOPS_PANEL_ROW(1)
    MOPS_PANEL_ROW(2)
    MOPS_PANEL_ROW(3)
    MOPS_PANEL_ROW(4)
    MOPS_PANEL_ROW(5)
  }
#undef MOPS_PANEL_ROW
  const __m256 sums[kRowBlock][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < MB; ++r) {
    _mm256_storeu_ps(out + r * kPanel, sums[r][0]);
    _mm256_storeu_ps(out + r * kPanel + 8, sums[r][1]);
  }
}

inline void panel_rows(const float* x, int64_t ldx, int64_t mb, int64_t K, const float* wp, float* out, bool add) {
  switch (mb) {
    case 1: panel_block<1>(x, ldx, K, wp, out, add); break;
    case 2: panel_block<2>(x, ldx, K, wp, out, add); break;
    case 3: panel_block<3>(x, ldx, K, wp, out, add); break;
    case 4: panel_block<4>(x, ldx, K, wp, out, add); break;
    case 5: panel_block<5>(x, ldx, K, wp, out, add); break;
    default: panel_block<kRowBlock>(x, ldx, K, wp, out, add); break;
  }
}

// y [M, N] = xf [M, K] @ W^T (+ bias); W rows `ldw` elements apart. Scaled: the row's float32
// scale is stored right after its K values (the packed int8 layout).
template <typename XT, typename WT, bool Scaled>
void linear_panels(const float* xf, const WT* w, int64_t ldw, const XT* bias, XT* y, int64_t M, int64_t N,
                   int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel, chunks = (M + kChunkRows - 1) / kChunkRows;
  // task t: panel t % panels over x rows [kChunkRows (t / panels), ...): a thread's next task is
  // mostly the next panel over the same rows, which stay in its L2
  auto task = [&](int64_t t) {
    thread_local std::vector<float> wp, sums;
    wp.resize(K * kPanel);
    sums.resize(kChunkRows * kPanel);
    const int64_t n0 = t % panels * kPanel, nr = std::min<int64_t>(kPanel, N - n0);
    const int64_t m0 = t / panels * kChunkRows, mc = std::min<int64_t>(kChunkRows, M - m0);
    const WT* rows[kPanel];
    alignas(32) float scale[kPanel], add[kPanel];
    for (int64_t c = 0; c < kPanel; ++c) {
      rows[c] = w + (n0 + (c < nr ? c : 0)) * ldw;
      scale[c] = 1.0f;
      add[c] = 0.0f;
      if (c >= nr) continue;
      if constexpr (Scaled) std::memcpy(&scale[c], rows[c] + K, sizeof(float));
      if (bias != nullptr) add[c] = static_cast<float>(bias[n0 + c]);
    }
    widen_panel(rows, nr, K, wp.data());
    // The next panel's weight rows (contiguous after this panel's) are prefetched into L2 a
    // share before each row block: a decode step's weights come from DRAM, and 16 rows read
    // side by side give the hardware prefetcher short runs only.
    const char* next = reinterpret_cast<const char*>(w + std::min<int64_t>(n0 + kPanel, N - 1) * ldw);
    const int64_t lines = n0 + kPanel < N ? (std::min<int64_t>(kPanel, N - n0 - kPanel) * ldw * sizeof(WT) + 63) / 64 : 0;
    const int64_t calls = (K + kDepth - 1) / kDepth * ((mc + kRowBlock - 1) / kRowBlock);
    int64_t call = 0;
    // K in slices of kDepth: a slice of the panel (16 KB) and of 6 x rows stay in L1 while all
    // the row blocks pass over them
    for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
      const int64_t kc = std::min<int64_t>(kDepth, K - k0);
      for (int64_t r0 = 0; r0 < mc; r0 += kRowBlock, ++call) {
        for (int64_t line = call * lines / calls; line < (call + 1) * lines / calls; ++line)
          _mm_prefetch(next + line * 64, _MM_HINT_T1);
        panel_rows(xf + (m0 + r0) * K + k0, K, std::min<int64_t>(kRowBlock, mc - r0), kc, wp.data() + k0 * kPanel,
                   sums.data() + r0 * kPanel, k0 > 0);
      }
    }
    for (int64_t m = 0; m < mc; ++m) {
      XT* yr = y + (m0 + m) * N + n0;
      const float* sr = sums.data() + m * kPanel;
      if (nr == kPanel) {
        for (int h = 0; h < 2; ++h)
          store8(yr + 8 * h,
                 _mm256_fmadd_ps(_mm256_loadu_ps(sr + 8 * h), _mm256_load_ps(scale + 8 * h), _mm256_load_ps(add + 8 * h)));
      } else {
        for (int64_t c = 0; c < nr; ++c) yr[c] = static_cast<XT>(sr[c] * scale[c] + add[c]);
      }
    }
  };
  if (at::get_num_threads() > 1 && M * N * K >= kOneThreadMaxMacs) {
    parallel_dynamic(panels * chunks, task);
  } else {
    for (int64_t t = 0; t < panels * chunks; ++t) task(t);
  }
}

// Blocks [b0, b1) of kRows outputs of y [M, N] = xf [M, K] @ W^T (+ bias) by dot products with
// prefetch, kCols x rows at a time; W rows `ldw` elements apart. Scaled: the row's float32 scale
// is stored right after its K values (the packed int8 layout).
template <typename XT, typename WT, bool Scaled>
void row_blocks(const float* xf, const WT* w, int64_t ldw, const XT* bias, XT* y, int64_t M, int64_t N, int64_t K,
                int64_t b0, int64_t b1) {
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
    for (int64_t m0 = 0; m0 < M; m0 += kCols) {
      const int64_t mb = std::min<int64_t>(kCols, M - m0);
      dot_rows(xf + m0 * K, mb, K, rows, sums, ahead, lines);
      for (int64_t m = 0; m < mb; ++m)
        for (int64_t r = 0; r < nr; ++r)
          y[(m0 + m) * N + n0 + r] = static_cast<XT>(sums[m * kRows + r] * scale[r] + add[r]);
    }
  }
}

// y [M, N] = xf [M, K] @ W^T (+ bias), as row_blocks: up to kCols rows (batch-1 decode: a weight
// stream) by dot products with prefetch; more by weight panels.
template <typename XT, typename WT, bool Scaled>
void linear_rows(const float* xf, const WT* w, int64_t ldw, const XT* bias, XT* y, int64_t M, int64_t N,
                 int64_t K) {
  if (M > kCols) return linear_panels<XT, WT, Scaled>(xf, w, ldw, bias, y, M, N, K);
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t grain = at::get_num_threads() > 1 && M * N * K >= kOneThreadMaxMacs ? 16 : blocks;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    row_blocks<XT, WT, Scaled>(xf, w, ldw, bias, y, M, N, K, b0, b1);
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

namespace parts {
namespace {
// x as fp32 rows in a per-thread buffer (the entries' x.to(float): exact)
const float* widened(const bf16* x, int64_t n) {
  thread_local std::vector<float> xf;
  xf.resize(n);
  for (int64_t i = 0; i < n; ++i) xf[i] = static_cast<float>(x[i]);
  return xf.data();
}
}  // namespace

void dense_linear_rows(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t M, int64_t N, int64_t K,
                       int64_t n0, int64_t n1) {
  row_blocks<bf16, bf16, false>(widened(x, M * K), w, K, bias, y, M, N, K, n0 / kRows, (n1 + kRows - 1) / kRows);
}

void int8_linear_rows(const bf16* x, const int8_t* w, const bf16* bias, bf16* y, int64_t M, int64_t N, int64_t K,
                      int64_t n0, int64_t n1) {
  row_blocks<bf16, int8_t, true>(widened(x, M * K), w, K + 4, bias, y, M, N, K, n0 / kRows, (n1 + kRows - 1) / kRows);
}

}  // namespace parts
}  // namespace mops
