// Paged decode attention for CPUs with AVX2 + FMA + F16C but no AVX-512 (e.g. AMD Zen 2 / 3,
// Intel Haswell .. Alder Lake): the module mooncake_ops_native_avx2. Same contract and checks
// as the AVX-512 kernel (../csrc/decode_attention.cpp, see its comment for the method): one
// query token per sequence, GQA, fp32 / bf16 / fp16 q over a cache of the same dtype or int8
// (with per-token scales), any block / token / head strides, optional log-sum-exp output.
//
// Work item = (sequence b, KV head h); no split of a sequence across threads. Per block:
//   K, V rows -> fp32 scratch (int8: times their scale), scores for the G query heads of h,
//   online softmax (running max m, sum l, accumulator acc rescaled when m rises),
//   acc[g] += exp(score - m) * v[t].
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "../csrc/decode_common.h"
#include "../csrc/dispatch.h"
#include "../csrc/step_parts.h"
#include "vec_avx2.h"

namespace mops {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Block rows as fp32 (int8: times their scale) into dst [rows8][D]; rows n..rows8-1 zeroed.
template <int D, typename CT>
void to_fp32(const CT* src, int64_t stride, const float* scale, int64_t scale_stride, int64_t n, int64_t rows8,
             float* dst) {
  for (int64_t t = 0; t < n; ++t) {
    const __m256 s = _mm256_set1_ps(scale ? scale[t * scale_stride] : 1.0f);
    for (int c = 0; c < D; c += 8) _mm256_storeu_ps(dst + t * D + c, _mm256_mul_ps(load8(src + t * stride + c), s));
  }
  std::fill(dst + n * D, dst + rows8 * D, 0.0f);
}

// sc[t] = qg . kf[t] for t < rows8, 8 tokens per step.
template <int D>
void block_scores(const float* qg, const float* kf, int64_t rows8, float* sc) {
  for (int64_t t0 = 0; t0 < rows8; t0 += 8) {
    __m256 acc[8];
    for (int t = 0; t < 8; ++t) {
      const float* k = kf + (t0 + t) * D;
      acc[t] = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(k));
      for (int c = 8; c < D; c += 8) acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c), _mm256_loadu_ps(k + c), acc[t]);
    }
    _mm256_storeu_ps(sc + t0, sum8x8(acc));
  }
}

// Turns scores[0..n) into exp(score - m_new) in place (lanes n..rows8 become 0) and folds
// them into (m, l, acc).
template <int D>
void softmax_update(float* sg, int64_t n, float& m, float& l, float* acc) {
  __m256 vmax = _mm256_set1_ps(kNegInf);
  for (int64_t t = 0; t < n; t += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_loadu_ps(sg + t), lanes_below(n - t)));
  const float m_new = std::max(m, hmax8(vmax));
  if (m_new > m) {  // the running max moved: rescale what was accumulated under the old one
    const __m256 alpha = _mm256_set1_ps(std::exp(m - m_new));
    l *= std::exp(m - m_new);
    for (int c = 0; c < D; c += 8) _mm256_storeu_ps(acc + c, _mm256_mul_ps(_mm256_loadu_ps(acc + c), alpha));
  }
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t += 8) {
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vm)), lanes_below(n - t));
    _mm256_storeu_ps(sg + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  l += hsum8(sum);
  m = m_new;
}

// acc += sum_t p[t] * vf[t], 8 accumulator registers (64 floats) at a time.
template <int D>
void block_values(const float* p, const float* vf, int64_t n, float* acc) {
  constexpr int kStep = D < 64 ? D : 64;
  for (int c0 = 0; c0 < D; c0 += kStep) {
    __m256 a[kStep / 8];
    for (int c = 0; c < kStep / 8; ++c) a[c] = _mm256_loadu_ps(acc + c0 + 8 * c);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 pt = _mm256_set1_ps(p[t]);
      const float* v = vf + t * D + c0;
      for (int c = 0; c < kStep / 8; ++c) a[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * c), a[c]);
    }
    for (int c = 0; c < kStep / 8; ++c) _mm256_storeu_ps(acc + c0 + 8 * c, a[c]);
  }
}

