// Causal paged prefill attention for CPUs with AVX2 + FMA + F16C but no AVX-512 (module
// mooncake_ops_native_avx2): fp32 / bf16 / fp16 q, k, v over a cache of the same dtype or int8
// (per-token float32 scales), the arithmetic in fp32 FMAs. These CPUs have no bf16 dot product:
// torch's flash kernel converts bf16 operands as it goes and ran the default model's prefill
// attention at ~19 GFLOP/s on two Zen 3 cores, against ~85 for its fp32 matmuls.
//
// Sequence s has c cached tokens (in the paged cache) and n new ones (packed in q / k / v); new
// token i attends to keys 0 .. c + i. Work item = (sequence, KV head, tile of TQ new tokens);
// its rows are the tile's tokens x the G query heads sharing the KV head (GQA). Per thread and
// (sequence, KV head), the keys and values the items read are widened to fp32 once, as far as
// the items reach:
//
//   Kt[g][d][l] = k_{8g+l}[d]     8 keys per group: 8 lanes of one key dimension, so RB rows'
//                                 scores for 16 keys are 2 x RB FMAs per dimension, q broadcast
//   Vf[j][d]    = v_j[d]          out += p_j broadcast x (16 lanes of v_j)
//
// RB = 6 rows at a time (2 tokens of a group of 3) take three passes over the keys up to the
// last one any of them sees: the scores (RB x 16 accumulators), then per row its max over the
// keys it sees (the causal mask) and p = exp(s - max), l = sum(p); then out = P.V / l
// (RB x 16 output lanes per pass). Keys past a row's causal edge get p = 0; the exact max needs
// no rescaling. q is scaled once as it is widened.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "../csrc/dispatch.h"
#include "../csrc/prefill_args.h"
#include "vec_avx2.h"

namespace mops {
namespace {

constexpr int RB = 6;        // query rows per block: 12 accumulators of AVX2's 16 registers
constexpr int64_t KG = 8;    // keys per group of the transposed K layout
constexpr int64_t TQ = 32;   // new tokens per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Fewer multiply-adds run on the calling thread (as the AVX2 matmul: one thread here does
// ~30 GFLOP/s, so 2^19 multiply-adds take ~35 us, about what waking the pool may cost).
constexpr int64_t kOneThreadMaxMacs = int64_t{1} << 19;

using Seq = PrefillSeq;
using Args = PrefillArgs<void>;

// Key (or value) row j of sequence b, KV head h, widened to fp32 into dst: cached tokens from
// the pool (int8 rows times their scale), new ones from k / v.
template <int D, typename QT, typename CT>
inline void row_fp32(const Args& a, const Seq& s, int64_t b, int64_t h, int64_t j, bool value, float* dst) {
  if (j >= s.cached) {
    const int64_t r = s.start + j - s.cached;
    const QT* src = value ? static_cast<const QT*>(a.v) + r * a.vs0 + h * a.vs1
                          : static_cast<const QT*>(a.k) + r * a.ks0 + h * a.ks1;
    for (int c = 0; c < D; c += 8) _mm256_storeu_ps(dst + c, load8(src + c));
    return;
  }
  const int64_t blk = a.block_tables[b * a.max_blocks + j / a.block_size], t = j % a.block_size;
  const CT* src = value ? static_cast<const CT*>(a.vc) + blk * a.vcb + t * a.vct + h * a.vch
                        : static_cast<const CT*>(a.kc) + blk * a.cb + t * a.ct + h * a.ch;
  if constexpr (std::is_same_v<CT, int8_t>) {
    const __m256 sc = _mm256_set1_ps(value ? a.vs[blk * a.vssb + t * a.vsst + h * a.vssh]
                                           : a.ks[blk * a.kssb + t * a.ksst + h * a.kssh]);
    for (int c = 0; c < D; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(load8(src + c), sc));
  } else {
    for (int c = 0; c < D; c += 8) _mm256_storeu_ps(dst + c, load8(src + c));
  }
}

// m[i] lane j -> m[j] lane i.
inline void transpose8x8(__m256 (&m)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(m[i], m[i + 1]);      // rows i, i+1: lanes 0,0,1,1 | 4,4,5,5
    t[i + 1] = _mm256_unpackhi_ps(m[i], m[i + 1]);  // lanes 2,2,3,3 | 6,6,7,7
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);      // lane 0 (| 4) of rows i .. i+3
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);  // lane 1 (| 5)
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);  // lane 2 (| 6)
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);  // lane 3 (| 7)
  }
  for (int i = 0; i < 4; ++i) {
    m[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    m[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// Widens key groups [g0, g1) of (b, h) into kt (transposed, see the file comment) and their
// values into vf; keys at or past `total` are zeros (their scores are masked; zero values keep
// 0 x v finite).
template <int D, typename QT, typename CT>
void widen_groups(const Args& a, const Seq& s, int64_t b, int64_t h, int64_t total, int64_t g0, int64_t g1,
                  float* kt, float* vf) {
  alignas(32) float rows[KG][D];
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t i = 0; i < KG; ++i) {
      const int64_t j = g * KG + i;
      if (j < total) {
        row_fp32<D, QT, CT>(a, s, b, h, j, false, rows[i]);
        row_fp32<D, QT, CT>(a, s, b, h, j, true, vf + j * D);
      } else {
        std::fill(rows[i], rows[i] + D, 0.0f);
        std::fill(vf + j * D, vf + (j + 1) * D, 0.0f);
      }
    }
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m256 m[8];
      for (int i = 0; i < 8; ++i) m[i] = _mm256_load_ps(rows[i] + d0);
      transpose8x8(m);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (g * D + d0 + i) * KG, m[i]);
    }
  }
}

