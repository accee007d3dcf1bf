// What the per-token layer ops (RMSNorm + fused residual add, NeoX RoPE, SiLU-and-mul) share
// across ISAs (layer_ops.cpp for AVX-512, ../csrc_avx2/layer_ops_avx2.cpp for AVX2): the Python
// entries' checks, tensor handling and dtype dispatch, and the fused decode step's row parts
// (step_parts.h). The including file defines
// `constexpr int64_t kLayerLanes` (its vector width in floats: the sizes a kernel takes are
// multiples of it) in namespace mops before including this header, and the row kernels
// declared here after it, in an unnamed namespace within mops. No intrinsics here.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"
#include "step_parts.h"

namespace mops {
namespace {

// Threads only for prefill-sized calls (a 1,024-token chunk of a 576-wide model: ~0.3 ms on one
// core): see decode_attention.cpp on the cost of a parallel region.
inline bool is_parallel(int64_t elements) { return elements >= (1 << 19) && at::get_num_threads() > 1; }

// out [rows, hidden] = rmsnorm(x (+ res)) * w; with res, res_out = round(x + res) (the residual
// stream keeps x's dtype) and the norm is of res_out. Rows contiguous.
template <typename XT, typename WT>
void rms_rows(const XT* x, const XT* res, const WT* w, XT* out, XT* res_out, int64_t rows, int64_t hidden,
              float eps);

// dst [tokens, heads, d] contiguous = src (any token / head strides, d contiguous) rotated by
// the float32 cos | sin table rows at pos; dims past `rot` pass through.
template <typename XT>
void rope_rows(const int64_t* pos, const float* cache, int64_t rot, const XT* src, int64_t s0, int64_t s1,
               XT* dst, int64_t tokens, int64_t heads, int64_t d);

// out [rows, d] = silu(x[:, :d]) * x[:, d:], x [rows, 2d] contiguous.
template <typename XT>
void silu_rows(const XT* x, XT* out, int64_t rows, int64_t d);

}  // namespace

// [out] or [out, residual_out]; nullopt when the call does not fit (hidden % kLayerLanes, dtypes).
std::optional<std::vector<at::Tensor>> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                const std::optional<at::Tensor>& residual) {
  const int64_t hidden = x.size(-1);
  if (hidden % kLayerLanes || x.numel() == 0) return std::nullopt;
  const auto xc = x.contiguous(), wc = weight.contiguous();
  const auto rc = residual ? residual->contiguous() : at::Tensor();
  auto out = at::empty_like(xc);
  auto res_out = residual ? at::empty_like(xc) : at::Tensor();
  const int64_t rows = x.numel() / hidden;
  bool done = false;
  with_float_type(x.scalar_type(), [&](auto xt) {
    using XT = decltype(xt);
    done = with_float_type(weight.scalar_type(), [&](auto wt) {
      using WT = decltype(wt);
      rms_rows<XT, WT>(xc.data_ptr<XT>(), residual ? rc.data_ptr<XT>() : nullptr, wc.data_ptr<WT>(),
                       out.data_ptr<XT>(), residual ? res_out.data_ptr<XT>() : nullptr, rows, hidden,
                       static_cast<float>(eps));
    });
  });
  if (!done) return std::nullopt;
  if (residual) return std::vector<at::Tensor>{out, res_out};
  return std::vector<at::Tensor>{out};
}

// NeoX-style rotation of new copies of q and k; nullopt when the call does not fit.
std::optional<std::vector<at::Tensor>> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& cache) {
  const int64_t rot = cache.size(1);
  if ((rot / 2) % kLayerLanes || cache.scalar_type() != at::kFloat || q.scalar_type() != k.scalar_type())
    return std::nullopt;
  const auto pos = positions.to(at::kLong).contiguous();
  const auto cc = cache.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.numel(); ++t)
    if (p[t] < 0 || p[t] >= cache.size(0))
      throw std::invalid_argument("positions[" + std::to_string(t) + "] = " + std::to_string(p[t]) +
                                  " is outside the rope cache's [0, " + std::to_string(cache.size(0)) + ")");
  // Read in place (q / k are usually strided views of one fused projection), write new
  // contiguous tensors: one pass over each.
  const auto qs = q.stride(-1) == 1 ? q : q.contiguous(), ks = k.stride(-1) == 1 ? k : k.contiguous();
  auto qo = at::empty(q.sizes(), q.options()), ko = at::empty(k.sizes(), k.options());
  const bool done = with_float_type(q.scalar_type(), [&](auto xt) {
    using XT = decltype(xt);
    rope_rows(p, cc.data_ptr<float>(), rot, qs.data_ptr<XT>(), qs.stride(0), qs.stride(1), qo.data_ptr<XT>(),
              q.size(0), q.size(1), q.size(2));
    rope_rows(p, cc.data_ptr<float>(), rot, ks.data_ptr<XT>(), ks.stride(0), ks.stride(1), ko.data_ptr<XT>(),
              k.size(0), k.size(1), k.size(2));
  });
  if (!done) return std::nullopt;
  return std::vector<at::Tensor>{qo, ko};
}

std::optional<at::Tensor> silu_and_mul(const at::Tensor& x) {
  const int64_t d = x.size(-1) / 2;
  if (d % kLayerLanes || x.numel() == 0) return std::nullopt;
  const auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, xc.options());
  const bool done = with_float_type(x.scalar_type(), [&](auto xt) {
    using XT = decltype(xt);
    silu_rows(xc.data_ptr<XT>(), out.data_ptr<XT>(), x.numel() / (2 * d), d);
  });
  if (!done) return std::nullopt;
  return out;
}

// The fused decode step's parts (step_parts.h) over the row kernels above, bf16 rows.
namespace parts {

void rms_rows_bf16(const bf16* x, const bf16* res, const bf16* w, bf16* out, bf16* res_out, int64_t rows,
                   int64_t hidden, float eps) {
  rms_rows<bf16, bf16>(x, res, w, out, res_out, rows, hidden, eps);
}

void silu_rows_bf16(const bf16* x, bf16* out, int64_t rows, int64_t d) { silu_rows<bf16>(x, out, rows, d); }

void rope_rows_bf16(const int64_t* pos, const float* cache, int64_t rot, const bf16* src, int64_t s0, int64_t s1,
                    bf16* dst, int64_t tokens, int64_t heads, int64_t d) {
  rope_rows<bf16>(pos, cache, rot, src, s0, s1, dst, tokens, heads, d);
}

}  // namespace parts
}  // namespace mops
