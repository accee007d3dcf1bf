// bf16 linear on CPU through AVX512_BF16 dot products (vdpbf16ps), checked at run time, over a
// weight re-laid-out once (`bf16_pack_weight`): y = x @ w^T + bias, any row count.
//
// Packed weight, for a dense [N, K] (N a multiple of 16, K even), as bf16 [N/16, K/2, 16, 2]:
//
//   wp[j][p][l] = (w[16j + l][2p], w[16j + l][2p + 1])      one 32-bit pair per output lane l
//
// so one vdpbf16ps with x's pair p broadcast adds 2 products to 16 outputs, and nothing needs
// a horizontal sum. Micro-tile: MR x rows by NR blocks of 16 outputs (MR x NR fp32
// accumulators; 4 x 4 = 64 outputs for 4 rows), per pair p NR weight loads, MR broadcasts and
// MR x NR vdpbf16ps. Loop: threads split the output blocks in equal shares (each in panels of
// up to NR x 16 columns, whose K x NR x 16 weights stay in L2 while every row block passes
// over them), or, when a call has fewer panels than threads and many rows, the rows; calls
// of 256 rows or more (prefill chunks) split into (panel, 256 rows) tasks that each thread
// takes as it finishes the last (a static split left one thread waiting whenever the other
// core ran slower), and smaller ones whose panels do not divide among the threads split each
// panel's rows too (e.g. 9 panels x 2 chunks on 2 threads). Row counts <= 4 stream the
// weight once at close to memory bandwidth; large ones are bound by the dot products. With
// several row blocks the next panel is prefetched a few lines per pair while this one is
// computed, so a batched decode step's weights arrive from DRAM behind the arithmetic
// (without: 1.2-1.25x slower for 32 rows over cold weights).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cstring>
#include <vector>
#include <optional>
#include <stdexcept>
#include <string>
#include <numeric>

#include "dispatch.h"
#include "step_parts.h"
#include "vec.h"

#define MOPS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace mops {
namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kMR = 4;  // x rows per micro-tile
constexpr int64_t kNR = 4;  // 16-output blocks per micro-tile
// Fewer multiply-adds run on the calling thread (mooncake_ops.linear.ONE_THREAD_MAX_MACS).
constexpr int64_t kOneThreadMaxMacs = int64_t{1} << 21;
// Calls of at least this many rows split into tasks of one panel x this many rows, which the
// threads take one at a time (~0.1 ms each at the default model's shapes).
constexpr int64_t kTaskRows = 256;

// fp32 -> bf16 -> fp32 (round to nearest even): what storing and reloading a bf16 tensor gives.
MOPS_BF16_TARGET inline __m512 round_bf16(__m512 v) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// y[MR rows][NB blocks of 16] = x rows . packed blocks, + bias; K2 = K / 2 pairs. SILU: the
// blocks come in (gate, up) pairs and y gets silu(gate) * up per pair (NB / 2 blocks), each
// rounded to bf16 first, exactly as the unfused matmul + silu_and_mul compute it.
template <int MR, int NB, bool SILU>
MOPS_BF16_TARGET inline void micro_tile(const bf16* x, int64_t ldx, const uint32_t* wp, int64_t K2,
                                        const bf16* bias, bf16* y, int64_t ldy, const char* pf, int64_t pf_lines) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const uint32_t* xr[MR];
  for (int m = 0; m < MR; ++m) xr[m] = reinterpret_cast<const uint32_t*>(x + m * ldx);
  const int64_t block = K2 * 16;  // uint32 per 16-output block
  int64_t due = 0;
  for (int64_t p = 0; p < K2; ++p) {
    due += pf_lines;
    while (due >= K2) {
      _mm_prefetch(pf, _MM_HINT_T0);
      pf += 64;
      due -= K2;
    }
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wp + j * block + p * 16);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[m][p]));
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, wv[j]);
    }
  }
  if constexpr (SILU) {
    static_assert(NB % 2 == 0, "gate and up blocks come in pairs");
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int j = 0; j < NB; j += 2)
      for (int m = 0; m < MR; ++m) {
        const __m512 g = round_bf16(acc[m][j]), u = round_bf16(acc[m][j + 1]);
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store16(y + m * ldy + 8 * j, _mm512_mul_ps(silu, u));
      }
  } else {
    for (int j = 0; j < NB; ++j) {
      const __m512 b = bias != nullptr ? load16(bias + 16 * j) : _mm512_setzero_ps();
      for (int m = 0; m < MR; ++m) store16(y + m * ldy + 16 * j, _mm512_add_ps(acc[m][j], b));
    }
  }
}