// One (sequence, KV head) item; writes its G rows of out (and lse).
template <int D, typename QT, typename CT>
void attend(const DecodeArgs& a, const QT* q, QT* out, float* lse, int64_t b, int64_t h, float* buf) {
  const int64_t G = a.group, b8 = (a.block_size + 7) / 8 * 8;
  float *qf = buf, *m = qf + G * D, *l = m + G, *acc = l + G, *sc = acc + G * D, *kf = sc + G * b8,
        *vf = kf + b8 * D;
  for (int64_t g = 0; g < G; ++g) {
    const QT* qg = q + ((b * a.num_kv_heads + h) * G + g) * D;
    for (int c = 0; c < D; c += 8)
      _mm256_storeu_ps(qf + g * D + c, _mm256_mul_ps(load8(qg + c), _mm256_set1_ps(a.scale)));
    m[g] = kNegInf;
    l[g] = 0.0f;
  }
  std::fill(acc, acc + G * D, 0.0f);
  const int64_t ctx = a.context_lens[b];
  const CT* kbase = static_cast<const CT*>(a.k.data);
  const CT* vbase = static_cast<const CT*>(a.v.data);
  for (int64_t j = 0; j * a.block_size < ctx; ++j) {
    const int64_t blk = a.block_tables[b * a.max_blocks + j];
    const int64_t n = std::min(a.block_size, ctx - j * a.block_size), n8 = (n + 7) / 8 * 8;
    const float* ksc = a.k.scale ? a.k.scale + blk * a.k.ssb + h * a.k.ssh : nullptr;
    const float* vsc = a.v.scale ? a.v.scale + blk * a.v.ssb + h * a.v.ssh : nullptr;
    to_fp32<D>(kbase + blk * a.k.sb + h * a.k.sh, a.k.st, ksc, a.k.sst, n, n8, kf);
    to_fp32<D>(vbase + blk * a.v.sb + h * a.v.sh, a.v.st, vsc, a.v.sst, n, n, vf);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = sc + g * b8;
      block_scores<D>(qf + g * D, kf, n8, sg);
      softmax_update<D>(sg, n, m[g], l[g], acc + g * D);
      block_values<D>(sg, vf, n, acc + g * D);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t row = (b * a.num_kv_heads + h) * G + g;
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;  // an empty context gives zeros
    for (int c = 0; c < D; ++c) out[row * D + c] = static_cast<QT>(acc[g * D + c] * inv);
    if (lse) lse[row] = l[g] > 0.0f ? m[g] + std::log(l[g]) : kNegInf;
  }
}

template <int D, typename QT, typename CT>
void run(const DecodeArgs& a, const QT* q, QT* out, float* lse, bool parallel) {
  const int64_t G = a.group, b8 = (a.block_size + 7) / 8 * 8, items = a.batch * a.num_kv_heads;
  at::parallel_for(0, items, parallel ? 1 : items, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(G * (2 * D + 2 + b8) + 2 * b8 * D);
    for (int64_t i = i0; i < i1; ++i)
      attend<D, QT, CT>(a, q, out, lse, i / a.num_kv_heads, i % a.num_kv_heads, buf.data());
  });
}

}  // namespace

// See decode_common.h.
std::optional<at::Tensor> paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                 const at::Tensor& context_lens, double scale,
                                                 const std::optional<at::Tensor>& k_scale,
                                                 const std::optional<at::Tensor>& v_scale,
                                                 const std::optional<at::Tensor>& out_buffer,
                                                 const std::optional<at::Tensor>& lse_buffer) {
  auto call = prepare_decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale,
                             out_buffer, lse_buffer);
  if (!call) return std::nullopt;
  bool done = false;
  with_chunks(q.size(2), [&](auto nc) {
    constexpr int D = 16 * decltype(nc)::value;
    with_float_type(q.scalar_type(), [&](auto qt) {
      using QT = decltype(qt);
      const QT* qp = call->qc.data_ptr<QT>();
      QT* op = call->out.data_ptr<QT>();
      if (k_cache.scalar_type() == at::kChar) {
        run<D, QT, int8_t>(call->a, qp, op, call->lse, call->parallel);
        done = true;
      } else if (k_cache.scalar_type() == q.scalar_type()) {
        run<D, QT, QT>(call->a, qp, op, call->lse, call->parallel);
        done = true;
      }
    });
  });
  if (!done) return std::nullopt;
  return call->out;
}

namespace parts {

bool decode_bf16_items(const bf16* q, bf16* out, const bf16* k_cache, const bf16* v_cache, int64_t block_size,
                       int64_t sb, int64_t st, int64_t sh, int64_t kv_heads, int64_t group, int64_t d,
                       const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens,
                       int64_t /*max_ctx*/, float scale, int64_t i0, int64_t i1) {
  const DecodeArgs a{0, kv_heads, group, max_blocks, block_size, scale, block_tables, context_lens,
                     CacheView{k_cache, sb, st, sh, nullptr, 0, 0, 0}, CacheView{v_cache, sb, st, sh, nullptr, 0, 0, 0}};
  const int64_t b8 = (block_size + 7) / 8 * 8;
  return with_chunks(d, [&](auto nc) {
    constexpr int D = 16 * decltype(nc)::value;
    thread_local std::vector<float> buf;  // attend's scratch, as the entry's run() sizes it
    buf.resize(group * (2 * D + 2 + b8) + 2 * b8 * D);
    for (int64_t i = i0; i < i1; ++i) attend<D, bf16, bf16>(a, q, out, nullptr, i / kv_heads, i % kv_heads, buf.data());
  });
}

}  // namespace parts
}  // namespace mops
