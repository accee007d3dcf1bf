// Maps a runtime dtype to a C++ element type: calls f(T{}) for float / bf16 / fp16 (and int8
// where asked); returns false for any other dtype so the caller can decline the call.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

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

}  // namespace mops