template <int MR, bool SILU>
inline void row_block(const bf16* x, int64_t ldx, const uint32_t* wp, int64_t K2, const bf16* bias, bf16* y,
                      int64_t ldy, int64_t nb, const char* pf, int64_t pfl) {  // nb: 1..kNR blocks (SILU: 2 or 4)
  if constexpr (SILU) {
    if (nb == 2) micro_tile<MR, 2, true>(x, ldx, wp, K2, bias, y, ldy, pf, pfl);
    else micro_tile<MR, 4, true>(x, ldx, wp, K2, bias, y, ldy, pf, pfl);
  } else {
    switch (nb) {
      case 1: micro_tile<MR, 1, false>(x, ldx, wp, K2, bias, y, ldy, pf, pfl); break;
      case 2: micro_tile<MR, 2, false>(x, ldx, wp, K2, bias, y, ldy, pf, pfl); break;
      case 3: micro_tile<MR, 3, false>(x, ldx, wp, K2, bias, y, ldy, pf, pfl); break;
      default: micro_tile<MR, 4, false>(x, ldx, wp, K2, bias, y, ldy, pf, pfl); break;
    }
  }
}

// Rows [m0, m1) of x against one panel's packed weights `w` (nb blocks of 16 outputs) into y,
// the panel's first output column (ldy apart), bias bj; `next_lines` cache lines from `next`
// (the next panel's weights) are prefetched, an equal share per row block.
template <bool SILU>
void panel_rows(const bf16* x, int64_t ldx, const uint32_t* w, int64_t K2, const bf16* bj, bf16* y, int64_t ldy,
                int64_t nb, int64_t m0, int64_t m1, const char* next, int64_t next_lines) {
  const int64_t row_blocks = (m1 - m0 + kMR - 1) / kMR;
  for (int64_t m = m0; m < m1; m += kMR) {
    const int64_t r = (m - m0) / kMR, l0 = next_lines * r / row_blocks, l1 = next_lines * (r + 1) / row_blocks;
    const char* pf = next + 64 * l0;
    const int64_t pfl = l1 - l0;
    const int64_t mr = std::min(kMR, m1 - m);
    const bf16* xm = x + m * ldx;
    bf16* ym = y + m * ldy;
    switch (mr) {
      case 1: row_block<1, SILU>(xm, ldx, w, K2, bj, ym, ldy, nb, pf, pfl); break;
      case 2: row_block<2, SILU>(xm, ldx, w, K2, bj, ym, ldy, nb, pf, pfl); break;
      case 3: row_block<3, SILU>(xm, ldx, w, K2, bj, ym, ldy, nb, pf, pfl); break;
      default: row_block<4, SILU>(xm, ldx, w, K2, bj, ym, ldy, nb, pf, pfl); break;
    }
  }
}

// Rows [m0, m1) x output blocks [b_begin, b_end) of 16 (SILU: y is N / 2 wide, and the range
// holds whole (gate, up) pairs), in panels of up to kNR blocks whose sizes differ by at most
// one block (SILU: one pair): 18 blocks go 3, 4, 3, 4, 4, not 4, 4, 4, 4, 2 (a 2-block tile
// keeps only 8 accumulators in flight).
template <bool SILU>
void run_blocks(const bf16* x, int64_t ldx, const uint32_t* wp, const bf16* bias, bf16* y, int64_t N, int64_t K2,
                int64_t m0, int64_t m1, int64_t b_begin, int64_t b_end) {
  const int64_t ldy = SILU ? N / 2 : N, unit = SILU ? 2 : 1;  // blocks per indivisible unit
  const int64_t units = (b_end - b_begin) / unit, per = kNR / unit;
  const int64_t np = (units + per - 1) / per;  // panels
  if (np == 0) return;
  const int64_t row_blocks = (m1 - m0 + kMR - 1) / kMR;
  auto panel_begin = [&](int64_t j) { return b_begin + unit * (units * j / np); };  // even sizes
  for (int64_t j = 0; j < np; ++j) {
    const int64_t b0 = panel_begin(j), nb = panel_begin(j + 1) - b0;
    const uint32_t* w = wp + b0 * K2 * 16;
    const bf16* bj = bias != nullptr ? bias + b0 * 16 : nullptr;
    // The next panel's weights (contiguous, `next_lines` cache lines) come in while this one is
    // computed: with several row blocks each takes an equal share, spread over its pairs; one
    // row block streams at memory speed, and only the next panel's first pairs are asked for.
    const int64_t next_blocks = j + 1 < np ? panel_begin(j + 2) - panel_begin(j + 1) : 0;
    const int64_t next_lines = row_blocks > 1 ? next_blocks * K2 : 0;
    const char* next = reinterpret_cast<const char*>(w + nb * K2 * 16);
    if (row_blocks == 1)
      for (int64_t q = 0; q < next_blocks; ++q) _mm_prefetch(next + q * K2 * 64, _MM_HINT_T0);
    panel_rows<SILU>(x, ldx, w, K2, bj, y + (SILU ? b0 * 8 : b0 * 16), ldy, nb, m0, m1, next, next_lines);
  }
}

