// Attention on CPU for bf16 queries over a bf16 paged cache through AVX512_BF16 dot products
// (vdpbf16ps: 32 bf16 products summed into 16 fp32 lanes per instruction), checked at run
// time: causal prefill (below; the cache bf16 or int8, whose rows are dequantised to bf16 as
// keys are laid out) and decode (`decode_bf16`, at the end; bf16 cache). Other dtypes and CPUs
// without AVX512_BF16 are declined (the callers run their other paths).
//
// Prefill. Sequence s has c cached tokens (in the paged cache) and n new ones (packed in q / k / v);
// new token i attends to keys 0 .. c + i. Work item = (sequence, KV head, tile of TQ new
// tokens); its rows are the tile's tokens x the G query heads sharing the KV head (GQA).
// Per item, keys are re-laid-out once per thread and (sequence, KV head), in tiles of KT = 64
// (16 x 16 pair transposes for K):
//
//   Kp[tile][p][j] = (k_j[2p], k_j[2p+1])     one 32-bit pair per key j: RB rows' scores for 64
//                                             keys are 4 x RB vdpbf16ps per pair p, q's pair
//                                             broadcast (the bf16 matmul's micro-tile shape)
//   Vp[u][c][l] = (v_2u[16c+l], v_2u+1[16c+l])   key pair u, output lanes 16c..16c+15:
//                                             out += (p_2u, p_2u+1) broadcast . Vp[u][c]
//
// RB = 4 rows at a time then take three passes over their keys (up to the last one any of them
// sees, the last 64-key tile as a half tile when 32 keys cover it): the scores, in fp32, and
// each row's max over the keys it sees (causal mask); per row p = exp(scale (s - max)) over
// those keys, rounded to bf16 for the P.V products, and l = sum(p) in fp32; then out = P.V / l
// with fp32 accumulation, 4 x RB accumulators per 64 output lanes. The exact max needs no
// rescaling, and keeps both dot-product passes at the matmul's register tile; the scores of RB
// rows (4 x keys floats) stay in L1 for the softmax at prompt lengths of a few thousand.
//
// A sequence with one new token in a prefill batch (a decode riding along with prefill chunks)
// takes the decode routine instead, reading its context in place; threads split those and
// the other items separately, each by its own cost.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"
#include "prefill_args.h"
#include "step_parts.h"
#include "vec.h"

#define MOPS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace mops {
namespace {

constexpr int64_t KT = 64;  // keys per tile (4 registers of scores)
constexpr int RB = 4;      // query rows per block
constexpr int64_t TQ = 32;  // new tokens per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Fewer multiply-adds run on the calling thread (see mooncake_ops.linear.ONE_THREAD_MAX_MACS).
constexpr int64_t kOneThreadMaxMacs = int64_t{1} << 21;

using bf16 = c10::BFloat16;

using Seq = PrefillSeq;
using Args = PrefillArgs<bf16>;

// Key or value row j of sequence b, KV head h as bf16: cached tokens from the pool (int8 rows
// dequantised into `tmp`), new ones from k / v in place.
template <int NC>
inline const bf16* key_row(const Args& a, const Seq& s, int64_t b, int64_t h, int64_t j, bool value,
                           bf16* tmp) {
  if (j >= s.cached) {
    const int64_t r = s.start + j - s.cached;
    return value ? a.v + r * a.vs0 + h * a.vs1 : a.k + r * a.ks0 + h * a.ks1;
  }
  const int64_t blk = a.block_tables[b * a.max_blocks + j / a.block_size], t = j % a.block_size;
  const int64_t off = value ? blk * a.vcb + t * a.vct + h * a.vch : blk * a.cb + t * a.ct + h * a.ch;
  const void* base = value ? a.vc : a.kc;
  if (a.ks == nullptr) return static_cast<const bf16*>(base) + off;
  const int8_t* row = static_cast<const int8_t*>(base) + off;
  const float scale = value ? a.vs[blk * a.vssb + t * a.vsst + h * a.vssh] : a.ks[blk * a.kssb + t * a.ksst + h * a.kssh];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int c = 0; c < NC; ++c) store16(tmp + 16 * c, _mm512_mul_ps(load16(row + 16 * c), vscale));
  return tmp;
}

