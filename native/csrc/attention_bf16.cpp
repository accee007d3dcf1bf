// Attention on CPU for bf16 queries over a bf16 paged cache through AVX512_BF16 dot products
// (vdpbf16ps: 32 bf16 products summed into 16 fp32 lanes per instruction), checked at run
// time: causal prefill (below; the cache bf16 or int8, whose rows are dequantised to bf16 as
// keys are laid out) and decode (`decode_bf16`, at the end; bf16 cache). Other dtypes and CPUs
// without AVX512_BF16 are declined (the callers run their other paths).
//
// Prefill. Sequence s has c cached tokens (in the paged cache) and n new ones (packed in q / k / v);
// new token i attends to keys 0 .. c + i. Work item = (sequence, KV head, tile of TQ new
// tokens); its rows are the tile's tokens x the G query heads sharing the KV head (GQA).
// Per item, keys are re-laid-out once per thread and (sequence, KV head), in tiles of KT = 32:
//
//   Kp[tile][p][j] = (k_j[2p], k_j[2p+1])     one 32-bit pair per key j: a row's scores for 32
//                                             keys are 2 x D/2 vdpbf16ps with q's pair p broadcast
//   Vp[tile][u][c][l] = (v_2u[16c+l], v_2u+1[16c+l])   key pair u, output lanes 16c..16c+15:
//                                             out += (p_2u, p_2u+1) broadcast . Vp[u][c]
//
// and RB rows at a time run flash-style over the key tiles: scores (fp32) -> causal mask ->
// online softmax (running max m, raised lazily; sum l; the accumulator rescaled by exp(m_old - m_new)) ->
// probabilities rounded to bf16 for the P.V products (fp32 accumulation), as flash attention
// does on GPUs. out = acc / l, rounded to bf16.
#include <ATen/Parallel.h>
#include <ATen/ATen.h>

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
#include "vec.h"

