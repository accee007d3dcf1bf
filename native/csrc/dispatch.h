// Maps a runtime dtype to a C++ element type: calls f(T{}) for float / bf16 / fp16 (and int8
// where asked); returns false for any other dtype so the caller can decline the call.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mops {

template <typename F>
bool with_float_type(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat: f(float{}); return true;
    case at::kBFloat16: f(c10::BFloat16{}); return true;
    case at::kHalf: f(c10::Half{}); return true;
    default: return false;
  }
}

// head_dim -> number of 16-float chunks, as a compile-time constant.
template <typename F>
bool with_chunks(int64_t head_dim, F&& f) {
  switch (head_dim) {
    case 64: f(std::integral_constant<int, 4>{}); return true;
    case 128: f(std::integral_constant<int, 8>{}); return true;
    case 256: f(std::integral_constant<int, 16>{}); return true;
    default: return false;
  }
}

// Throws ValueError (std::invalid_argument) when a block the first `tokens` tokens of sequence
// b occupy lies outside the cache's num_blocks.
inline void check_used_blocks(const int32_t* block_tables, int64_t max_blocks, int64_t block_size, int64_t b,
                              int64_t tokens, int64_t num_blocks) {
  for (int64_t j = 0; j * block_size < tokens; ++j) {
    const int64_t id = block_tables[b * max_blocks + j];
    if (id < 0 || id >= num_blocks)
      throw std::invalid_argument("block_tables[" + std::to_string(b) + ", " + std::to_string(j) + "] = " +
                                  std::to_string(id) + " is used but outside the cache's " +
                                  std::to_string(num_blocks) + " blocks");
  }
}

// f(i) for every i in [0, n) over the torch threads, each thread taking the next index when it
// finishes one (a shared counter): a thread that runs slower (a busy neighbour on its core, a
// costlier task) takes fewer, where a static split would leave the other waiting at the end.
template <typename F>
void parallel_dynamic(int64_t n, F&& f) {
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  if (nt <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n; i = next.fetch_add(1, std::memory_order_relaxed))
      f(i);
  });
}

// Boundaries of nt contiguous ranges of equal cost over items [0, n), cum[i] = cost of items
// before i (n + 1 entries): range t is [out[t], out[t + 1]).
inline std::vector<int64_t> equal_cost_bounds(const std::vector<double>& cum, int64_t nt) {
  const int64_t n = static_cast<int64_t>(cum.size()) - 1;
  std::vector<int64_t> out(nt + 1, n);
  out[0] = 0;
  for (int64_t t = 1; t < nt; ++t)
    out[t] = std::lower_bound(cum.begin(), cum.end(), cum.back() * static_cast<double>(t) / static_cast<double>(nt)) - cum.begin();
  return out;
}

// Whether this CPU has AVX512_BF16 (the bf16 attention and matmul kernels' per-function target).
inline bool cpu_has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}

}  // namespace mops
