// Paged decode attention on CPU: one query token per sequence, GQA, fp32 / bf16 / fp16 / int8
// caches with arbitrary block / token / head strides (head_dim contiguous).
//
// Work item = (sequence b, KV head h, split s). Item covers the sequence's blocks
// [s * bps, (s + 1) * bps) and the G = num_heads / num_kv_heads query heads that share h:
//
//   for each block:  K, V rows -> fp32 scratch (int8: times k_scale[t] / v_scale[t])
//                    scores[g][t] = (q[g] * scale) . k[t]        16 tokens per step
//                    online softmax: m, l rescaled by exp(m_old - m_new)
//                    acc[g] += exp(scores[g][t] - m) * v[t]       acc in registers
//
// With one split the item writes acc / l straight to out; with several (short batches on
// many threads) each writes (m, l, acc) and a combine pass merges them:
//   out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s,  M = max_s m_s.
// Optionally each row's log-sum-exp m + log(l) (of the scaled scores; -inf for an empty
// context) goes to `lse`: the CPU prefill uses this kernel for the cached-prefix half of a
// chunk (the group then holds every new token's query rows of one KV head) and merges it with
// the causal half by LSE, so an int8 prefix is read in place, block by block.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode_common.h"
#include "dispatch.h"
#include "vec.h"

namespace mops {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct State {  // running softmax state of one item: m[G], l[G], acc[G][D]
  float* m;
  float* l;
  float* acc;
};

// Block rows as fp32 (int8: times their scale) into `dst` [rows16][D]; rows n..rows16-1 zeroed.
template <int NC, typename CT>
void to_fp32(const CT* src, int64_t stride, const float* scale, int64_t scale_stride, int64_t n,
             int64_t rows16, float* dst) {
  constexpr int D = 16 * NC;
  for (int64_t t = 0; t < n; ++t) {
    const __m512 s = _mm512_set1_ps(scale ? scale[t * scale_stride] : 1.0f);
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(dst + t * D + 16 * c, _mm512_mul_ps(load16(src + t * stride + 16 * c), s));
  }
  std::fill(dst + n * D, dst + rows16 * D, 0.0f);
}

// Asks for a block's rows of one head ahead of use: blocks are scattered, so the hardware
// prefetcher cannot guess the next one.
template <typename CT>
inline void prefetch_rows(const CT* rows, int64_t stride, int64_t n, int64_t bytes) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t off = 0; off < bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows + t * stride) + off, _MM_HINT_T0);
}

// sc[t] = qg . kf[t] for t < rows16, 16 tokens per step (independent FMA chains, one
// transpose-add per 16 tokens instead of a horizontal sum per token).
template <int NC>
void block_scores(const float* qg, const float* kf, int64_t rows16, float* sc) {
  constexpr int D = 16 * NC;
  __m512 q[NC];
  for (int c = 0; c < NC; ++c) q[c] = _mm512_loadu_ps(qg + 16 * c);
  for (int64_t t0 = 0; t0 < rows16; t0 += 16) {
    __m512 acc[16];
    for (int t = 0; t < 16; ++t) {
      const float* k = kf + (t0 + t) * D;
      acc[t] = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
      for (int c = 1; c < NC; ++c) acc[t] = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + 16 * c), acc[t]);
    }
    _mm512_storeu_ps(sc + t0, sum16x16(acc));
  }
}

// Turns scores[0..n) into exp(score - m_new) in place and folds them into (m, l, acc).
template <int NC>
void softmax_update(float* sg, int64_t n, float& m, float& l, float* acc) {
  constexpr int D = 16 * NC;
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int64_t t = 0; t < n; t += 16)
    vmax = _mm512_mask_max_ps(vmax, tail_mask(n - t), vmax, _mm512_maskz_loadu_ps(tail_mask(n - t), sg + t));
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  if (m_new > m) {  // the running max moved: rescale what was accumulated under the old one
    const float alpha = std::exp(m - m_new);
    l *= alpha;
    for (int c = 0; c < D; c += 16)
      _mm512_storeu_ps(acc + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c), _mm512_set1_ps(alpha)));
  }
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = tail_mask(n - t);
    __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + t), vm)));
    _mm512_mask_storeu_ps(sg + t, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  l += _mm512_reduce_add_ps(sum);
  m = m_new;
}