// Packs key tiles [t0, t1) of (b, h) into kp / vp (layouts in the file comment); keys at or
// past `total` are zeros (their scores are masked; zero values keep 0 * v finite).
template <int NC>
void pack_tiles(const Args& a, const Seq& s, int64_t b, int64_t h, int64_t total, int64_t t0,
                int64_t t1, uint32_t* kp, uint32_t* vp) {
  constexpr int64_t D = 16 * NC, P = D / 2;
  for (int64_t t = t0; t < t1; ++t) {
    uint32_t* kt = kp + t * P * KT;
    uint32_t* vt = vp + t * KT * D / 2;
    for (int64_t j0 = 0; j0 < KT; j0 += 16) {  // 16 keys at a time: 16 x 16 pair transposes
      alignas(64) bf16 tmp[16][D];
      const uint32_t* rows[16];
      for (int64_t jj = 0; jj < 16; ++jj) {
        const int64_t j = t * KT + j0 + jj;
        rows[jj] = j < total ? reinterpret_cast<const uint32_t*>(key_row<NC>(a, s, b, h, j, false, tmp[jj])) : nullptr;
      }
      for (int64_t p0 = 0; p0 < P; p0 += 16) {
        __m512i m[16];
        for (int jj = 0; jj < 16; ++jj) m[jj] = rows[jj] ? _mm512_loadu_si512(rows[jj] + p0) : _mm512_setzero_si512();
        transpose16x16(m);
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kt + (p0 + p) * KT + j0, m[p]);
      }
    }
    for (int64_t u = 0; u < KT / 2; ++u) {
      const int64_t j = t * KT + 2 * u;
      bf16 tmp0[D], tmp1[D];
      const bf16* r0 = j < total ? key_row<NC>(a, s, b, h, j, true, tmp0) : nullptr;
      const bf16* r1 = j + 1 < total ? key_row<NC>(a, s, b, h, j + 1, true, tmp1) : nullptr;
      for (int c = 0; c < NC; ++c) {
        const __m512i lo = r0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 16 * c)))
                              : _mm512_setzero_si512();
        const __m512i hi = r1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 16 * c)))
                              : _mm512_setzero_si512();
        _mm512_storeu_si512(vt + (u * NC + c) * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  }
}

// exp(x) for x <= 0 (scores minus their row's max, scaled), rounded to bf16 for P.V: the
// Cody-Waite reduction of exp16 with a degree-4 Taylor polynomial (relative error < 5e-5,
// far below bf16's 2^-9); x below -104 gives 0.
inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24), f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Scores of RB query rows (q_rows: their bf16 pairs) against the W x 16 keys of one packed
// tile from key j0: sc[r][j0 + j] = q_r . k_j, unscaled (rows ld floats apart); vmax[r] takes
// the max of the row's visible ones (keys <= last[r]). Per pair p: W key registers, RB
// broadcasts, W x RB vdpbf16ps (the bf16 matmul's micro-tile shape for W = 4).
template <int NC, int W>
MOPS_BF16_TARGET inline void score_tile(const uint32_t* const* q_rows, const int64_t* last, int64_t j0,
                                        const uint32_t* kt, float* sc, int64_t ld, __m512* vmax) {
  constexpr int64_t P = 8 * NC;
  __m512 s[RB][W];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < W; ++c) s[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512bh kv[W];
    for (int c = 0; c < W; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kt + p * KT + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_rows[r][p]));
      for (int c = 0; c < W; ++c) s[r][c] = _mm512_dpbf16_ps(s[r][c], qb, kv[c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < W; ++c) {
      _mm512_storeu_ps(sc + r * ld + j0 + 16 * c, s[r][c]);
      const int64_t visible = last[r] + 1 - j0 - 16 * c;  // keys of this register the row sees
      if (visible >= 16) vmax[r] = _mm512_max_ps(vmax[r], s[r][c]);
      else if (visible > 0) vmax[r] = _mm512_mask_max_ps(vmax[r], tail_mask(visible), vmax[r], s[r][c]);
    }
}

