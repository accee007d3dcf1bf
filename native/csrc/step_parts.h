// Parts of the kernels for a caller that runs its own threads (decode_step.h): each computes
// exactly what its op's entry computes for the same part of the output, with no parallel region
// of its own, so a fused step is bit-equal to the ops it chains. Both builds define them for
// their ISA (the AVX2 ones in ../csrc_avx2/), except bf16_linear_blocks (AVX-512 only: packed
// bf16 needs AVX512_BF16) and dense_linear_rows (AVX2 only).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace mops::parts {

using bf16 = c10::BFloat16;

// Output blocks [b0, b1) of 16 columns of bf16_linear (y = x @ w^T + bias, y [M, N]) over
// bf16_pack_weight's layout, rows [0, M); silu: of bf16_gate_up_silu (y [M, N / 2]; b0 and b1
// even: whole (gate, up) block pairs, whose silu(gate) * up lands in y's columns [8 b0, 8 b1)).
void bf16_linear_blocks(const bf16* x, int64_t ldx, const uint32_t* wp, const bf16* bias, bf16* y, int64_t N,
                        int64_t K2, int64_t M, int64_t b0, int64_t b1, bool silu);

// Output rows [n0, n1) (n0 a multiple of 4) of the AVX2 build's dense_linear over bf16 x [M, K]
// (M <= 2: the rows its entry computes by dot products) and a dense bf16 weight [N, K]; y [M, N]
// (+= bias).
void dense_linear_rows(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t M, int64_t N, int64_t K,
                       int64_t n0, int64_t n1);

// rms_norm's rows (layer_ops.cpp): out = rmsnorm(x (+ res)) * w; with res, res_out = round(x + res)
// (res_out may be res: updated in place). Rows contiguous, hidden a multiple of 16.
void rms_rows_bf16(const bf16* x, const bf16* res, const bf16* w, bf16* out, bf16* res_out, int64_t rows,
                   int64_t hidden, float eps);

// rotary_embedding's rows: dst [tokens, heads, d] contiguous = src rotated (NeoX) by the
// float32 cos | sin rows at pos; src rows at token stride s0, head stride s1.
void rope_rows_bf16(const int64_t* pos, const float* cache, int64_t rot, const bf16* src, int64_t s0, int64_t s1,
                    bf16* dst, int64_t tokens, int64_t heads, int64_t d);

// silu_and_mul's rows: out [rows, d] = silu(x[:, :d]) * x[:, d:], x [rows, 2d] contiguous.
void silu_rows_bf16(const bf16* x, bf16* out, int64_t rows, int64_t d);

// Output rows [n0, n1) of gguf_linear over bf16 x [M, K] (y [M, N] += bias): for a grouped
// weight n0 and n1 are multiples of 16, for the rows layout of 4 (or N).
void gguf_linear_rows(int64_t type, bool grouped, const bf16* x, const uint8_t* w, const bf16* bias, bf16* y,
                      int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1);

// Output rows [n0, n1) (n0 a multiple of 4) of int8_linear (linear_int8.cpp) over bf16 x
// [M, K] and an int8 weight as pack_int8_weight lays it out ([N, K + 4]); y [M, N] (+= bias).
void int8_linear_rows(const bf16* x, const int8_t* w, const bf16* bias, bf16* y, int64_t M, int64_t N, int64_t K,
                      int64_t n0, int64_t n1);

// Items [i0, i1) of paged decode attention's bf16 kernel (decode_bf16: item = sequence
// i / kv_heads, KV head i % kv_heads with its `group` query heads): q and out [batch, heads, d]
// contiguous; caches bf16 [blocks, block_size, kv_heads, d] at strides sb / st / sh; tables and
// lengths checked by the caller; max_ctx >= every context length of the items. False: d is not
// 64 / 128 / 256 or group > 16.
bool decode_bf16_items(const bf16* q, bf16* out, const bf16* k_cache, const bf16* v_cache, int64_t block_size,
                       int64_t sb, int64_t st, int64_t sh, int64_t kv_heads, int64_t group, int64_t d,
                       const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens,
                       int64_t max_ctx, float scale, int64_t i0, int64_t i1);

}  // namespace mops::parts