// acc += sum_t p[t] * vf[t], the accumulator held in registers across the block.
template <int NC>
void block_values(const float* p, const float* vf, int64_t n, float* acc) {
  constexpr int D = 16 * NC;
  __m512 a[NC];
  for (int c = 0; c < NC; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 pt = _mm512_set1_ps(p[t]);
    for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vf + t * D + 16 * c), a[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

struct Scratch {  // per thread: q [G][D], scores [G][B16], K and V block rows [B16][D] (fp32)
  float* qf;
  float* sc;
  float* kf;
  float* vf;
};

template <int NC, typename QT, typename CT>
void attend(const DecodeArgs& a, const QT* q, int64_t b, int64_t h, int64_t j0, int64_t j1,
            State st, Scratch w) {
  constexpr int D = 16 * NC;
  const int G = static_cast<int>(a.group);
  const int64_t b16 = (a.block_size + 15) / 16 * 16;
  const __m512 vscale = _mm512_set1_ps(a.scale);
  for (int g = 0; g < G; ++g) {
    const QT* qg = q + (b * a.num_kv_heads * G + h * G + g) * D;
    for (int c = 0; c < D; c += 16) _mm512_storeu_ps(w.qf + g * D + c, _mm512_mul_ps(load16(qg + c), vscale));
    st.m[g] = kNegInf;
    st.l[g] = 0.0f;
    std::fill(st.acc + g * D, st.acc + (g + 1) * D, 0.0f);
  }
  const int64_t ctx = a.context_lens[b];
  const CT* kbase = static_cast<const CT*>(a.k.data);
  const CT* vbase = static_cast<const CT*>(a.v.data);
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t blk = a.block_tables[b * a.max_blocks + j];
    const int64_t n = std::min(a.block_size, ctx - j * a.block_size), n16 = (n + 15) / 16 * 16;
    const float* ksc = a.k.scale ? a.k.scale + blk * a.k.ssb + h * a.k.ssh : nullptr;
    const float* vsc = a.v.scale ? a.v.scale + blk * a.v.ssb + h * a.v.ssh : nullptr;
    if (j + 1 < j1) {
      const int64_t next = a.block_tables[b * a.max_blocks + j + 1];
      const int64_t rows = std::min(a.block_size, ctx - (j + 1) * a.block_size);
      prefetch_rows(kbase + next * a.k.sb + h * a.k.sh, a.k.st, rows, D * sizeof(CT));
      prefetch_rows(vbase + next * a.v.sb + h * a.v.sh, a.v.st, rows, D * sizeof(CT));
    }
    to_fp32<NC>(kbase + blk * a.k.sb + h * a.k.sh, a.k.st, ksc, a.k.sst, n, n16, w.kf);
    to_fp32<NC>(vbase + blk * a.v.sb + h * a.v.sh, a.v.st, vsc, a.v.sst, n, n, w.vf);
    for (int g = 0; g < G; ++g) {
      float* sg = w.sc + g * b16;
      block_scores<NC>(w.qf + g * D, w.kf, n16, sg);
      softmax_update<NC>(sg, n, st.m[g], st.l[g], st.acc + g * D);
      block_values<NC>(sg, w.vf, n, st.acc + g * D);
    }
  }
}

template <int NC, typename QT>
void finish_row(const float* acc, float m, float l, QT* out, float* lse) {
  const __m512 inv = _mm512_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
  for (int c = 0; c < 16 * NC; c += 16) store16(out + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c), inv));
  if (lse) *lse = l > 0.0f ? m + std::log(l) : kNegInf;
}