// Rows [m0, m1) x panels [j0, j1) (a panel = kNR blocks of 16 outputs, the last one what is left).
template <bool SILU>
void run_tiles(const bf16* x, int64_t ldx, const uint32_t* wp, const bf16* bias, bf16* y, int64_t N, int64_t K2,
               int64_t m0, int64_t m1, int64_t j0, int64_t j1) {
  const int64_t blocks = N / 16;
  run_blocks<SILU>(x, ldx, wp, bias, y, N, K2, m0, m1, std::min(blocks, j0 * kNR), std::min(blocks, j1 * kNR));
}

}  // namespace

// Whether this CPU runs the kernel (AVX512_BF16).
bool bf16_linear_supported() { return cpu_has_avx512_bf16(); }

// Dense bf16 [N, K] -> packed bf16 [N/16, K/2, 16, 2] (see the file comment).
at::Tensor bf16_pack_weight(const at::Tensor& w) {
  if (w.dim() != 2 || w.scalar_type() != at::kBFloat16 || w.size(0) % 16 || w.size(1) % 2)
    throw std::invalid_argument("bf16_pack_weight takes a bf16 [N, K] weight with N a multiple of 16 and K even");
  const int64_t N = w.size(0), K = w.size(1);
  return w.contiguous().view({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

namespace {

std::optional<at::Tensor> run_linear(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias,
                                     bool silu) {
  if (!cpu_has_avx512_bf16() || x.dim() != 2 || wp.dim() != 4 || x.scalar_type() != at::kBFloat16 ||
      wp.scalar_type() != at::kBFloat16 || !wp.is_contiguous() || x.stride(1) != 1 || wp.size(2) != 16 ||
      wp.size(3) != 2 || (silu && (bias || wp.size(0) % 2)))
    return std::nullopt;
  const int64_t M = x.size(0), K = x.size(1), K2 = wp.size(1), N = wp.size(0) * 16;
  if (K2 * 2 != K)
    throw std::invalid_argument("bf16_linear: x has " + std::to_string(K) + " features but the packed weight takes " +
                                std::to_string(K2 * 2));
  if (bias && (bias->scalar_type() != at::kBFloat16 || bias->numel() != N || !bias->is_contiguous()))
    return std::nullopt;
  auto y = at::empty({M, silu ? N / 2 : N}, x.options());
  if (M == 0) return y;
  const bf16* xd = x.data_ptr<bf16>();
  const auto* wd = reinterpret_cast<const uint32_t*>(wp.data_ptr<bf16>());
  const bf16* bd = bias ? bias->data_ptr<bf16>() : nullptr;
  bf16* yd = y.data_ptr<bf16>();
  const int64_t ldx = x.stride(0), panels = (N / 16 + kNR - 1) / kNR;
  const int64_t threads = at::get_num_threads();
  auto tiles = [&](int64_t m0, int64_t m1, int64_t j0, int64_t j1) {
    if (silu) run_tiles<true>(xd, ldx, wd, bd, yd, N, K2, m0, m1, j0, j1);
    else run_tiles<false>(xd, ldx, wd, bd, yd, N, K2, m0, m1, j0, j1);
  };
  // Row chunks per panel that make the (panel, chunk) tasks divide evenly among the threads:
  // 9 panels (576 outputs) on 2 threads split 5 / 4 by columns alone.
  const int64_t R = threads / std::gcd(panels, threads);
  if (threads <= 1 || M * N * K < kOneThreadMaxMacs) {
    tiles(0, M, 0, panels);
  } else if (M >= kTaskRows) {  // prefill-sized: (panel, row chunk) tasks, taken as threads free up
    const int64_t chunks = (M + kTaskRows - 1) / kTaskRows;
    parallel_dynamic(panels * chunks, [&](int64_t t) {
      const int64_t j = t / chunks, r = t % chunks;
      tiles(r * kTaskRows, std::min(M, (r + 1) * kTaskRows), j, j + 1);
    });
  } else if (R > 1 && M >= 64 * R && panels < 16 * threads) {  // prefill-sized: even tasks
    const int64_t chunk = ((M + R - 1) / R + kMR - 1) / kMR * kMR;  // whole micro-tiles
    at::parallel_for(0, panels * R, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t j = t / R, r = t % R;
        tiles(std::min(M, r * chunk), std::min(M, (r + 1) * chunk), j, j + 1);
      }
    });
  } else if (panels >= 4 * threads || M < 4 * kMR * threads) {
    // split the columns, in equal shares of blocks (SILU: of gate / up pairs): 36 blocks go
    // 18 / 18 on 2 threads where whole panels went 20 / 16 (batch 32 on a Zen 5, 30 layers'
    // weights cycled: qkv / o / down 49.3 / 30.4 / 72.7 us -> 48.4 / 29.4 / 69.3)
    const int64_t unit = silu ? 2 : 1, units = N / 16 / unit;
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b0 = unit * (units * t / threads), b1 = unit * (units * (t + 1) / threads);
        if (silu) run_blocks<true>(xd, ldx, wd, bd, yd, N, K2, 0, M, b0, b1);
        else run_blocks<false>(xd, ldx, wd, bd, yd, N, K2, 0, M, b0, b1);
      }
    });
  } else {  // few panels, many rows: split the rows (in whole micro-tiles)
    const int64_t row_tiles = (M + kMR - 1) / kMR;
    at::parallel_for(0, row_tiles, 1, [&](int64_t t0, int64_t t1) { tiles(t0 * kMR, std::min(M, t1 * kMR), 0, panels); });
  }
  return y;
}