// sc[r * ld + 8 (g + n) + l] = qf[r] . k_{8 (g + n) + l} for n < NG: RB x NG accumulators.
template <int D, int NG>
inline void score_groups(const float* qf, const float* kt, int64_t g, float* sc, int64_t ld) {
  __m256 acc[RB][NG];
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NG; ++n) acc[r][n] = _mm256_setzero_ps();
  const float* k0 = kt + g * D * KG;
  for (int d = 0; d < D; ++d) {
    __m256 kv[NG];
    for (int n = 0; n < NG; ++n) kv[n] = _mm256_loadu_ps(k0 + (n * D + d) * KG);
    for (int r = 0; r < RB; ++r) {
      const __m256 qb = _mm256_broadcast_ss(qf + r * D + d);
      for (int n = 0; n < NG; ++n) acc[r][n] = _mm256_fmadd_ps(qb, kv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NG; ++n) _mm256_storeu_ps(sc + r * ld + (g + n) * KG, acc[r][n]);
}

// s[0 .. npad) (scores of keys 0 .. n-1, then padding) -> p = exp(s - max over the first n),
// 0 past n; returns sum(p) (>= 1: the max key adds exp(0)).
inline float softmax_row(float* s, int64_t n, int64_t npad) {
  __m256 vmax = _mm256_set1_ps(kNegInf);
  for (int64_t t = 0; t < n; t += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_loadu_ps(s + t), lanes_below(n - t)));
  const __m256 vm = _mm256_set1_ps(hmax8(vmax));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < npad; t += 8) {
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm)), lanes_below(n - t));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum8(sum);
}