#define MOPS_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace mops {
namespace {

constexpr int64_t KT = 32;  // keys per tile
constexpr int64_t TQ = 32;  // new tokens per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kRescale = 8.0f;  // lazy-max margin (natural log units): see attend_rows
// Fewer multiply-adds run on the calling thread (see mooncake_ops.linear.ONE_THREAD_MAX_MACS).
constexpr int64_t kOneThreadMaxMacs = int64_t{1} << 21;

using bf16 = c10::BFloat16;

struct Seq {
  int64_t cached, num_new, start;  // start: the sequence's first row in q / k / v
};

struct PrefillArgs {
  const bf16 *q, *k, *v;
  const void *kc, *vc;                    // bf16, or int8 with per-token scales ks / vs
  const float *ks, *vs;
  int64_t kssb, ksst, kssh, vssb, vsst, vssh;
  bf16* out;
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;  // row / head strides of q, k, v
  int64_t cb, ct, ch, vcb, vct, vch;      // block / token / head strides of the caches
  int64_t os0, os1;
  const int32_t* block_tables;
  int64_t max_blocks, block_size, num_kv_heads, group;
  float scale;
  std::vector<Seq> seqs;
};

// Key or value row j of sequence b, KV head h as bf16: cached tokens from the pool (int8 rows
// dequantised into `tmp`), new ones from k / v in place.
template <int NC>
inline const bf16* key_row(const PrefillArgs& a, const Seq& s, int64_t b, int64_t h, int64_t j, bool value,
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
void pack_tiles(const PrefillArgs& a, const Seq& s, int64_t b, int64_t h, int64_t total, int64_t t0,
                int64_t t1, uint32_t* kp, uint32_t* vp) {
  constexpr int64_t D = 16 * NC, P = D / 2;
  for (int64_t t = t0; t < t1; ++t) {
    uint32_t* kt = kp + t * P * KT;
    uint32_t* vt = vp + t * KT * D / 2;
    for (int64_t jj = 0; jj < KT; ++jj) {
      const int64_t j = t * KT + jj;
      if (j < total) {
        uint32_t row[P];
        bf16 tmp[D];
        std::memcpy(row, key_row<NC>(a, s, b, h, j, false, tmp), sizeof(row));
        for (int64_t p = 0; p < P; ++p) kt[p * KT + jj] = row[p];
      } else {
        for (int64_t p = 0; p < P; ++p) kt[p * KT + jj] = 0;
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

// RB query rows (pointers q_rows, last key each may see: last[r]) over key tiles [0, ntiles).
// Lazy running max: a row's max m is raised (and its accumulators and sum rescaled) only when a
// scaled score passes it by more than kRescale, so most tiles skip the horizontal max; the
// probabilities exp(s - m) stay <= e^kRescale meanwhile, and the sum l stays a vector until
// the end. Both change nothing but rounding: out = acc / l for any m.
template <int NC, int RB>
MOPS_BF16_TARGET void attend_rows(const uint32_t* const* q_rows, const int64_t* last, int64_t ntiles,
                                  const uint32_t* kp, const uint32_t* vp, float scale, float* acc_out,
                                  float* l_out) {
  constexpr int64_t D = 16 * NC, P = D / 2;
  __m512 acc[RB][NC], lsum[RB];
  float m[RB];
  alignas(64) uint32_t pr[RB][KT / 2];
  for (int r = 0; r < RB; ++r) {
    m[r] = kNegInf;
    lsum[r] = _mm512_setzero_ps();
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  const __m512 vscale = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(kNegInf);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t t = 0; t < ntiles; ++t) {
    const uint32_t* kt = kp + t * P * KT;
    const uint32_t* vt = vp + t * KT * D / 2;
    __m512 s[RB][2];
    for (int r = 0; r < RB; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * KT);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + p * KT + 16);
      for (int r = 0; r < RB; ++r) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_rows[r][p]));
        s[r][0] = _mm512_dpbf16_ps(s[r][0], qb, k0);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], qb, k1);
      }
    }
    const int64_t j0 = t * KT;
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      __mmask16 v0 = 0xFFFF, v1 = 0xFFFF;
      if (j0 + KT - 1 > last[r]) {  // the causal edge (or past it): keys j > last[r] are hidden
        const __m512i limit = _mm512_set1_epi32(static_cast<int>(last[r] - j0));
        v0 = _mm512_cmple_epi32_mask(lane, limit);
        v1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), limit);
      }
      const __m512 mx = _mm512_mul_ps(_mm512_max_ps(_mm512_mask_mov_ps(neg_inf, v0, s[r][0]),
                                                    _mm512_mask_mov_ps(neg_inf, v1, s[r][1])), vscale);
      if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(m[r] + kRescale), _CMP_GT_OQ)) {
        const float m_new = _mm512_reduce_max_ps(mx);
        const __m512 va = _mm512_set1_ps(std::exp(m[r] - m_new));  // 0 on the first tile (m = -inf)
        lsum[r] = _mm512_mul_ps(lsum[r], va);
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], va);
        m[r] = m_new;
      }
      const __m512 vm = _mm512_set1_ps(m[r]);
      const __m512 p0 = _mm512_maskz_mov_ps(v0, exp16(_mm512_fmsub_ps(s[r][0], vscale, vm)));
      const __m512 p1 = _mm512_maskz_mov_ps(v1, exp16(_mm512_fmsub_ps(s[r][1], vscale, vm)));
      lsum[r] = _mm512_add_ps(lsum[r], _mm512_add_ps(p0, p1));
      _mm512_store_si512(pr[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // keys 0..15 low, 16..31 high
    }
    for (int64_t u = 0; u < KT / 2; ++u) {
      __m512bh vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vt + (u * NC + c) * 16);
      for (int r = 0; r < RB; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pr[r][u]));
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_out + r * D + 16 * c, acc[r][c]);
    l_out[r] = _mm512_reduce_add_ps(lsum[r]);
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