// Scores of RB rows over keys [0, max(last) + 1) in 64-key tiles (a last one of <= 32 keys
// as a half tile); row_max[r] = the max of row r's visible scores.
template <int NC>
MOPS_BF16_TARGET void scores(const uint32_t* const* q_rows, const int64_t* last, int64_t max_last,
                             const uint32_t* kp, float* sc, int64_t ld, float* row_max) {
  constexpr int64_t P = 8 * NC;
  __m512 vmax[RB];
  for (int r = 0; r < RB; ++r) vmax[r] = _mm512_set1_ps(kNegInf);
  const int64_t n = max_last + 1;
  for (int64_t t = 0; t * KT < n; ++t) {
    if (n - t * KT > KT / 2) score_tile<NC, 4>(q_rows, last, t * KT, kp + t * P * KT, sc, ld, vmax);
    else score_tile<NC, 2>(q_rows, last, t * KT, kp + t * P * KT, sc, ld, vmax);
  }
  for (int r = 0; r < RB; ++r) row_max[r] = _mm512_reduce_max_ps(vmax[r]);
}

// One row's softmax over its n visible scores (their max: max): p_j = exp(scale (s_j - max))
// rounded to bf16 into pb[0, n), zeros in [n, n_pad) (n_pad a multiple of 32); returns
// sum_j p_j (fp32, before rounding: >= 1, the max adds exp(0)).
MOPS_BF16_TARGET inline float softmax_row(const float* s, int64_t n, int64_t n_pad, float max, float scale,
                                          uint16_t* pb) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 vm = _mm512_set1_ps(max * scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n_pad; j += 32) {
    __m512 p0 = _mm512_setzero_ps(), p1 = _mm512_setzero_ps();
    if (j < n) p0 = _mm512_maskz_mov_ps(tail_mask(n - j), exp16_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vscale, vm)));
    if (j + 16 < n) p1 = _mm512_maskz_mov_ps(tail_mask(n - j - 16), exp16_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + j + 16), vscale, vm)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    _mm512_storeu_si512(pb + j, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
  return _mm512_reduce_add_ps(sum);
}

// acc_out[r][0, D) = sum over key pairs u < npairs of (p_r,2u, p_r,2u+1) . (v_2u, v_2u+1):
// RB rows x 4 output registers at a time (D / 64 groups), value pairs from the packed tiles.
template <int NC>
MOPS_BF16_TARGET void weighted_values(const uint32_t* const* p_rows, int64_t npairs, const uint32_t* vp,
                                      float* acc_out) {
  constexpr int64_t D = 16 * NC;
  for (int g = 0; g < NC; g += 4) {
    __m512 acc[RB][4];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t u = 0; u < npairs; ++u) {
      __m512bh vv[4];
      for (int c = 0; c < 4; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + (u * NC + g + c) * 16);
      for (int r = 0; r < RB; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(p_rows[r][u]));
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc_out + r * D + 16 * (g + c), acc[r][c]);
  }
}

template <int NC>
constexpr int rows_per_block() {
  return NC <= 4 ? 4 : NC <= 8 ? 2 : 1;  // accumulators RB x NC, scores RB x 2: within 32 registers
}

// out[j] = offset of token j's row (before the head) in a paged cache, for j < n, through one
// sequence's block table row; blocks of block_size tokens at stride sb, tokens at stride st.
inline void row_offsets(const int32_t* table, int64_t n, int64_t block_size, int64_t sb, int64_t st,
                        int64_t* out) {
  for (int64_t j0 = 0, col = 0; j0 < n; j0 += block_size, ++col) {
    const int64_t base = table[col] * sb;
    for (int64_t t = 0; t < std::min(block_size, n - j0); ++t) out[j0 + t] = base + t * st;
  }
}