// Merges the splits of every (b, h, g) row: see the file comment.
template <int NC, typename QT>
void combine(const DecodeArgs& a, int64_t nsplit, const float* part, QT* out, float* lse) {
  constexpr int D = 16 * NC;
  const int64_t G = a.group, rows = a.batch * a.num_kv_heads * G, stride = G * (D + 2);
  at::parallel_for(0, rows, rows, [&](int64_t r0, int64_t r1) {
    std::vector<float> acc(D);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t bh = r / G, g = r % G;
      float big = kNegInf;
      for (int64_t s = 0; s < nsplit; ++s) big = std::max(big, part[(bh * nsplit + s) * stride + g]);
      float l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t s = 0; s < nsplit && big != kNegInf; ++s) {
        const float* p = part + (bh * nsplit + s) * stride;
        if (p[g] == kNegInf) continue;
        const float w = std::exp(p[g] - big);
        l += w * p[G + g];
        for (int c = 0; c < D; c += 16)
          _mm512_storeu_ps(acc.data() + c, _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(p + 2 * G + g * D + c),
                                                           _mm512_loadu_ps(acc.data() + c)));
      }
      finish_row<NC>(acc.data(), big, l, out + r * D, lse ? lse + r : nullptr);
    }
  });
}

template <int NC, typename QT, typename CT>
void run(const DecodeArgs& a, const QT* q, QT* out, float* lse, int64_t nsplit, int64_t bps,
         bool parallel) {
  constexpr int D = 16 * NC;
  const int64_t G = a.group, items = a.batch * a.num_kv_heads * nsplit, stride = G * (D + 2);
  std::vector<float> part(nsplit > 1 ? items * stride : 0);
  const int64_t b16 = (a.block_size + 15) / 16 * 16;
  at::parallel_for(0, items, parallel ? 1 : items, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(G * (D + b16) + 2 * b16 * D + stride);
    Scratch w{buf.data(), buf.data() + G * D, buf.data() + G * (D + b16), buf.data() + G * (D + b16) + b16 * D};
    float* own = w.vf + b16 * D;  // this item's state when there is a single split
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i % nsplit, bh = i / nsplit, h = bh % a.num_kv_heads, b = bh / a.num_kv_heads;
      const int64_t nblk = (a.context_lens[b] + a.block_size - 1) / a.block_size;
      float* base = nsplit > 1 ? part.data() + i * stride : own;
      State st{base, base + G, base + 2 * G};
      attend<NC, QT, CT>(a, q, b, h, s * bps, std::min(nblk, (s + 1) * bps), st, w);
      if (nsplit == 1)
        for (int64_t g = 0; g < G; ++g)
          finish_row<NC>(st.acc + g * D, st.m[g], st.l[g], out + (bh * G + g) * D, lse ? lse + bh * G + g : nullptr);
    }
  });
  if (nsplit > 1) combine<NC>(a, nsplit, part.data(), out, lse);
}

}  // namespace

bool decode_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens,
                 float scale, at::Tensor& out, bool parallel);

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
  const DecodeArgs& a = call->a;
  const Extent& e = call->e;
  const at::Tensor& qc = call->qc;
  at::Tensor& out = call->out;
  float* lse = call->lse;
  const bool parallel = call->parallel;
  const int64_t num_kv_heads = a.num_kv_heads;
  const int64_t base = a.batch * num_kv_heads, want = 2 * at::get_num_threads();
  const int64_t nsplit = parallel && base < want ? std::max<int64_t>(1, std::min(e.max_blocks, (want + base - 1) / base)) : 1;
  const int64_t bps = std::max<int64_t>(1, (e.max_blocks + nsplit - 1) / nsplit);
  // bf16 over a bf16 cache, one split, no LSE asked: the AVX512_BF16 kernel (attention_bf16.cpp)
  if (nsplit == 1 && !lse && decode_bf16(qc, k_cache, v_cache, a.block_tables, a.max_blocks, a.context_lens,
                                         a.scale, out, parallel))
    return out;
  bool done = false;
  with_chunks(q.size(2), [&](auto nc) {
    constexpr int NC = decltype(nc)::value;
    with_float_type(q.scalar_type(), [&](auto qt) {
      using QT = decltype(qt);
      if (k_cache.scalar_type() == at::kChar) {
        run<NC, QT, int8_t>(a, qc.data_ptr<QT>(), out.data_ptr<QT>(), lse, nsplit, bps, parallel);
        done = true;
      } else if (k_cache.scalar_type() == q.scalar_type()) {
        run<NC, QT, QT>(a, qc.data_ptr<QT>(), out.data_ptr<QT>(), lse, nsplit, bps, parallel);
        done = true;
      }
    });
  });
  if (!done) return std::nullopt;
  return out;
}

}  // namespace mops