template <int NC>
void run(const PrefillArgs& a, bool parallel) {
  constexpr int64_t D = 16 * NC, P = D / 2;
  constexpr int RB = rows_per_block<NC>();
  const int64_t G = a.group, H = a.num_kv_heads;
  // Items: (sequence, KV head, tile); tiles of one (sequence, head) alternate from both ends
  // (0, T-1, 1, T-2, ...) so that the contiguous ranges threads get hold similar causal work.
  std::vector<int64_t> first(a.seqs.size() + 1, 0);
  int64_t max_keys = 0;
  for (size_t b = 0; b < a.seqs.size(); ++b) {
    const int64_t tiles = (a.seqs[b].num_new + TQ - 1) / TQ;
    first[b + 1] = first[b] + tiles * H;
    max_keys = std::max(max_keys, a.seqs[b].cached + a.seqs[b].num_new);
  }
  const int64_t items = first.back();
  const int64_t max_tiles = (max_keys + KT - 1) / KT, max_keys32 = max_tiles * KT;
  // A sequence with one new token (a decode in a mixed batch) reads its cached keys in place
  // through the decode kernel (its own K/V from k / v) instead of re-laying its whole context
  // out for one query row: for a bf16 cache with K and V laid out alike, heads contiguous.
  const bool by_rows = a.ks == nullptr && a.cb == a.vcb && a.ct == a.vct && a.qs1 == D && a.os1 == D && G <= 16;
  auto tile_of = [](int64_t u, int64_t tiles) { return u % 2 == 0 ? u / 2 : tiles - 1 - u / 2; };
  // Threads get contiguous item ranges of equal cost (rows x keys they read), not equal counts:
  // a chunk often holds a sequence with a long cached prefix beside one that starts from zero.
  std::vector<double> cum(items + 1, 0.0);
  for (size_t b = 0; b < a.seqs.size(); ++b) {
    const Seq& s = a.seqs[b];
    const int64_t tiles = (s.num_new + TQ - 1) / TQ;
    for (int64_t local = 0; local < first[b + 1] - first[b]; ++local) {
      const int64_t q0 = tile_of(local % tiles, tiles) * TQ, q1 = std::min(s.num_new, q0 + TQ);
      const double cost = static_cast<double>(q1 - q0) * static_cast<double>(s.cached + (q0 + q1) / 2 + KT);
      cum[first[b] + local + 1] = cum[first[b] + local] + cost;
    }
  }
  const int64_t nt = parallel ? std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)) : 1;
  std::vector<int64_t> bound(nt + 1, items);
  bound[0] = 0;
  for (int64_t t = 1; t < nt; ++t)
    bound[t] = std::lower_bound(cum.begin(), cum.end(), cum.back() * static_cast<double>(t) / static_cast<double>(nt)) - cum.begin();
  auto work = [&](int64_t i0, int64_t i1) {  // items [i0, i1) on the calling thread
    if (i0 >= i1) return;
    std::vector<uint32_t> kp(max_tiles * KT * P), vp(max_tiles * KT * P);
    std::vector<float> acc(RB * D), l(RB);
    int64_t cur_b = -1, cur_h = -1, packed = 0, rows_of = -1;
    std::vector<int64_t> rows(by_rows ? max_keys32 : 0);
    std::vector<float> sc(by_rows ? G * max_keys32 : 0);
    std::vector<uint16_t> pb(by_rows ? G * max_keys32 : 0);
    int64_t b = std::upper_bound(first.begin(), first.end(), i0) - first.begin() - 1;
    for (int64_t i = i0; i < i1; ++i) {
      while (i >= first[b + 1]) ++b;
      const Seq& s = a.seqs[b];
      const int64_t tiles = (s.num_new + TQ - 1) / TQ, local = i - first[b];
      const int64_t h = local / tiles, u = local % tiles;
      const int64_t tile = tile_of(u, tiles);
      const int64_t q0 = tile * TQ, q1 = std::min(s.num_new, q0 + TQ);
      const int64_t total = s.cached + s.num_new;
      const int64_t need = (s.cached + q1 + KT - 1) / KT;  // key tiles the last token reads
      if (s.num_new == 1 && by_rows) {  // a decode token in a mixed batch: no re-layout
        if (b != rows_of) {
          row_offsets(a.block_tables + b * a.max_blocks, s.cached, a.block_size, a.cb, a.ct, rows.data());
          rows_of = b;
        }
        decode_item<NC>(a.q + s.start * a.qs0 + h * G * a.qs1, static_cast<const bf16*>(a.kc) + h * a.ch,
                        static_cast<const bf16*>(a.vc) + h * a.vch, rows.data(), total, G, a.scale, sc.data(),
                        pb.data(), a.out + s.start * a.os0 + h * G * a.os1, [] {},
                        a.k + s.start * a.ks0 + h * a.ks1, a.v + s.start * a.vs0 + h * a.vs1);
        continue;
      }
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
        int64_t last[RB], max_last = 0;
        for (int r = 0; r < RB; ++r) {
          const int64_t row = std::min(r0 + r, rows - 1);  // a short block repeats its last row
          const int64_t tok = q0 + row / G, head = h * G + row % G;
          q_rows[r] = reinterpret_cast<const uint32_t*>(a.q + (s.start + tok) * a.qs0 + head * a.qs1);
          last[r] = s.cached + tok;
          max_last = std::max(max_last, last[r]);
        }
        attend_rows<NC, RB>(q_rows, last, max_last / KT + 1, kp.data(), vp.data(), a.scale, acc.data(), l.data());
        for (int r = 0; r < RB && r0 + r < rows; ++r) {
          const int64_t row = r0 + r, tok = q0 + row / G, head = h * G + row % G;
          const __m512 inv = _mm512_set1_ps(1.0f / l[r]);  // l >= 1: the row's max key adds exp(>= 0)
          bf16* o = a.out + (s.start + tok) * a.os0 + head * a.os1;
          for (int c = 0; c < NC; ++c) store16(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * D + 16 * c), inv));
        }
      }
    }
  };
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) work(bound[t], bound[t + 1]);
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
  if (!cpu_has_avx512_bf16()) return std::nullopt;
  for (const at::Tensor* t : {&q, &k, &v})
    if (t->scalar_type() != at::kBFloat16 || t->stride(-1) != 1) return std::nullopt;
  const bool int8 = k_cache.scalar_type() == at::kChar;
  if (int8 != (v_cache.scalar_type() == at::kChar) || int8 != (k_scale.has_value() && v_scale.has_value()))
    return std::nullopt;
  if (!int8 && (k_cache.scalar_type() != at::kBFloat16 || v_cache.scalar_type() != at::kBFloat16)) return std::nullopt;
  if (k_cache.stride(-1) != 1 || v_cache.stride(-1) != 1) return std::nullopt;
  if (int8 && (k_scale->scalar_type() != at::kFloat || v_scale->scalar_type() != at::kFloat)) return std::nullopt;
  if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3 || k_cache.dim() != 4 || v_cache.dim() != 4) return std::nullopt;
  const int64_t D = q.size(2), H = q.size(1), KVH = k_cache.size(2);
  if (KVH == 0 || H % KVH || k.size(1) != KVH || v.size(1) != KVH || k.size(2) != D || k_cache.size(3) != D)
    return std::nullopt;
  if (out_buffer && (out_buffer->scalar_type() != at::kBFloat16 || !out_buffer->is_contiguous() ||
                     out_buffer->sizes() != q.sizes()))
    return std::nullopt;
  const auto bt = block_tables.to(at::kInt).contiguous();
  const auto cl = cached_lens.to(at::kLong).contiguous();
  const auto ql = query_lens.to(at::kLong).contiguous();
  auto out = out_buffer ? *out_buffer : at::empty(q.sizes(), q.options());
  PrefillArgs a{};
  a.q = q.data_ptr<bf16>();
  a.k = k.data_ptr<bf16>();
  a.v = v.data_ptr<bf16>();
  a.kc = k_cache.data_ptr();
  a.vc = v_cache.data_ptr();
  if (int8) {
    a.ks = k_scale->data_ptr<float>();
    a.vs = v_scale->data_ptr<float>();
    a.kssb = k_scale->stride(0), a.ksst = k_scale->stride(1), a.kssh = k_scale->stride(2);
    a.vssb = v_scale->stride(0), a.vsst = v_scale->stride(1), a.vssh = v_scale->stride(2);
  }
  a.out = out.data_ptr<bf16>();
  a.qs0 = q.stride(0), a.qs1 = q.stride(1), a.ks0 = k.stride(0), a.ks1 = k.stride(1);
  a.vs0 = v.stride(0), a.vs1 = v.stride(1);
  a.cb = k_cache.stride(0), a.ct = k_cache.stride(1), a.ch = k_cache.stride(2);
  a.vcb = v_cache.stride(0), a.vct = v_cache.stride(1), a.vch = v_cache.stride(2);
  a.os0 = out.stride(0), a.os1 = out.stride(1);
  a.block_tables = bt.data_ptr<int32_t>();
  a.max_blocks = bt.size(1);
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
  const bool parallel = macs >= kOneThreadMaxMacs && at::get_num_threads() > 1;
  const bool done = with_chunks(D, [&](auto nc) { run<decltype(nc)::value>(a, parallel); });
  if (!done) return std::nullopt;
  return out;
}

