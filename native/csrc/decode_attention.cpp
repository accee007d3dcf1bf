// Paged decode attention on CPU: one query token per sequence, GQA, fp32 / bf16 / fp16 / int8
// caches with arbitrary block / token / head strides (head_dim contiguous).
//
// Work item = (sequence b, KV head h, split s). Item covers the sequence's blocks
// [s * bps, (s + 1) * bps) and the G = num_heads / num_kv_heads query heads that share h:
//
//   for each block:  scores[g][t] = (q[g] * scale) . k[t]      (int8: times k_scale[t])
//                    online softmax: m, l rescaled by exp(m_old - m_new)
//                    acc[g] += exp(scores[g][t] - m) * v[t]     (int8: times v_scale[t])
//
// With one split the item writes acc / l straight to out; with several (short batches on
// many threads) each writes (m, l, acc) and a combine pass merges them:
//   out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s,  M = max_s m_s.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"
#include "vec.h"

namespace mops {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct CacheView {
  const void* data;
  int64_t sb, st, sh;  // element strides of block, token, head
  const float* scale;  // int8 caches only
  int64_t ssb, sst, ssh;
};

struct DecodeArgs {
  int64_t batch, num_kv_heads, group, max_blocks, block_size;
  float scale;
  const int32_t* block_tables;
  const int32_t* context_lens;
  CacheView k, v;
};

struct State {  // running softmax state of one item: m[G], l[G], acc[G][D]
  float* m;
  float* l;
  float* acc;
};

template <int NC, typename CT>
inline void load_row(const CT* p, __m512 (&r)[NC]) {
  for (int c = 0; c < NC; ++c) r[c] = load16(p + 16 * c);
}

template <int NC, typename CT>
void block_scores(const DecodeArgs& a, const CT* kb, const float* ksc, int64_t n, int G,
                  const float* qf, float* sc) {
  constexpr int D = 16 * NC;
  for (int64_t t = 0; t < n; ++t) {
    __m512 kr[NC];
    load_row<NC>(kb + t * a.k.st, kr);
    const float ks = ksc ? ksc[t * a.k.sst] : 1.0f;
    for (int g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qg), kr[0]);
      for (int c = 1; c < NC; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kr[c], s);
      sc[g * a.block_size + t] = _mm512_reduce_add_ps(s) * ks;
    }
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
  const float alpha = std::exp(m - m_new);
  if (alpha != 1.0f) {
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

template <int NC, typename CT>
void block_values(const DecodeArgs& a, const CT* vb, const float* vsc, int64_t n, int G,
                  const float* p, float* acc) {
  constexpr int D = 16 * NC;
  for (int64_t t = 0; t < n; ++t) {
    __m512 vr[NC];
    load_row<NC>(vb + t * a.v.st, vr);
    const float vs = vsc ? vsc[t * a.v.sst] : 1.0f;
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * a.block_size + t] * vs);
      float* ag = acc + g * D;
      for (int c = 0; c < NC; ++c)
        _mm512_storeu_ps(ag + 16 * c, _mm512_fmadd_ps(pg, vr[c], _mm512_loadu_ps(ag + 16 * c)));
    }
  }
}

template <int NC, typename QT, typename CT>
void attend(const DecodeArgs& a, const QT* q, int64_t b, int64_t h, int64_t j0, int64_t j1,
            State st, float* qf, float* sc) {
  constexpr int D = 16 * NC;
  const int G = static_cast<int>(a.group);
  const __m512 vscale = _mm512_set1_ps(a.scale);
  for (int g = 0; g < G; ++g) {
    const QT* qg = q + (b * a.num_kv_heads * G + h * G + g) * D;
    for (int c = 0; c < D; c += 16) _mm512_storeu_ps(qf + g * D + c, _mm512_mul_ps(load16(qg + c), vscale));
    st.m[g] = kNegInf;
    st.l[g] = 0.0f;
    std::fill(st.acc + g * D, st.acc + (g + 1) * D, 0.0f);
  }
  const int64_t ctx = a.context_lens[b];
  const CT* kbase = static_cast<const CT*>(a.k.data);
  const CT* vbase = static_cast<const CT*>(a.v.data);
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t blk = a.block_tables[b * a.max_blocks + j];
    const int64_t n = std::min(a.block_size, ctx - j * a.block_size);
    const float* ksc = a.k.scale ? a.k.scale + blk * a.k.ssb + h * a.k.ssh : nullptr;
    const float* vsc = a.v.scale ? a.v.scale + blk * a.v.ssb + h * a.v.ssh : nullptr;
    block_scores<NC>(a, kbase + blk * a.k.sb + h * a.k.sh, ksc, n, G, qf, sc);
    for (int g = 0; g < G; ++g)
      softmax_update<NC>(sc + g * a.block_size, n, st.m[g], st.l[g], st.acc + g * D);
    block_values<NC>(a, vbase + blk * a.v.sb + h * a.v.sh, vsc, n, G, sc, st.acc);
  }
}

template <int NC, typename QT>
void finish_row(const float* acc, float l, QT* out) {
  const __m512 inv = _mm512_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
  for (int c = 0; c < 16 * NC; c += 16) store16(out + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c), inv));
}

// Merges the splits of every (b, h, g) row: see the file comment.
template <int NC, typename QT>
void combine(const DecodeArgs& a, int64_t nsplit, const float* part, QT* out) {
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
      finish_row<NC>(acc.data(), l, out + r * D);
    }
  });
}