// One query token of G heads (q [G][D], out [G][D], both contiguous) over ctx cached keys
// whose rows start at kbase + rows[t] / vbase + rows[t]: the decode kernel (see "decode" at
// the end of the file), also used by the prefill for a sequence with one new token.
template <int NC, typename OnTile>
MOPS_BF16_TARGET void decode_item(const bf16* q, const bf16* kbase, const bf16* vbase, const int64_t* rows,
                                  int64_t ctx, int64_t G, float scale, float* sc, uint16_t* pb, bf16* out,
                                  OnTile&& on_tile, const bf16* k_last = nullptr, const bf16* v_last = nullptr) {
  constexpr int64_t D = 16 * NC, NZ = D / 32;  // a bf16 row is NZ registers
  constexpr int GB = rows_per_block<NC>();
  const int64_t ctx32 = (ctx + 31) / 32 * 32;
  // token t's key / value row; k_last / v_last, when given, hold the last token's (rows[ctx - 1] unused)
  auto krow = [&](int64_t t) { return k_last != nullptr && t == ctx - 1 ? k_last : kbase + rows[t]; };
  auto vrow = [&](int64_t t) { return v_last != nullptr && t == ctx - 1 ? v_last : vbase + rows[t]; };
  for (int64_t g = 0; g < G; ++g) {
    __m512bh qv[NZ];
    for (int64_t z = 0; z < NZ; ++z) qv[z] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * z);
    float* sg = sc + g * ctx32;
    for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
      on_tile();
      if (g == 0)  // rows are scattered over blocks: ask for the next keys and these values early
        for (int64_t t = t0; t < std::min(ctx, t0 + 16); ++t)
          for (int64_t z = 0; z < NZ; ++z) {
            if (t + 16 < ctx) _mm_prefetch(reinterpret_cast<const char*>(krow(t + 16) + 32 * z), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(vrow(t) + 32 * z), _MM_HINT_T1);
          }
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) {
        acc[t] = _mm512_setzero_ps();
        if (t0 + t < ctx) {
          const bf16* kr = krow(t0 + t);
          for (int64_t z = 0; z < NZ; ++z) acc[t] = _mm512_dpbf16_ps(acc[t], qv[z], (__m512bh)_mm512_loadu_si512(kr + 32 * z));
        }
      }
      _mm512_storeu_ps(sg + t0, _mm512_mul_ps(sum16x16(acc), _mm512_set1_ps(scale)));
    }
  }
  float l[16];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = sc + g * ctx32;
    __m512 vmax = _mm512_set1_ps(kNegInf);
    for (int64_t t = 0; t < ctx; t += 16)
      vmax = _mm512_mask_max_ps(vmax, tail_mask(ctx - t), vmax, _mm512_maskz_loadu_ps(tail_mask(ctx - t), sg + t));
    const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < ctx32; t += 32) {
      const __m512 p0 = _mm512_maskz_mov_ps(tail_mask(ctx - t), exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), vm)));
      const __m512 p1 = ctx > t + 16 ? _mm512_maskz_mov_ps(tail_mask(ctx - t - 16), exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t + 16), vm)))
                                     : _mm512_setzero_ps();
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_storeu_si512(pb + g * ctx32 + t, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    l[g] = _mm512_reduce_add_ps(sum);  // >= 1: the max key adds exp(0); G <= 16 (the caller)
  }
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int64_t gn = std::min<int64_t>(GB, G - g0);
    __m512 acc[GB][NC];
    for (int r = 0; r < GB; ++r)
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t u = 0; u < (ctx + 1) / 2; ++u) {
      const bf16* r0 = vrow(2 * u);
      const bf16* r1 = 2 * u + 1 < ctx ? vrow(2 * u + 1) : nullptr;
      __m512bh vv[NC];
      for (int c = 0; c < NC; ++c) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 16 * c)));
        const __m512i hi = r1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 16 * c)))
                              : _mm512_setzero_si512();
        vv[c] = (__m512bh)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
      }
      for (int r = 0; r < GB; ++r) {
        if (r >= gn) break;
        uint32_t pair;
        std::memcpy(&pair, pb + (g0 + r) * ctx32 + 2 * u, sizeof(pair));
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pp, vv[c]);
      }
    }
    for (int64_t r = 0; r < gn; ++r) {
      const __m512 inv = _mm512_set1_ps(1.0f / l[g0 + r]);
      for (int c = 0; c < NC; ++c) store16(out + (g0 + r) * D + 16 * c, _mm512_mul_ps(acc[r][c], inv));
    }
  }
}