// ---- int8 weights (pack_int8_weight's layout), dequantised a panel at a time --------------------

// Packed int8 rows [N, K + 4]: row n's K int8 values, then its float32 scale. Weight rows
// [r0, r0 + 16) (`w` points at row r0) -> one 16-output block of the packed bf16 layout,
// [K / 2][16] pairs into `out`: w[r][k] = bf16(q[r][k] * scale[r]) rounded to nearest even,
// exactly what dequantize_int8_weight then bf16_pack_weight give. K a multiple of 32: per 32
// columns, 16 rows of 32 int8 -> 16 registers of 16 bf16 pairs, transposed to 16 pairs of 16
// rows.
MOPS_BF16_TARGET inline void dequant_block(const int8_t* w, int64_t ldw, int64_t K, uint32_t* out) {
  float scale[16];
  for (int r = 0; r < 16; ++r) std::memcpy(&scale[r], w + r * ldw + K, sizeof(float));
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    __m512i m[16];
    for (int r = 0; r < 16; ++r) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * ldw + k0));
      const __m512 s = _mm512_set1_ps(scale[r]);
      const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), s);
      const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), s);
      m[r] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // columns k0 .. k0 + 31 of row r: 16 pairs
    }
    transpose16x16(m);  // m[p]: pair p of the 16 rows
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + (k0 / 2 + p) * 16, m[p]);
  }
}

