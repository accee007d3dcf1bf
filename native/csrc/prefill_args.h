// The arguments of a causal paged prefill attention call as both builds' kernels read them
// (attention_bf16.cpp in the AVX-512 module, ../csrc_avx2/prefill_attention_avx2.cpp in the
// AVX2 one), and the checks and layout that fill them from the op's tensors: one contract for
// both, each build declining (None) the dtypes its arithmetic does not take before calling.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "dispatch.h"

namespace mops {

struct PrefillSeq {
  int64_t cached, num_new, start;  // start: the sequence's first row in q / k / v
};

// T: the element type of q / k / v / out as the kernel reads them (void where it casts per call).
template <typename T>
struct PrefillArgs {
  const T *q, *k, *v;
  const void *kc, *vc;                    // q's dtype, or int8 with per-token scales ks / vs
  const float *ks, *vs;
  int64_t kssb, ksst, kssh, vssb, vsst, vssh;
  T* out;
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;  // row / head strides of q, k, v
  int64_t cb, ct, ch, vcb, vct, vch;      // block / token / head strides of the caches
  int64_t os0, os1;
  const int32_t* block_tables;
  int64_t max_blocks, block_size, num_kv_heads, group;
  float scale;
  std::vector<PrefillSeq> seqs;
};

// What fill_prefill_args leaves besides the arguments: the output, the block table the
// arguments point into (kept alive for the call), whether the cache is int8, the head_dim, and
// whether the call is large enough for the thread pool.
struct PrefillCall {
  at::Tensor out, block_tables;
  bool int8, parallel;
  int64_t head_dim;
};

// q [total_q, H, D], k / v [total_q, KVH, D] of q's dtype (head_dim contiguous, any row / head
// strides), caches [blocks, block_size, KVH, D] of q's dtype or int8 with float32 k_scale /
// v_scale [blocks, block_size, KVH]; lengths as the Python op checked them (cached_lens within
// the table, query_lens summing to total_q). Fills `a`; nullopt when the call does not fit
// (mixed dtypes, ranks or sizes that do not match, an out buffer that is not contiguous like
// q). Block ids a sequence reads are checked here (ValueError). Calls of fewer than
// `one_thread_max_macs` multiply-adds run on the calling thread.
template <typename T>
std::optional<PrefillCall> fill_prefill_args(PrefillArgs<T>& a, const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& k_cache,
                                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                                             const at::Tensor& cached_lens, const at::Tensor& query_lens,
                                             double scale, const std::optional<at::Tensor>& k_scale,
                                             const std::optional<at::Tensor>& v_scale,
                                             const std::optional<at::Tensor>& out_buffer,
                                             int64_t one_thread_max_macs) {
  const auto dtype = q.scalar_type();
  for (const at::Tensor* t : {&q, &k, &v})
    if (t->scalar_type() != dtype || t->stride(-1) != 1) return std::nullopt;
  const bool int8 = k_cache.scalar_type() == at::kChar;
  if (int8 != (v_cache.scalar_type() == at::kChar) || int8 != (k_scale.has_value() && v_scale.has_value()))
    return std::nullopt;
  if (!int8 && (k_cache.scalar_type() != dtype || v_cache.scalar_type() != dtype)) return std::nullopt;
  if (k_cache.stride(-1) != 1 || v_cache.stride(-1) != 1) return std::nullopt;
  if (int8 && (k_scale->scalar_type() != at::kFloat || v_scale->scalar_type() != at::kFloat)) return std::nullopt;
  if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3 || k_cache.dim() != 4 || v_cache.dim() != 4) return std::nullopt;
  const int64_t D = q.size(2), H = q.size(1), KVH = k_cache.size(2);
  if (KVH == 0 || H % KVH || k.size(1) != KVH || v.size(1) != KVH || k.size(2) != D || k_cache.size(3) != D)
    return std::nullopt;
  if (out_buffer && (out_buffer->scalar_type() != dtype || !out_buffer->is_contiguous() ||
                     out_buffer->sizes() != q.sizes()))
    return std::nullopt;
  PrefillCall call{out_buffer ? *out_buffer : at::empty(q.sizes(), q.options()),
                   block_tables.to(at::kInt).contiguous(), int8, false, D};
  const auto cl = cached_lens.to(at::kLong).contiguous();
  const auto ql = query_lens.to(at::kLong).contiguous();
  a = PrefillArgs<T>{};
  a.q = static_cast<const T*>(q.data_ptr());
  a.k = static_cast<const T*>(k.data_ptr());
  a.v = static_cast<const T*>(v.data_ptr());
  a.kc = k_cache.data_ptr();
  a.vc = v_cache.data_ptr();
  if (int8) {
    a.ks = k_scale->data_ptr<float>();
    a.vs = v_scale->data_ptr<float>();
    a.kssb = k_scale->stride(0), a.ksst = k_scale->stride(1), a.kssh = k_scale->stride(2);
    a.vssb = v_scale->stride(0), a.vsst = v_scale->stride(1), a.vssh = v_scale->stride(2);
  }
  a.out = static_cast<T*>(call.out.data_ptr());
  a.qs0 = q.stride(0), a.qs1 = q.stride(1), a.ks0 = k.stride(0), a.ks1 = k.stride(1);
  a.vs0 = v.stride(0), a.vs1 = v.stride(1);
  a.cb = k_cache.stride(0), a.ct = k_cache.stride(1), a.ch = k_cache.stride(2);
  a.vcb = v_cache.stride(0), a.vct = v_cache.stride(1), a.vch = v_cache.stride(2);
  a.os0 = call.out.stride(0), a.os1 = call.out.stride(1);
  a.block_tables = call.block_tables.data_ptr<int32_t>();
  a.max_blocks = call.block_tables.size(1);
  a.block_size = k_cache.size(1);
  a.num_kv_heads = KVH;
  a.group = H / KVH;
  a.scale = static_cast<float>(scale);
  const int64_t batch = ql.size(0), num_blocks = k_cache.size(0);
  int64_t start = 0, macs = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t c = cl.data_ptr<int64_t>()[b], n = ql.data_ptr<int64_t>()[b];
    check_used_blocks(a.block_tables, a.max_blocks, a.block_size, b, c, num_blocks);
    a.seqs.push_back({c, n, start});
    start += n;
    macs += n * (c + n / 2 + 1) * H * D * 2;
  }
  if (start != q.size(0)) return std::nullopt;  // the Python op checks this first
  call.parallel = macs >= one_thread_max_macs && at::get_num_threads() > 1;
  return call;
}