// A sequence the decode routine reads: its G x KVH query rows q (heads contiguous), out likewise,
// its block-table row and context length; k_last / v_last, when set, hold the last token's K/V
// (KV head h at + h * DecodeCache::k_last_sh / v_last_sh); the table covers the tokens before it.
struct DecodeSeq {
  const bf16* q;
  bf16* out;
  const int32_t* table;
  int64_t ctx;
  const bf16 *k_last, *v_last;
};

struct DecodeCache {
  const bf16 *k, *v;                    // bf16 caches, K and V laid out alike
  int64_t block_size, sb, st, sh;       // block / token / head strides
  int64_t kv_heads, group, k_last_sh, v_last_sh;  // head strides of k_last / v_last
};

// Items [i0, i1) of (sequence n = i / KVH, KV head h = i % KVH), n through seq_at(n): the
// decode kernel over each. The next sequence's key and value rows (all KV heads: bytes
// [0, span) of each token's row) go to L2 a few rows per key tile while this sequence
// computes: blocks are scattered, so neither the hardware prefetcher nor a burst at the
// item's start keeps DRAM busy (cold pools, batch 32 x ~160 tokens: 0.35-0.37 -> 0.19-0.23 ms
// per call).
template <int NC, typename SeqAt>
void decode_range(int64_t i0, int64_t i1, const DecodeCache& c, float scale, int64_t max_ctx, SeqAt&& seq_at) {
  constexpr int64_t D = 16 * NC;
  const int64_t KVH = c.kv_heads, G = c.group, ctx32 = (max_ctx + 31) / 32 * 32;
  std::vector<int64_t> rows(ctx32), ahead(ctx32);
  std::vector<float> sc(G * ctx32);
  std::vector<uint16_t> pb(G * ctx32);
  const int64_t span = ((KVH - 1) * c.sh + D) * 2;
  int64_t ahead_n = 0, ahead_done = 0, ahead_per_tile = 0;
  auto on_tile = [&] {
    for (int64_t k = 0; k < ahead_per_tile && ahead_done < ahead_n; ++k, ++ahead_done) {
      const char* kr = reinterpret_cast<const char*>(c.k + ahead[ahead_done]);
      const char* vr = reinterpret_cast<const char*>(c.v + ahead[ahead_done]);
      for (int64_t z = 0; z < span; z += 64) {
        _mm_prefetch(kr + z, _MM_HINT_T1);
        _mm_prefetch(vr + z, _MM_HINT_T1);
      }
    }
  };
  // tokens whose rows the table gives (the last one's comes from k_last when set)
  auto in_table = [](const DecodeSeq& d) { return d.k_last != nullptr ? d.ctx - 1 : d.ctx; };
  int64_t cur = -1;
  DecodeSeq d{};
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t n = i / KVH, h = i % KVH;
    if (n != cur) {  // the sequence's row offsets, shared by its heads; the next one's ahead
      d = seq_at(n);
      row_offsets(d.table, in_table(d), c.block_size, c.sb, c.st, rows.data());
      cur = n;
      ahead_n = ahead_done = 0;
      if (n + 1 <= (i1 - 1) / KVH) {  // the next sequence is this thread's too
        const DecodeSeq next = seq_at(n + 1);
        ahead_n = in_table(next);
        row_offsets(next.table, ahead_n, c.block_size, c.sb, c.st, ahead.data());
        const int64_t tiles = std::max<int64_t>(1, std::min(KVH - h, i1 - i) * G * ((d.ctx + 15) / 16));  // on_tile calls left
        ahead_per_tile = (ahead_n + tiles - 1) / tiles;
      }
    }
    bf16* o = d.out + h * G * D;
    if (d.ctx == 0) {
      std::fill(o, o + G * D, bf16(0.0f));
      continue;
    }
    const int64_t off = h * c.sh;
    decode_item<NC>(d.q + h * G * D, c.k + off, c.v + off, rows.data(), d.ctx, G, scale, sc.data(), pb.data(), o,
                    on_tile, d.k_last != nullptr ? d.k_last + h * c.k_last_sh : nullptr,
                    d.v_last != nullptr ? d.v_last + h * c.v_last_sh : nullptr);
  }
}

