// What the KV cache write (reshape-and-cache, optional int8 quantisation) shares across ISAs
// (kv_write.cpp for AVX-512, ../csrc_avx2/kv_write_avx2.cpp for AVX2): the entry's checks,
// slot arithmetic and copies. The including file defines `constexpr int64_t kKvLanes` (its
// vector width in floats: head_dim must be a multiple of it) in namespace mops before including
// this header, and `quantize_row` (declared here) after it, in an unnamed namespace within mops.
//
//   slot = slot_mapping[t]  (< 0: skip)     block = slot / block_size, row = slot % block_size
//   cache[block, row, h, :] = src[t, h, :]                     same dtype: a copy
//   int8:  absmax = max|x|, q = rint(x * (127 / absmax)), scale[block, row, h] = absmax / 127
//
// The int8 arithmetic is the float32 sequence of mooncake_ops.quant.quantize_int8, so every
// path stores identical bytes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include "dispatch.h"

namespace mops {
namespace {

// q[0 .. d) = the row quantised as above, *scale = its absmax / 127.
template <typename ST>
void quantize_row(const ST* x, int64_t d, int8_t* q, float* scale);

struct Target {
  void* data;
  int64_t sb, st, sh;
  float* scale;
  int64_t ssb, sst, ssh;
};

Target target_of(const at::Tensor& c, const std::optional<at::Tensor>& s) {
  Target t{c.data_ptr(), c.stride(0), c.stride(1), c.stride(2), nullptr, 0, 0, 0};
  if (s) t = Target{t.data, t.sb, t.st, t.sh, s->data_ptr<float>(), s->stride(0), s->stride(1), s->stride(2)};
  return t;
}

template <typename ST>
void write_one(const ST* src, int64_t num_tokens, int64_t heads, int64_t d, const int64_t* slots,
               int64_t block_size, const Target& t, bool parallel) {
  at::parallel_for(0, num_tokens, parallel ? 1 : num_tokens, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      if (slots[i] < 0) continue;
      const int64_t blk = slots[i] / block_size, row = slots[i] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const ST* x = src + (i * heads + h) * d;
        if (t.scale == nullptr) {
          std::memcpy(static_cast<ST*>(t.data) + blk * t.sb + row * t.st + h * t.sh, x, d * sizeof(ST));
        } else {
          quantize_row(x, d, static_cast<int8_t*>(t.data) + blk * t.sb + row * t.st + h * t.sh,
                       t.scale + blk * t.ssb + row * t.sst + h * t.ssh);
        }
      }
    }
  });
}

void check_slots(const int64_t* slots, int64_t n, int64_t num_slots) {
  for (int64_t i = 0; i < n; ++i)
    if (slots[i] >= num_slots)
      throw std::invalid_argument("slot_mapping[" + std::to_string(i) + "] = " + std::to_string(slots[i]) +
                                  " but the cache has only " + std::to_string(num_slots) +
                                  " slots (num_blocks x block_size)");
}

}  // namespace

// Returns false when the call does not fit the kernel (the caller then runs the reference).
bool write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& slot_mapping,
              const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const int64_t d = key.size(2);
  if (d % kKvLanes || k_cache.stride(3) != 1 || v_cache.stride(3) != 1) return false;
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t n = key.size(0), heads = key.size(1), block_size = k_cache.size(1);
  check_slots(slots.data_ptr<int64_t>(), n, k_cache.size(0) * block_size);
  const bool parallel = n * heads * d >= (1 << 20) && at::get_num_threads() > 1;
  const auto kc = key.contiguous(), vc = value.contiguous();
  return with_float_type(key.scalar_type(), [&](auto st) {
    using ST = decltype(st);
    write_one(kc.data_ptr<ST>(), n, heads, d, slots.data_ptr<int64_t>(), block_size, target_of(k_cache, k_scale), parallel);
    write_one(vc.data_ptr<ST>(), n, heads, d, slots.data_ptr<int64_t>(), block_size, target_of(v_cache, v_scale), parallel);
  });
}

}  // namespace mops
