// What the paged decode attention kernels share across ISAs (decode_attention.cpp for AVX-512,
// decode_attention_avx2.cpp for AVX2): the call's arguments as raw pointers and strides, and
// the checks of every value a kernel dereferences. No intrinsics here.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "dispatch.h"

namespace mops {

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

struct Extent {
  int64_t total_tokens, max_blocks;  // over the batch
};

// Checks every value the kernel will dereference; returns the batch's extent (for the split).
inline Extent check_tables(const DecodeArgs& a, int64_t num_blocks) {
  Extent e{0, 0};
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t ctx = a.context_lens[b];
    if (ctx < 0 || ctx > a.max_blocks * a.block_size)
      throw std::invalid_argument("context_lens[" + std::to_string(b) + "] = " + std::to_string(ctx) +
                                  " does not fit block_tables' " + std::to_string(a.max_blocks) + " blocks x " +
                                  std::to_string(a.block_size) + " tokens; lengths must be >= 0 and fit the table");
    check_used_blocks(a.block_tables, a.max_blocks, a.block_size, b, ctx, num_blocks);
    e.total_tokens += ctx;
    e.max_blocks = std::max(e.max_blocks, (ctx + a.block_size - 1) / a.block_size);
  }
  return e;
}

inline CacheView view_of(const at::Tensor& c, const std::optional<at::Tensor>& s) {
  CacheView v{c.data_ptr(), c.stride(0), c.stride(1), c.stride(2), nullptr, 0, 0, 0};
  if (s) {
    v.scale = s->data_ptr<float>();
    v.ssb = s->stride(0);
    v.sst = s->stride(1);
    v.ssh = s->stride(2);
  }
  return v;
}

// The entry point each build defines (decode_attention.cpp, decode_attention_avx2.cpp): nullopt
// when the call does not fit the kernel (the caller then runs the reference); lse_buffer:
// optional contiguous float32 [batch, num_heads] for each row's log-sum-exp.
std::optional<at::Tensor> paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                 const at::Tensor& context_lens, double scale,
                                                 const std::optional<at::Tensor>& k_scale,
                                                 const std::optional<at::Tensor>& v_scale,
                                                 const std::optional<at::Tensor>& out_buffer,
                                                 const std::optional<at::Tensor>& lse_buffer);

// One checked call: the tensors it reads (kept alive here) and their raw view.
struct DecodeCall {
  at::Tensor bt, cl, qc, out;
  DecodeArgs a;
  Extent e;
  float* lse;     // optional [batch, num_heads] log-sum-exp output
  bool parallel;  // worth a parallel region
};

// nullopt when the call does not fit the kernels (head_dim not contiguous, K and V strides
// that differ, an LSE buffer that is not contiguous float32 of [batch, num_heads]); throws
// std::invalid_argument for a bad context length or block id.
inline std::optional<DecodeCall> prepare_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                const at::Tensor& context_lens, double scale,
                                                const std::optional<at::Tensor>& k_scale,
                                                const std::optional<at::Tensor>& v_scale,
                                                const std::optional<at::Tensor>& out_buffer,
                                                const std::optional<at::Tensor>& lse_buffer) {
  if (k_cache.stride(3) != 1 || v_cache.stride(3) != 1 || k_cache.strides() != v_cache.strides())
    return std::nullopt;
  if (lse_buffer && (lse_buffer->scalar_type() != at::kFloat || !lse_buffer->is_contiguous() ||
                     lse_buffer->numel() != q.size(0) * q.size(1)))
    return std::nullopt;
  DecodeCall c;
  c.lse = lse_buffer ? lse_buffer->data_ptr<float>() : nullptr;
  c.bt = block_tables.to(at::kInt).contiguous();
  c.cl = context_lens.to(at::kInt).contiguous();
  c.qc = q.contiguous();
  const int64_t num_kv_heads = k_cache.size(2);
  c.a = DecodeArgs{q.size(0), num_kv_heads, q.size(1) / num_kv_heads, c.bt.size(1), k_cache.size(1),
                   static_cast<float>(scale), c.bt.data_ptr<int32_t>(), c.cl.data_ptr<int32_t>(),
                   view_of(k_cache, k_scale), view_of(v_cache, v_scale)};
  c.e = check_tables(c.a, k_cache.size(0));
  c.out = out_buffer ? *out_buffer : at::empty_like(c.qc);  // caller checked shape, contiguity
  // A parallel region costs ~10 us on an idle machine but a whole scheduler slice (~8 ms,
  // measured) when the other cores are busy; only calls of >= ~2M multiply-adds (~150 us on
  // one core) are worth that risk.
  c.parallel = c.e.total_tokens * q.size(1) * q.size(2) >= (1 << 21) && at::get_num_threads() > 1;
  return c;
}

}  // namespace mops