template <int NC>
void run(const Args& a, bool parallel) {
  constexpr int64_t D = 16 * NC, P = D / 2;
  const int64_t G = a.group, H = a.num_kv_heads;
  // A sequence with one new token (a decode in a mixed batch, a "rider") reads its cached keys
  // in place through the decode routine (its own K/V from k / v) instead of re-laying its whole
  // context out for one query row: for a bf16 cache with K and V laid out alike, heads
  // contiguous. Riders and the other sequences' items are split among the threads separately:
  // a rider's cost is memory, not arithmetic, and one cost scale for both unbalances them.
  const bool by_rows = a.ks == nullptr && a.cb == a.vcb && a.ct == a.vct && a.qs1 == D && a.os1 == D && G <= 16;
  std::vector<int64_t> riders, seqs;  // indices into a.seqs
  int64_t max_keys = 0, max_rider_ctx = 0;
  for (size_t b = 0; b < a.seqs.size(); ++b) {
    const Seq& s = a.seqs[b];
    if (by_rows && s.num_new == 1) {
      riders.push_back(b);
      max_rider_ctx = std::max(max_rider_ctx, s.cached + 1);
    } else if (s.num_new > 0) {
      seqs.push_back(b);
      max_keys = std::max(max_keys, s.cached + s.num_new);
    }
  }
  // Prefill items: (sequence, KV head, tile of TQ tokens), threads' ranges of equal cost
  const PrefillItems items_of(a.seqs, std::move(seqs), H, TQ, KT);
  const int64_t items = items_of.size(), rider_items = static_cast<int64_t>(riders.size()) * H;
  const int64_t max_tiles = (max_keys + KT - 1) / KT, max_keys64 = max_tiles * KT;
  const int64_t nt = parallel ? std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items + rider_items)) : 1;
  const std::vector<int64_t> bound = equal_cost_bounds(items_of.cum(), nt);
  // riders by equal context (keys read): items (rider, KV head), whole riders per thread
  std::vector<double> rider_cum(riders.size() + 1, 0.0);
  for (size_t n = 0; n < riders.size(); ++n) rider_cum[n + 1] = rider_cum[n] + static_cast<double>(a.seqs[riders[n]].cached + 1);
  std::vector<int64_t> rider_bound = equal_cost_bounds(rider_cum, nt);
  for (int64_t& r : rider_bound) r *= H;
  const DecodeCache cache{static_cast<const bf16*>(a.kc), static_cast<const bf16*>(a.vc), a.block_size, a.cb, a.ct, a.ch,
                          H, G, a.ks1, a.vs1};
  auto rider_at = [&](int64_t n) {
    const Seq& s = a.seqs[riders[n]];
    return DecodeSeq{a.q + s.start * a.qs0, a.out + s.start * a.os0, a.block_tables + riders[n] * a.max_blocks,
                     s.cached + 1, a.k + s.start * a.ks0, a.v + s.start * a.vs0};
  };
  auto work = [&](int64_t i0, int64_t i1) {  // prefill items [i0, i1) on the calling thread
    if (i0 >= i1) return;
    std::vector<uint32_t> kp(max_tiles * KT * P), vp(max_tiles * KT * P);
    std::vector<float> acc(RB * D), l(RB), sc(RB * max_keys64);
    std::vector<uint16_t> pb(RB * max_keys64);
    int64_t cur_b = -1, cur_h = -1, packed = 0;
    int64_t n = -1;
    for (int64_t i = i0; i < i1; ++i) {
      const auto [b, h, q0, q1] = items_of.at(i, n);
      const Seq& s = a.seqs[b];
      const int64_t total = s.cached + s.num_new;
      const int64_t need = (s.cached + q1 + KT - 1) / KT;  // key tiles the last token reads
      if (b != cur_b || h != cur_h) {
        cur_b = b;
        cur_h = h;
        packed = 0;
      }
      if (need > packed) {
        pack_tiles<NC>(a, s, b, h, total, packed, need, kp.data(), vp.data());
        packed = need;
      }
      const int64_t rows = (q1 - q0) * G;
      for (int64_t r0 = 0; r0 < rows; r0 += RB) {
        const uint32_t* q_rows[RB];
        const uint32_t* p_rows[RB];
        int64_t last[RB], max_last = 0;
        for (int r = 0; r < RB; ++r) {
          const int64_t row = std::min(r0 + r, rows - 1);  // a short block repeats its last row
          const int64_t tok = q0 + row / G, head = h * G + row % G;
          q_rows[r] = reinterpret_cast<const uint32_t*>(a.q + (s.start + tok) * a.qs0 + head * a.qs1);
          last[r] = s.cached + tok;
          max_last = std::max(max_last, last[r]);
        }
        const int64_t n_pad = (max_last + 32) / 32 * 32;
        float row_max[RB];
        scores<NC>(q_rows, last, max_last, kp.data(), sc.data(), max_keys64, row_max);
        for (int r = 0; r < RB; ++r) {
          l[r] = softmax_row(sc.data() + r * max_keys64, last[r] + 1, n_pad, row_max[r], a.scale,
                             pb.data() + r * max_keys64);
          p_rows[r] = reinterpret_cast<const uint32_t*>(pb.data() + r * max_keys64);
        }
        weighted_values<NC>(p_rows, (max_last + 2) / 2, vp.data(), acc.data());
        for (int r = 0; r < RB && r0 + r < rows; ++r) {
          const int64_t row = r0 + r, tok = q0 + row / G, head = h * G + row % G;
          const __m512 inv = _mm512_set1_ps(1.0f / l[r]);  // l >= 1: the row's max key adds exp(0)
          bf16* o = a.out + (s.start + tok) * a.os0 + head * a.os1;
          for (int c = 0; c < NC; ++c) store16(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * D + 16 * c), inv));
        }
      }
    }
  };
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (rider_items > 0) decode_range<NC>(rider_bound[t], rider_bound[t + 1], cache, a.scale, max_rider_ctx, rider_at);
      work(bound[t], bound[t + 1]);
    }
  });
}

}  // namespace