// acc[r][:] = sum_{j < n} p[r * ld + j] v_j: RB rows x 16 output lanes per pass over the keys.
template <int D>
inline void weighted_values(const float* p, int64_t ld, int64_t n, const float* vf, float* acc) {
  for (int c = 0; c < D; c += 16) {
    __m256 o[RB][2];
    for (int r = 0; r < RB; ++r) o[r][0] = o[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = _mm256_loadu_ps(vf + j * D + c), v1 = _mm256_loadu_ps(vf + j * D + c + 8);
      for (int r = 0; r < RB; ++r) {
        const __m256 pb = _mm256_broadcast_ss(p + r * ld + j);
        o[r][0] = _mm256_fmadd_ps(pb, v0, o[r][0]);
        o[r][1] = _mm256_fmadd_ps(pb, v1, o[r][1]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      _mm256_storeu_ps(acc + r * D + c, o[r][0]);
      _mm256_storeu_ps(acc + r * D + c + 8, o[r][1]);
    }
  }
}

template <int D, typename QT, typename CT>
void run(const Args& a, bool parallel) {
  const int64_t G = a.group, H = a.num_kv_heads;
  std::vector<int64_t> seqs;  // indices into a.seqs of sequences with new tokens
  int64_t max_keys = 0;
  for (size_t b = 0; b < a.seqs.size(); ++b)
    if (a.seqs[b].num_new > 0) {
      seqs.push_back(static_cast<int64_t>(b));
      max_keys = std::max(max_keys, a.seqs[b].cached + a.seqs[b].num_new);
    }
  // Items: (sequence, KV head, tile of TQ tokens), threads' ranges of equal cost
  const PrefillItems items_of(a.seqs, std::move(seqs), H, TQ, KG);
  const int64_t items = items_of.size();
  const int64_t max_groups = (max_keys + 2 * KG - 1) / (2 * KG) * 2, max_pad = max_groups * KG;
  const int64_t nt = parallel ? std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)) : 1;
  const std::vector<int64_t> bound = equal_cost_bounds(items_of.cum(), nt);
  auto work = [&](int64_t i0, int64_t i1) {
    if (i0 >= i1) return;
    std::vector<float> kt(max_groups * KG * D), vf(max_groups * KG * D), sc(RB * max_pad), qf(RB * D), acc(RB * D);
    int64_t cur_b = -1, cur_h = -1, widened = 0;  // key groups of (cur_b, cur_h) in kt / vf
    int64_t n = -1;
    for (int64_t i = i0; i < i1; ++i) {
      const auto [b, h, q0, q1] = items_of.at(i, n);
      const Seq& s = a.seqs[b];
      const int64_t total = s.cached + s.num_new;
      const int64_t need = (s.cached + q1 + 2 * KG - 1) / (2 * KG) * 2;  // groups, even, the last token reads
      if (b != cur_b || h != cur_h) {
        cur_b = b;
        cur_h = h;
        widened = 0;
      }
      if (need > widened) {
        widen_groups<D, QT, CT>(a, s, b, h, total, widened, need, kt.data(), vf.data());
        widened = need;
      }
      const int64_t rows = (q1 - q0) * G;
      for (int64_t r0 = 0; r0 < rows; r0 += RB) {
        int64_t last[RB], max_last = 0;
        for (int r = 0; r < RB; ++r) {
          const int64_t row = std::min(r0 + r, rows - 1);  // a short block repeats its last row
          const int64_t tok = q0 + row / G, head = h * G + row % G;
          const QT* qr = static_cast<const QT*>(a.q) + (s.start + tok) * a.qs0 + head * a.qs1;
          const __m256 vscale = _mm256_set1_ps(a.scale);
          for (int c = 0; c < D; c += 8) _mm256_storeu_ps(qf.data() + r * D + c, _mm256_mul_ps(load8(qr + c), vscale));
          last[r] = s.cached + tok;
          max_last = std::max(max_last, last[r]);
        }
        const int64_t groups = (max_last + KG) / KG, npad = groups * KG;
        int64_t g = 0;
        for (; g + 2 <= groups; g += 2) score_groups<D, 2>(qf.data(), kt.data(), g, sc.data(), max_pad);
        if (g < groups) score_groups<D, 1>(qf.data(), kt.data(), g, sc.data(), max_pad);
        float l[RB];
        for (int r = 0; r < RB; ++r) l[r] = softmax_row(sc.data() + r * max_pad, last[r] + 1, npad);
        weighted_values<D>(sc.data(), max_pad, max_last + 1, vf.data(), acc.data());
        for (int r = 0; r < RB && r0 + r < rows; ++r) {
          const int64_t row = r0 + r, tok = q0 + row / G, head = h * G + row % G;
          const __m256 inv = _mm256_set1_ps(1.0f / l[r]);
          QT* o = static_cast<QT*>(a.out) + (s.start + tok) * a.os0 + head * a.os1;
          for (int c = 0; c < D; c += 8) store8(o + c, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + r * D + c), inv));
        }
      }
    }
  };
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) work(bound[t], bound[t + 1]);
  });
}

}  // namespace

// The AVX-512 module's contract (../csrc/attention_bf16.cpp), over more dtypes: q [total_q, H, D],
// k / v [total_q, KVH, D] of one float dtype (head_dim contiguous, any row / head strides),
// caches [blocks, block_size, KVH, D] of that dtype, or int8 with float32 k_scale / v_scale
// [blocks, block_size, KVH]; lengths as the Python op checked them. Block ids a sequence reads
// are checked here (ValueError). None when the call does not fit (other dtypes, head_dim not
// 64 / 128 / 256, an out that is not contiguous like q).
std::optional<at::Tensor> paged_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                  const at::Tensor& block_tables, const at::Tensor& cached_lens,
                                                  const at::Tensor& query_lens, double scale,
                                                  const std::optional<at::Tensor>& k_scale,
                                                  const std::optional<at::Tensor>& v_scale,
                                                  const std::optional<at::Tensor>& out_buffer) {
  const auto dtype = q.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) return std::nullopt;
  Args a;
  const auto call = fill_prefill_args(a, q, k, v, k_cache, v_cache, block_tables, cached_lens, query_lens, scale,
                                      k_scale, v_scale, out_buffer, kOneThreadMaxMacs);
  if (!call) return std::nullopt;
  bool done = false;
  with_chunks(call->head_dim, [&](auto nc) {
    constexpr int DD = 16 * decltype(nc)::value;
    with_float_type(dtype, [&](auto qt) {
      using QT = decltype(qt);
      if (call->int8)
        run<DD, QT, int8_t>(a, call->parallel);
      else
        run<DD, QT, QT>(a, call->parallel);
      done = true;
    });
  });
  if (!done) return std::nullopt;
  return call->out;
}

}  // namespace mops