template <int NC, typename QT, typename CT>
void run(const DecodeArgs& a, const QT* q, QT* out, int64_t nsplit, int64_t bps, bool parallel) {
  constexpr int D = 16 * NC;
  const int64_t G = a.group, items = a.batch * a.num_kv_heads * nsplit, stride = G * (D + 2);
  std::vector<float> part(nsplit > 1 ? items * stride : 0);
  at::parallel_for(0, items, parallel ? 1 : items, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(G * (2 * D + a.block_size + 2));
    float* qf = buf.data();
    float* sc = qf + G * D;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i % nsplit, bh = i / nsplit, h = bh % a.num_kv_heads, b = bh / a.num_kv_heads;
      const int64_t nblk = (a.context_lens[b] + a.block_size - 1) / a.block_size;
      float* base = nsplit > 1 ? part.data() + i * stride : sc + G * a.block_size;
      State st{base, base + G, base + 2 * G};
      attend<NC, QT, CT>(a, q, b, h, s * bps, std::min(nblk, (s + 1) * bps), st, qf, sc);
      if (nsplit == 1)
        for (int64_t g = 0; g < G; ++g) finish_row<NC>(st.acc + g * D, st.l[g], out + (bh * G + g) * D);
    }
  });
  if (nsplit > 1) combine<NC>(a, nsplit, part.data(), out);
}

struct Extent {
  int64_t total_tokens, max_blocks;  // over the batch
};

// Checks every value the kernel will dereference; returns the batch's extent (for the split).
Extent check_tables(const DecodeArgs& a, int64_t num_blocks) {
  Extent e{0, 0};
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t ctx = a.context_lens[b];
    if (ctx < 0 || ctx > a.max_blocks * a.block_size)
      throw std::invalid_argument("context_lens[" + std::to_string(b) + "] = " + std::to_string(ctx) +
                                  " does not fit block_tables' " + std::to_string(a.max_blocks) + " blocks x " +
                                  std::to_string(a.block_size) + " tokens; lengths must be in [0, capacity]");
    for (int64_t j = 0; j * a.block_size < ctx; ++j) {
      const int64_t id = a.block_tables[b * a.max_blocks + j];
      if (id < 0 || id >= num_blocks)
        throw std::invalid_argument("block_tables[" + std::to_string(b) + ", " + std::to_string(j) + "] = " +
                                    std::to_string(id) + " is used but outside the cache's " +
                                    std::to_string(num_blocks) + " blocks");
    }
    e.total_tokens += ctx;
    e.max_blocks = std::max(e.max_blocks, (ctx + a.block_size - 1) / a.block_size);
  }
  return e;
}

CacheView view_of(const at::Tensor& c, const std::optional<at::Tensor>& s) {
  CacheView v{c.data_ptr(), c.stride(0), c.stride(1), c.stride(2), nullptr, 0, 0, 0};
  if (s) {
    v.scale = s->data_ptr<float>();
    v.ssb = s->stride(0);
    v.sst = s->stride(1);
    v.ssh = s->stride(2);
  }
  return v;
}

}  // namespace

// Returns nullopt when the call does not fit the kernel (the caller then runs the reference).
std::optional<at::Tensor> paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                 const at::Tensor& context_lens, double scale,
                                                 const std::optional<at::Tensor>& k_scale,
                                                 const std::optional<at::Tensor>& v_scale,
                                                 const std::optional<at::Tensor>& out_buffer) {
  if (k_cache.stride(3) != 1 || v_cache.stride(3) != 1 || k_cache.strides() != v_cache.strides())
    return std::nullopt;
  const auto bt = block_tables.to(at::kInt).contiguous();
  const auto cl = context_lens.to(at::kInt).contiguous();
  const auto qc = q.contiguous();
  const int64_t num_kv_heads = k_cache.size(2);
  DecodeArgs a{q.size(0), num_kv_heads, q.size(1) / num_kv_heads, bt.size(1), k_cache.size(1),
               static_cast<float>(scale), bt.data_ptr<int32_t>(), cl.data_ptr<int32_t>(),
               view_of(k_cache, k_scale), view_of(v_cache, v_scale)};
  const Extent e = check_tables(a, k_cache.size(0));
  auto out = out_buffer ? *out_buffer : at::empty_like(qc);  // caller checked shape, contiguity
  // Below ~64k multiply-adds a parallel region costs more than it saves.
  const bool parallel = e.total_tokens * q.size(1) * q.size(2) >= (1 << 16) && at::get_num_threads() > 1;
  const int64_t base = a.batch * num_kv_heads, want = 2 * at::get_num_threads();
  const int64_t nsplit = parallel && base < want ? std::max<int64_t>(1, std::min(e.max_blocks, (want + base - 1) / base)) : 1;
  const int64_t bps = std::max<int64_t>(1, (e.max_blocks + nsplit - 1) / nsplit);
  bool done = false;
  with_chunks(q.size(2), [&](auto nc) {
    constexpr int NC = decltype(nc)::value;
    with_float_type(q.scalar_type(), [&](auto qt) {
      using QT = decltype(qt);
      if (k_cache.scalar_type() == at::kChar) {
        run<NC, QT, int8_t>(a, qc.data_ptr<QT>(), out.data_ptr<QT>(), nsplit, bps, parallel);
        done = true;
      } else if (k_cache.scalar_type() == q.scalar_type()) {
        run<NC, QT, QT>(a, qc.data_ptr<QT>(), out.data_ptr<QT>(), nsplit, bps, parallel);
        done = true;
      }
    });
  });
  if (!done) return std::nullopt;
  return out;
}

}  // namespace mops
