// Per-token layer ops in one pass each: RMSNorm (+ fused residual add), NeoX RoPE, SiLU-and-mul.
// All compute in fp32 and round once to the input dtype. Rows are contiguous [rows, hidden].
#include <ATen/Parallel.h>
#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"
#include "vec.h"

namespace mops {
namespace {

// Threads only for prefill-sized calls (a 1,024-token chunk of a 576-wide model: ~0.3 ms on one
// core): see decode_attention.cpp on the cost of a parallel region.
bool is_parallel(int64_t elements) { return elements >= (1 << 19) && at::get_num_threads() > 1; }

template <typename XT, typename WT>
void rms_rows(const XT* x, const XT* res, const WT* w, XT* out, XT* res_out, int64_t rows,
              int64_t hidden, float eps) {
  at::parallel_for(0, rows, is_parallel(rows * hidden) ? 1 : rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const XT* xr = x + r * hidden;
      if (res != nullptr) {  // h = round(x + residual): the residual stream keeps x's dtype
        for (int64_t c = 0; c < hidden; c += 16)
          store16(res_out + r * hidden + c, _mm512_add_ps(load16(xr + c), load16(res + r * hidden + c)));
        xr = res_out + r * hidden;
      }
      __m512 ss = _mm512_setzero_ps();
      for (int64_t c = 0; c < hidden; c += 16) {
        const __m512 v = load16(xr + c);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const __m512 rstd = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / hidden + eps));
      for (int64_t c = 0; c < hidden; c += 16)
        store16(out + r * hidden + c, _mm512_mul_ps(_mm512_mul_ps(load16(xr + c), rstd), load16(w + c)));
    }
  });
}

// dst [tokens, heads, d] contiguous = src (any token / head strides, d contiguous) rotated.
template <typename XT>
void rope_rows(const int64_t* pos, const float* cache, int64_t rot, const XT* src, int64_t s0, int64_t s1,
               XT* dst, int64_t tokens, int64_t heads, int64_t d) {
  const int64_t half = rot / 2;
  at::parallel_for(0, tokens, is_parallel(tokens * heads * d) ? 1 : tokens, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* cs = cache + pos[t] * rot;
      for (int64_t h = 0; h < heads; ++h) {
        const XT* xh = src + t * s0 + h * s1;
        XT* oh = dst + (t * heads + h) * d;
        for (int64_t i = 0; i < half; i += 16) {
          const __m512 c = _mm512_loadu_ps(cs + i), s = _mm512_loadu_ps(cs + half + i);
          const __m512 x1 = load16(xh + i), x2 = load16(xh + half + i);
          store16(oh + i, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)));
          store16(oh + half + i, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)));
        }
        for (int64_t i = rot; i < d; ++i) oh[i] = xh[i];  // partial rotary: the rest passes through
      }
    }
  });
}

template <typename XT>
void silu_rows(const XT* x, XT* out, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, is_parallel(rows * d) ? 1 : rows, [&](int64_t r0, int64_t r1) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < d; c += 16) {
        const __m512 a = load16(x + r * 2 * d + c), b = load16(x + r * 2 * d + d + c);
        const __m512 silu = _mm512_div_ps(a, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
        store16(out + r * d + c, _mm512_mul_ps(silu, b));
      }
  });
}

}  // namespace

// [out] or [out, residual_out]; nullopt when the call does not fit (hidden % 16, dtypes).
std::optional<std::vector<at::Tensor>> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                const std::optional<at::Tensor>& residual) {
  const int64_t hidden = x.size(-1);
  if (hidden % 16 || x.numel() == 0) return std::nullopt;
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
  if ((rot / 2) % 16 || cache.scalar_type() != at::kFloat || q.scalar_type() != k.scalar_type())
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
  if (d % 16 || x.numel() == 0) return std::nullopt;
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

}  // namespace mops