// ---- decode -------------------------------------------------------------------------------------
// One query token per sequence; item = (sequence, KV head) with its G query heads, over the
// whole context in three passes (no per-block online softmax):
//   scores[g][t] = q_g . k_t      two vdpbf16ps per key row (D = 64), 16 keys' lane sums at once
//   p[g][t] = exp(scores - max)   one vectorised pass per row; p rounded to bf16, l = sum(p)
//   acc[g] += (p_2u, p_2u+1) . (v_2u, v_2u+1)     value rows interleaved in pairs on the fly
namespace {

}  // namespace

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
  const int64_t ctx32 = (max_ctx + 31) / 32 * 32;
  const bf16* qd = q.data_ptr<bf16>();
  const bf16* kd = k_cache.data_ptr<bf16>();
  const bf16* vd = v_cache.data_ptr<bf16>();
  bf16* od = out.data_ptr<bf16>();
  return with_chunks(D, [&](auto nc) {
    constexpr int NC = decltype(nc)::value;
    at::parallel_for(0, B * KVH, parallel ? 1 : B * KVH, [&](int64_t i0, int64_t i1) {
      std::vector<int64_t> rows(ctx32);
      std::vector<float> sc(G * ctx32);
      std::vector<uint16_t> pb(G * ctx32);
      // The next sequence's key and value rows (all KV heads: bytes [0, span) of each token's
      // row) go to L2 a few rows per key tile while this sequence computes: blocks are
      // scattered, so neither the hardware prefetcher nor a burst at the item's start keeps DRAM
      // busy (cold pools, batch 32 x ~160 tokens: 0.35-0.37 -> 0.19-0.23 ms per call).
      const int64_t span = ((KVH - 1) * sh + D) * 2;
      std::vector<int64_t> ahead(ctx32);
      int64_t ahead_n = 0, ahead_done = 0, ahead_per_tile = 0;
      auto on_tile = [&] {
        for (int64_t k = 0; k < ahead_per_tile && ahead_done < ahead_n; ++k, ++ahead_done) {
          const char* kr = reinterpret_cast<const char*>(kd + ahead[ahead_done]);
          const char* vr = reinterpret_cast<const char*>(vd + ahead[ahead_done]);
          for (int64_t z = 0; z < span; z += 64) {
            _mm_prefetch(kr + z, _MM_HINT_T1);
            _mm_prefetch(vr + z, _MM_HINT_T1);
          }
        }
      };
      int64_t cur = -1;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / KVH, h = i % KVH, ctx = context_lens[b];
        bf16* o = od + (b * H + h * G) * D;
        if (ctx == 0) {
          std::fill(o, o + G * D, bf16(0.0f));
          continue;
        }
        if (b != cur) {  // the sequence's row offsets, shared by its heads; the next one's ahead
          row_offsets(block_tables + b * max_blocks, ctx, bs, sb, st, rows.data());
          cur = b;
          ahead_n = ahead_done = 0;
          if (b + 1 <= (i1 - 1) / KVH) {  // the next sequence is this thread's too
            ahead_n = context_lens[b + 1];
            row_offsets(block_tables + (b + 1) * max_blocks, ahead_n, bs, sb, st, ahead.data());
            const int64_t tiles = std::min(KVH - h, i1 - i) * G * ((ctx + 15) / 16);  // on_tile calls left
            ahead_per_tile = (ahead_n + tiles - 1) / tiles;
          }
        }
        const int64_t off = h * sh;
        decode_item<NC>(qd + (b * H + h * G) * D, kd + off, vd + off, rows.data(), ctx, G, scale, sc.data(), pb.data(), o,
                        on_tile);
      }
    });
  });
}

}  // namespace mops