// One work item of a prefill call: sequence b (index into PrefillArgs::seqs), KV head h, new
// tokens [q0, q1) of it.
struct PrefillItem {
  int64_t b, h, q0, q1;
};

// The work items of the sequences `seqs` (indices into `all`, each with new tokens): (sequence,
// KV head, tile of `tq` new tokens), numbered sequence by sequence, head by head; the tiles of
// one (sequence, head) alternate from both ends (0, T-1, 1, T-2, ...) so that contiguous
// ranges hold similar causal work. `cum` is the running cost (rows x keys read, plus `pad`
// keys for the tile a row's last key falls in): threads take contiguous ranges of equal cost
// (equal_cost_bounds), not equal counts, since a chunk often holds a sequence with a long
// cached prefix beside one that starts from zero.
class PrefillItems {
 public:
  PrefillItems(const std::vector<PrefillSeq>& all, std::vector<int64_t> seqs, int64_t heads, int64_t tq,
               int64_t pad)
      : all_(all), seqs_(std::move(seqs)), first_(seqs_.size() + 1, 0), tq_(tq) {
    for (size_t n = 0; n < seqs_.size(); ++n) first_[n + 1] = first_[n] + tiles(all_[seqs_[n]]) * heads;
    cum_.assign(first_.back() + 1, 0.0);
    for (size_t n = 0; n < seqs_.size(); ++n) {
      const PrefillSeq& s = all_[seqs_[n]];
      for (int64_t local = 0; local < first_[n + 1] - first_[n]; ++local) {
        const int64_t q0 = tile_of(local % tiles(s), tiles(s)) * tq_, q1 = std::min(s.num_new, q0 + tq_);
        const double cost = static_cast<double>(q1 - q0) * static_cast<double>(s.cached + (q0 + q1) / 2 + pad);
        cum_[first_[n] + local + 1] = cum_[first_[n] + local] + cost;
      }
    }
  }
  int64_t size() const { return first_.back(); }
  const std::vector<double>& cum() const { return cum_; }
  // Item i; `n` is the caller's cursor into seqs (-1 to start), advanced as i grows.
  PrefillItem at(int64_t i, int64_t& n) const {
    if (n < 0) n = std::upper_bound(first_.begin(), first_.end(), i) - first_.begin() - 1;
    while (i >= first_[n + 1]) ++n;
    const PrefillSeq& s = all_[seqs_[n]];
    const int64_t t = tiles(s), local = i - first_[n];
    const int64_t q0 = tile_of(local % t, t) * tq_;
    return {seqs_[n], local / t, q0, std::min(s.num_new, q0 + tq_)};
  }

 private:
  int64_t tiles(const PrefillSeq& s) const { return (s.num_new + tq_ - 1) / tq_; }
  static int64_t tile_of(int64_t u, int64_t tiles) { return u % 2 == 0 ? u / 2 : tiles - 1 - u / 2; }
  const std::vector<PrefillSeq>& all_;
  std::vector<int64_t> seqs_, first_;
  std::vector<double> cum_;
  int64_t tq_;
};

}  // namespace mops