// q [total_q, H, D], k / v [total_q, KVH, D] (bf16, head_dim contiguous, any row / head
// strides), caches [blocks, block_size, KVH, D] in bf16, or int8 with float32 k_scale / v_scale
// [blocks, block_size, KVH]; lengths as the Python op checked them
// (cached_lens within the table, query_lens summing to total_q). Block ids a sequence reads are
// checked here (ValueError). None when the call does not fit (other dtypes, head_dim not
// 64 / 128 / 256, no AVX512_BF16, an out that is not contiguous bf16 like q).
std::optional<at::Tensor> paged_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                  const at::Tensor& block_tables, const at::Tensor& cached_lens,
                                                  const at::Tensor& query_lens, double scale,
                                                  const std::optional<at::Tensor>& k_scale,
                                                  const std::optional<at::Tensor>& v_scale,
                                                  const std::optional<at::Tensor>& out_buffer) {
  if (!cpu_has_avx512_bf16() || q.scalar_type() != at::kBFloat16) return std::nullopt;
  Args a;
  const auto call = fill_prefill_args(a, q, k, v, k_cache, v_cache, block_tables, cached_lens, query_lens, scale,
                                      k_scale, v_scale, out_buffer, kOneThreadMaxMacs);
  if (!call) return std::nullopt;
  const bool done = with_chunks(call->head_dim, [&](auto nc) { run<decltype(nc)::value>(a, call->parallel); });
  if (!done) return std::nullopt;
  return call->out;
}