// y = x @ dequant(w8)^T + bias (SILU: silu(gate) * up over w8 = [gate; up] rows, no bias): the
// micro-tile of the bf16 kernel over each panel's weights dequantised into a per-thread buffer
// (L1 / L2-sized: 4 x 16 x K bf16). Tasks are (panel, up to kTaskRows rows), taken as threads
// free up; each dequantises its panel once (at 128 rows the call takes ~1.15x the bf16 matmul).
std::optional<at::Tensor> run_int8_linear(const at::Tensor& x, const at::Tensor& w8,
                                          const std::optional<at::Tensor>& bias, bool silu) {
  if (!cpu_has_avx512_bf16() || x.dim() != 2 || w8.dim() != 2 || x.scalar_type() != at::kBFloat16 ||
      w8.scalar_type() != at::kChar || !w8.is_contiguous() || x.stride(1) != 1 || (silu && bias))
    return std::nullopt;
  const int64_t M = x.size(0), K = x.size(1), ldw = w8.size(1), N = w8.size(0);
  if (ldw != K + 4)
    throw std::invalid_argument("int8 linear: x has " + std::to_string(K) + " features but the packed int8 weight takes " +
                                std::to_string(ldw - 4));
  if (N % (silu ? 32 : 16) || K % 32) return std::nullopt;
  if (bias && (bias->scalar_type() != at::kBFloat16 || bias->numel() != N || !bias->is_contiguous()))
    return std::nullopt;
  auto y = at::empty({M, silu ? N / 2 : N}, x.options());
  if (M == 0) return y;
  const bf16* xd = x.data_ptr<bf16>();
  const auto* wd = w8.data_ptr<int8_t>();
  const bf16* bd = bias ? bias->data_ptr<bf16>() : nullptr;
  bf16* yd = y.data_ptr<bf16>();
  const int64_t ldx = x.stride(0), K2 = K / 2, blocks = N / 16, panels = (blocks + kNR - 1) / kNR;
  const int64_t ldy = silu ? N / 2 : N, chunks = (M + kTaskRows - 1) / kTaskRows;
  auto task = [&](int64_t t) {
    thread_local std::vector<uint32_t> buf;
    buf.resize(kNR * K2 * 16);
    const int64_t j = t / chunks, r = t % chunks, b0 = j * kNR, nb = std::min(kNR, blocks - b0);
    for (int64_t b = 0; b < nb; ++b) {
      // SILU: packed block b0 + b is gate block (b0 + b) / 2 or the up block of that index,
      // alternating, as _interleave_gate_up orders the bf16 weight
      const int64_t row = silu ? ((b0 + b) % 2) * (N / 2) + ((b0 + b) / 2) * 16 : (b0 + b) * 16;
      dequant_block(wd + row * ldw, ldw, K, buf.data() + b * K2 * 16);
    }
    const int64_t m0 = r * kTaskRows, m1 = std::min(M, m0 + kTaskRows);
    if (silu) panel_rows<true>(xd, ldx, buf.data(), K2, nullptr, yd + b0 * 8, ldy, nb, m0, m1, nullptr, 0);
    else panel_rows<false>(xd, ldx, buf.data(), K2, bd != nullptr ? bd + b0 * 16 : nullptr, yd + b0 * 16, ldy, nb, m0,
                           m1, nullptr, 0);
  };
  if (at::get_num_threads() <= 1 || M * N * K < kOneThreadMaxMacs) {
    for (int64_t t = 0; t < panels * chunks; ++t) task(t);
  } else {
    parallel_dynamic(panels * chunks, task);
  }
  return y;
}

}  // namespace

// x [M, K] bf16 (rows contiguous, any row stride), int8 weight as pack_int8_weight lays it out
// ([N, K + 4], per-row float32 scales), bias [N] bf16 or None: x @ (q * scale)^T + bias with the
// weight rounded to bf16 first (the dense bf16 matmul over dequantize_int8_weight(w, bf16)).
// None when the call does not fit (no AVX512_BF16, other dtypes, N not a multiple of 16, K
// not of 32); ValueError when x's features are not the weight's.
std::optional<at::Tensor> bf16_int8_weight_linear(const at::Tensor& x, const at::Tensor& w8,
                                                  const std::optional<at::Tensor>& bias) {
  return run_int8_linear(x, w8, bias, false);
}

// silu(x @ gate^T) * (x @ up^T) over an int8 [gate; up] weight (pack_int8_weight of the
// [2W, K] weight; W a multiple of 16): bf16_gate_up_silu over the dequantised weight.
std::optional<at::Tensor> bf16_int8_weight_gate_up_silu(const at::Tensor& x, const at::Tensor& w8) {
  return run_int8_linear(x, w8, std::nullopt, true);
}

// x [M, K] bf16 (rows contiguous, any row stride), packed weight as bf16_pack_weight returns,
// bias [N] bf16 or None. None when the call does not fit (no AVX512_BF16, other dtypes).
std::optional<at::Tensor> bf16_linear(const at::Tensor& x, const at::Tensor& wp,
                                      const std::optional<at::Tensor>& bias) {
  return run_linear(x, wp, bias, false);
}

// silu(x @ gate^T) * (x @ up^T), [M, W], over a packed weight whose 16-row blocks alternate
// gate block j, up block j (mooncake_ops.linear packs it so): the SwiGLU input of a down
// projection in one pass, the [M, 2W] intermediate never written. No bias.
std::optional<at::Tensor> bf16_gate_up_silu(const at::Tensor& x, const at::Tensor& wp) {
  return run_linear(x, wp, std::nullopt, true);
}

namespace parts {

void bf16_linear_blocks(const bf16* x, int64_t ldx, const uint32_t* wp, const bf16* bias, bf16* y, int64_t N,
                        int64_t K2, int64_t M, int64_t b0, int64_t b1, bool silu) {
  if (silu) run_blocks<true>(x, ldx, wp, bias, y, N, K2, 0, M, b0, b1);
  else run_blocks<false>(x, ldx, wp, bias, y, N, K2, 0, M, b0, b1);
}

}  // namespace parts
}  // namespace mops