// ---- decode -------------------------------------------------------------------------------------
// One query token per sequence; item = (sequence, KV head) with its G query heads, over the
// whole context in three passes (no per-block online softmax):
//   scores[g][t] = q_g . k_t      two vdpbf16ps per key row (D = 64), 16 keys' lane sums at once
//   p[g][t] = exp(scores - max)   one vectorised pass per row; p rounded to bf16, l = sum(p)
//   acc[g] += (p_2u, p_2u+1) . (v_2u, v_2u+1)     value rows interleaved in pairs on the fly
// q [batch, H, D] contiguous bf16; caches bf16 with equal strides (head_dim contiguous); the
// tables and lengths already checked by the caller. False when it does not apply (another
// dtype, head_dim, more than 16 query heads per KV head, or no AVX512_BF16).
bool decode_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens,
                 float scale, at::Tensor& out, bool parallel) {
  if (!cpu_has_avx512_bf16() || q.scalar_type() != at::kBFloat16 || k_cache.scalar_type() != at::kBFloat16 ||
      v_cache.scalar_type() != at::kBFloat16 || !q.is_contiguous() || !out.is_contiguous())
    return false;
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  const int64_t G = H / KVH, bs = k_cache.size(1), sb = k_cache.stride(0), st = k_cache.stride(1), sh = k_cache.stride(2);
  if (G > 16) return false;
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < B; ++b) max_ctx = std::max<int64_t>(max_ctx, context_lens[b]);
  const bf16* qd = q.data_ptr<bf16>();
  bf16* od = out.data_ptr<bf16>();
  const DecodeCache cache{k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), bs, sb, st, sh, KVH, G, 0, 0};
  auto seq_at = [&](int64_t b) {
    return DecodeSeq{qd + b * H * D, od + b * H * D, block_tables + b * max_blocks, context_lens[b], nullptr, nullptr};
  };
  return with_chunks(D, [&](auto nc) {
    at::parallel_for(0, B * KVH, parallel ? 1 : B * KVH, [&](int64_t i0, int64_t i1) {
      decode_range<decltype(nc)::value>(i0, i1, cache, scale, max_ctx, seq_at);
    });
  });
}

namespace parts {

bool decode_bf16_items(const bf16* q, bf16* out, const bf16* k_cache, const bf16* v_cache, int64_t block_size,
                       int64_t sb, int64_t st, int64_t sh, int64_t kv_heads, int64_t group, int64_t d,
                       const int32_t* block_tables, int64_t max_blocks, const int32_t* context_lens,
                       int64_t max_ctx, float scale, int64_t i0, int64_t i1) {
  if (group > 16) return false;
  const DecodeCache cache{k_cache, v_cache, block_size, sb, st, sh, kv_heads, group, 0, 0};
  const int64_t H = kv_heads * group;
  auto seq_at = [&](int64_t b) {
    return DecodeSeq{q + b * H * d, out + b * H * d, block_tables + b * max_blocks, context_lens[b], nullptr, nullptr};
  };
  return with_chunks(d, [&](auto nc) { decode_range<decltype(nc)::value>(i0, i1, cache, scale, max_ctx, seq_at); });
}

}  // namespace parts
}  // namespace mops
