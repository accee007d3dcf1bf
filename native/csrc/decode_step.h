// A decode step of a dense Llama-family model's layers in one native call, shared by both builds
// (decode_step.cpp: AVX-512 with AVX512_BF16; ../csrc_avx2/decode_step_avx2.cpp: AVX2), bf16
// activations and KV cache; each matmul weight a bf16 weight in the build's layout (AVX-512:
// packed by bf16_pack_weight; AVX2: dense [N, K], as its dense_linear takes it), pack_int8_weight's
// int8 rows, or a packed GGUF weight, gguf_linear's: per layer
//
//   norm (+ residual) -> qkv (+ bias) -> [q/k norm] -> RoPE -> KV write -> attention -> o
//   -> norm (+ residual) -> gate/up (+ SiLU: the AVX-512 packed bf16 kernel's) -> [SiLU-and-mul] -> down
//
// and, for run_logits (set_head), the final norm (+ residual) and the LM head into float32 logits,
// with no Python between the ops and one parallel region for the whole step. The matmuls and
// attention are phases of tasks (an equal range of a matmul's output rows, two per thread; a
// (sequence, KV head) item of attention, which also rotates and writes that head's K / V); a
// norm, and SiLU-and-mul before an int8 / GGUF down, is computed by each thread before its first
// task of the phase that reads it. Every thread walks the phases in order: it waits until the
// previous phase's tasks are all done, then takes the phase's next task from a shared counter
// until none is left. No thread
// waits for another to arrive, only for tasks in flight to finish, so a thread the OS runs
// late (a neighbour on its core) costs the step at most the task it holds, and the other
// thread does the rest. The tasks call the same kernel parts the ops' entries run
// (step_parts.h, defined by each build for its ISA), and every output element is computed by
// one task (a norm's by each thread that reads it, the same way) in the entry's order: the step is bit-equal to the op chain it replaces (on AVX2 for
// up to 2 rows of dense bf16 or int8 weights, where its matmul entries take the same path).
//
// Each build defines, after including this header, the three functions declared in namespace
// step below (its CPU check, its bf16 weight layout and its bf16 matmul) and calls
// def_decode_step from its module's bindings.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/python.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "dispatch.h"
#include "gguf_blocks.h"
#include "step_parts.h"

namespace mops {
namespace step {

using parts::bf16;
// Tasks per thread of a matmul phase: equal ranges of its output rows. Long contiguous ranges
// keep the hardware prefetchers streaming (batch-1 step of the default model, 2 threads of a
// Zen 4: panels of 4 blocks 10.0 ms, 1 task per thread 9.3, 2 9.1, 4 9.4), and the second task
// lets a thread that started late (a neighbour on its core) take less.
constexpr int64_t kTasksPerThread = 2;

[[noreturn]] inline void refuse(const std::string& what) { throw std::invalid_argument("decode step: " + what); }

inline std::string shape_of(at::IntArrayRef sizes) {
  std::string out;
  for (auto s : sizes) out += (out.empty() ? "" : ", ") + std::to_string(s);
  return "[" + out + "]";
}

inline void check_bf16(const at::Tensor& t, const std::string& name, const std::vector<int64_t>& shape) {
  if (t.scalar_type() != at::kBFloat16 || !t.is_contiguous() || t.sizes().vec() != shape)
    refuse(name + " must be a contiguous bf16 tensor of shape " + shape_of(shape) + "; got " +
           std::string(c10::toString(t.scalar_type())) + " " + shape_of(t.sizes()) +
           (t.is_contiguous() ? "" : ", not contiguous"));
}

// A matmul weight's kind: the AVX-512 build's packed bf16 layout, pack_int8_weight's int8 rows,
// the AVX2 build's dense bf16 [N, K], or (any kind >= 0) a packed GGUF weight of that ggml type
// (gguf_linear's).
constexpr int64_t kPackedBf16 = -1, kInt8 = -2, kDenseBf16 = -3;

// A matmul weight; grouped: a GGUF weight with 16 rows side by side. `unit`: output rows no task
// splits (a packed bf16 block or GGUF group of 16; 4 rows of the dense bf16, int8 and GGUF rows
// kernels).
struct Weight {
  at::Tensor w;
  int64_t kind = kPackedBf16;
  bool grouped = false;
  int64_t n = 0, unit = 16;
};

// What each build defines (see the top): refuse() where this CPU cannot run the build's parts;
// a bf16 weight of `kind` checked against the build's layout (n and unit set); output rows
// [r0, r1) of y [M, n] = x [M, k] @ w^T (+ bias), a packed gate / up weight writing
// silu(gate) * up (y [M, n / 2]).
void check_cpu();
Weight bf16_weight(const at::Tensor& w, int64_t kind, const std::string& name, int64_t K);
void bf16_matmul(const Weight& w, const bf16* x, int64_t k, const bf16* bias, bf16* y, int64_t M, int64_t r0,
                 int64_t r1);

inline Weight weight_of(const at::Tensor& w, int64_t kind, const std::string& name, int64_t K) {
  if (kind == kPackedBf16 || kind == kDenseBf16) return bf16_weight(w, kind, name, K);
  Weight y{w, kind};
  if (kind == kInt8) {
    if (w.scalar_type() != at::kChar || !w.is_contiguous() || w.dim() != 2 || w.size(1) != K + 4)
      refuse(name + " must be an int8 weight packed by pack_int8_weight: [N, " + std::to_string(K + 4) + "]");
    y.n = w.size(0);
    y.unit = 4;
    return y;
  }
  if (kind < 0) refuse(name + ": unknown weight kind " + std::to_string(kind));
  if (w.scalar_type() != at::kByte || !w.is_contiguous())
    refuse(name + " of GGUF type " + std::to_string(kind) + " must be a contiguous uint8 packed GGUF weight");
  const gguf::Layout layout = gguf::check_weight(static_cast<int>(kind), w, K);  // ValueError as gguf_linear's
  y.grouped = layout.grouped;
  y.n = layout.rows;
  y.unit = y.grouped ? 16 : 4;
  return y;
}

struct Layer {
  at::Tensor input_norm, post_norm, qkv_bias, q_norm, k_norm, k_cache, v_cache;
  Weight qkv, o, gate_up, down;
};

// Phase counters: tasks taken (`next`) and finished (`done`), one pair per phase of a step.
struct Phases {
  explicit Phases(int64_t n) : next(new std::atomic<int64_t>[n]), done(new std::atomic<int64_t>[n]) {
    for (int64_t i = 0; i < n; ++i) {
      next[i].store(0, std::memory_order_relaxed);
      done[i].store(0, std::memory_order_relaxed);
    }
  }
  std::unique_ptr<std::atomic<int64_t>[]> next, done;
};

// Until `done` reaches n: spin briefly (the other thread's task is microseconds away), then
// yield the core, so a waiting thread never holds one its partner needs.
inline void wait_for(const std::atomic<int64_t>& done, int64_t n) {
  for (int spins = 0; done.load(std::memory_order_acquire) < n; ++spins) {
    if (spins < 2000) _mm_pause();
    else std::this_thread::yield();
  }
}

class DecodeStep {
 public:
  DecodeStep(std::vector<at::Tensor> input_norms, std::vector<at::Tensor> post_norms, std::vector<at::Tensor> qkv,
             std::vector<std::optional<at::Tensor>> qkv_bias, std::vector<std::optional<at::Tensor>> q_norms,
             std::vector<std::optional<at::Tensor>> k_norms, std::vector<at::Tensor> o,
             std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, std::vector<at::Tensor> k_caches,
             std::vector<at::Tensor> v_caches, std::vector<std::vector<int64_t>> kinds, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(num_heads), kv_heads_(num_kv_heads), d_(head_dim), eps_(static_cast<float>(eps)),
        scale_(static_cast<float>(scale)) {
    check_cpu();
    const size_t L = input_norms.size();
    for (size_t n : {post_norms.size(), qkv.size(), qkv_bias.size(), q_norms.size(), k_norms.size(), o.size(),
                     gate_up.size(), down.size(), k_caches.size(), v_caches.size(), kinds.size()})
      if (n != L) refuse("every per-layer list must have one entry per layer (" + std::to_string(L) + ")");
    if (L == 0) refuse("no layers");
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > 16)
      refuse("num_heads must be a multiple of num_kv_heads, at most 16 per KV head");
    if (head_dim != 64 && head_dim != 128 && head_dim != 256) refuse("head_dim must be 64, 128 or 256");
    hidden_ = input_norms[0].numel();
    if (hidden_ % 32) refuse("hidden size must be a multiple of 32");
    const int64_t q_size = heads_ * d_, kv_size = kv_heads_ * d_;
    for (size_t l = 0; l < L; ++l) {
      const std::string at = "layer " + std::to_string(l) + " ";
      Layer y;
      y.input_norm = input_norms[l];
      y.post_norm = post_norms[l];
      check_bf16(y.input_norm, at + "input_norm", {hidden_});
      check_bf16(y.post_norm, at + "post_attention_norm", {hidden_});
      if (kinds[l].size() != 4) refuse(at + "weight kinds must be (qkv, o, gate_up, down)");
      const auto& gt = kinds[l];
      y.qkv = weight_of(qkv[l], gt[0], at + "qkv weight", hidden_);
      if (y.qkv.n != q_size + 2 * kv_size)
        refuse(at + "qkv weight must have num_heads * head_dim + 2 * num_kv_heads * head_dim outputs");
      if (qkv_bias[l]) {
        y.qkv_bias = *qkv_bias[l];
        check_bf16(y.qkv_bias, at + "qkv bias", {q_size + 2 * kv_size});
      }
      if (q_norms[l].has_value() != k_norms[l].has_value()) refuse(at + "q_norm and k_norm come together");
      if (q_norms[l]) {
        y.q_norm = *q_norms[l];
        y.k_norm = *k_norms[l];
        check_bf16(y.q_norm, at + "q_norm", {d_});
        check_bf16(y.k_norm, at + "k_norm", {d_});
      }
      y.o = weight_of(o[l], gt[1], at + "o weight", q_size);
      if (y.o.n != hidden_) refuse(at + "o weight must have hidden outputs");
      // bf16: gate and up blocks interleaved for the fused SiLU (units of a gate / up pair);
      // int8, GGUF: [gate; up] rows, SiLU-and-mul a phase of its own
      y.gate_up = weight_of(gate_up[l], gt[2], at + "gate_up weight", hidden_);
      if (y.gate_up.kind == kPackedBf16) y.gate_up.unit = 32;
      if (l == 0) inter_ = y.gate_up.n / 2;
      if (y.gate_up.n != 2 * inter_ || inter_ % 16) refuse(at + "gate_up weight must have 2 x intermediate outputs");
      y.down = weight_of(down[l], gt[3], at + "down weight", inter_);
      if (y.down.n != hidden_) refuse(at + "down weight must have hidden outputs");
      y.k_cache = k_caches[l];
      y.v_cache = v_caches[l];
      for (const at::Tensor* c : {&y.k_cache, &y.v_cache})
        if (c->scalar_type() != at::kBFloat16 || c->dim() != 4 || c->size(2) != kv_heads_ || c->size(3) != d_ ||
            c->stride(3) != 1)
          refuse(at + "KV caches must be bf16 [blocks, block_size, num_kv_heads, head_dim], head_dim contiguous");
      if (y.k_cache.strides() != y.v_cache.strides() || y.k_cache.sizes() != y.v_cache.sizes())
        refuse(at + "K and V caches must have equal shapes and strides");
      layers_.push_back(std::move(y));
    }
  }

  // The model's last norm (bf16 [hidden]) and LM head weight (of kind `kind`, vocab outputs),
  // for run_logits.
  void set_head(const at::Tensor& norm, const at::Tensor& weight, int64_t kind) {
    check_bf16(norm, "the final norm", {hidden_});
    head_ = weight_of(weight, kind, "lm_head weight", hidden_);
    head_norm_ = norm;
  }

  // x [B, hidden] bf16 (the embedded tokens), positions int64 [B], slot_mapping int64 [B],
  // block_tables int32 [B, max_blocks], context_lens int32 [B] (with the new token), the rope
  // table float32 [max_position, rotary_dim]: the last layer's (x, residual), as the model's
  // layer loop returns them.
  std::vector<at::Tensor> run(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& slots,
                              const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& rope) {
    return steps(x_in, positions, slots, block_tables, context_lens, rope, false);
  }

  // The same, then the final norm (+ residual) and the LM head (set_head): float32 logits
  // [B, vocab], the head's bf16 outputs widened (as the model's head matmul, then .float()).
  at::Tensor run_logits(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& slots,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& rope) {
    if (!head_norm_.defined()) refuse("no LM head: call set_head first");
    return steps(x_in, positions, slots, block_tables, context_lens, rope, true)[0];
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<at::Tensor> steps(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& slots,
                                const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& rope,
                                bool with_head) {
    const int64_t B = x_in.size(0);
    check_bf16(x_in, "x", {B, hidden_});
    if (positions.scalar_type() != at::kLong || slots.scalar_type() != at::kLong || positions.numel() != B ||
        slots.numel() != B || !positions.is_contiguous() || !slots.is_contiguous())
      refuse("positions and slot_mapping must be contiguous int64 [batch]");
    if (block_tables.scalar_type() != at::kInt || block_tables.dim() != 2 || block_tables.size(0) != B ||
        !block_tables.is_contiguous() || context_lens.scalar_type() != at::kInt || context_lens.numel() != B ||
        !context_lens.is_contiguous())
      refuse("block_tables must be contiguous int32 [batch, max_blocks] and context_lens int32 [batch]");
    if (rope.scalar_type() != at::kFloat || rope.dim() != 2 || !rope.is_contiguous() || rope.size(1) > d_ ||
        (rope.size(1) / 2) % 16)
      refuse("the rope table must be contiguous float32 [max_position, rotary_dim], rotary_dim / 2 a multiple of 16");
    const at::Tensor& k0 = layers_[0].k_cache;
    const int64_t num_blocks = k0.size(0), bs = k0.size(1), max_blocks = block_tables.size(1);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int32_t* bt = block_tables.data_ptr<int32_t>();
    const int32_t* cl = context_lens.data_ptr<int32_t>();
    int64_t max_ctx = 0;
    for (int64_t b = 0; b < B; ++b) {
      if (pos[b] < 0 || pos[b] >= rope.size(0))
        refuse("positions[" + std::to_string(b) + "] = " + std::to_string(pos[b]) + " is outside the rope table's [0, " +
               std::to_string(rope.size(0)) + ")");
      if (slot[b] >= num_blocks * bs)
        refuse("slot_mapping[" + std::to_string(b) + "] = " + std::to_string(slot[b]) + " is outside the cache's " +
               std::to_string(num_blocks * bs) + " slots");
      if (cl[b] < 1 || cl[b] > max_blocks * bs)
        refuse("context_lens[" + std::to_string(b) + "] = " + std::to_string(cl[b]) + " must be in [1, " +
               std::to_string(max_blocks * bs) + "] (block_tables' blocks x block_size)");
      check_used_blocks(bt, max_blocks, bs, b, cl[b], num_blocks);
      max_ctx = std::max<int64_t>(max_ctx, cl[b]);
    }
    const auto opt = x_in.options();
    const int64_t q_size = heads_ * d_, kv_size = kv_heads_ * d_, nqkv = q_size + 2 * kv_size;
    const int64_t nt = at::get_num_threads();
    at::Tensor x = x_in.clone();
    // the residual stream, two buffers: a layer's input norm reads rs0 and writes rs1, its post
    // norm reads rs1 and writes rs0 (so the writer never overwrites what another thread reads)
    at::Tensor rs0 = at::empty({B, hidden_}, opt), rs1 = at::empty({B, hidden_}, opt);
    at::Tensor qkv = at::empty({B, nqkv}, opt), q = at::empty({B, q_size}, opt), attn = at::empty({B, q_size}, opt);
    at::Tensor act = at::empty({B, inter_}, opt), gu = at::empty({B, 2 * inter_}, opt);  // gu: int8 / GGUF gate / up
    // each thread's own: a norm's output, the residual it computes (unless it is the writer),
    // SiLU-and-mul's output (int8 / GGUF)
    at::Tensor h_own = at::empty({nt, B, hidden_}, opt), r_own = at::empty({nt, B, hidden_}, opt);
    at::Tensor act_own = at::empty({nt, B, inter_}, opt);
    bf16 *xd = x.data_ptr<bf16>(), *r0d = rs0.data_ptr<bf16>(), *r1d = rs1.data_ptr<bf16>();
    bf16 *qkvd = qkv.data_ptr<bf16>(), *qd = q.data_ptr<bf16>(), *ad = attn.data_ptr<bf16>();
    bf16 *actd = act.data_ptr<bf16>(), *gud = gu.data_ptr<bf16>();
    bf16 *hown = h_own.data_ptr<bf16>(), *rown = r_own.data_ptr<bf16>(), *aown = act_own.data_ptr<bf16>();
    const float* rc = rope.data_ptr<float>();
    const int64_t rot = rope.size(1), G = heads_ / kv_heads_;
    const int64_t sb = k0.stride(0), st = k0.stride(1), sh = k0.stride(2);

    // a matmul's tasks: kTasksPerThread per thread, equal ranges of its output units
    auto tasks = [&](const Weight& w) { return std::min(w.n / w.unit, kTasksPerThread * nt); };
    // the output rows [r0, r1) of task `task` of w's matmul (the last: any rest)
    auto rows_of = [&](const Weight& w, int64_t task) -> std::pair<int64_t, int64_t> {
      const int64_t units = w.n / w.unit, count = tasks(w);
      return {w.unit * (units * task / count), task + 1 == count ? w.n : w.unit * (units * (task + 1) / count)};
    };
    // task `task` of out = in @ w^T (+ bias), in [B, k]; a bf16 gate / up weight writes
    // silu(gate) * up (out [B, n / 2])
    auto matmul = [&](const bf16* in, int64_t k, const Weight& w, const bf16* bias, bf16* out, int64_t task) {
      const auto [r0, r1] = rows_of(w, task);
      if (w.kind == kInt8)
        parts::int8_linear_rows(in, w.w.data_ptr<int8_t>(), bias, out, B, w.n, k, r0, r1);
      else if (w.kind >= 0)
        parts::gguf_linear_rows(w.kind, w.grouped, in, w.w.data_ptr<uint8_t>(), bias, out, B, w.n, k, r0, r1);
      else
        bf16_matmul(w, in, k, bias, out, B, r0, r1);
    };
    // one (sequence b, KV head g) item: q/k norm, RoPE, K / V into the cache, attention
    auto attend = [&](const Layer& y, int64_t item) {
      const int64_t b = item / kv_heads_, g = item % kv_heads_;
      const bf16* row = qkvd + b * nqkv;
      bf16 qn[16 * 256], kn[256], kr[256];
      const bf16* qsrc = row + g * G * d_;
      const bf16* ksrc = row + q_size + g * d_;
      int64_t qs0 = nqkv, ks0 = nqkv;
      if (y.q_norm.defined()) {  // per head, before the rotation (Qwen3)
        parts::rms_rows_bf16(qsrc, nullptr, y.q_norm.data_ptr<bf16>(), qn, nullptr, G, d_, eps_);
        parts::rms_rows_bf16(ksrc, nullptr, y.k_norm.data_ptr<bf16>(), kn, nullptr, 1, d_, eps_);
        qsrc = qn;
        ksrc = kn;
        qs0 = G * d_;
        ks0 = d_;
      }
      parts::rope_rows_bf16(pos + b, rc, rot, qsrc, qs0, d_, qd + b * q_size + g * G * d_, 1, G, d_);
      parts::rope_rows_bf16(pos + b, rc, rot, ksrc, ks0, d_, kr, 1, 1, d_);
      if (slot[b] >= 0) {
        const int64_t blk = slot[b] / bs, r = slot[b] % bs, off = blk * sb + r * st + g * sh;
        std::memcpy(y.k_cache.data_ptr<bf16>() + off, kr, d_ * sizeof(bf16));
        std::memcpy(y.v_cache.data_ptr<bf16>() + off, row + q_size + kv_size + g * d_, d_ * sizeof(bf16));
      }
      parts::decode_bf16_items(qd, ad, y.k_cache.data_ptr<bf16>(), y.v_cache.data_ptr<bf16>(), bs, sb, st, sh,
                               kv_heads_, G, d_, bt, max_blocks, cl, max_ctx, scale_, item, item + 1);
    };

    // Phases per layer: qkv, attention, o, gate/up, down; with the head, one more: its matmul
    // (each task widens its rows). A matmul's input norm (+ residual) and, for int8 and GGUF
    // weights, the down matmul's SiLU-and-mul are no phases of their own: before its first task
    // of a phase, each thread computes them into its own buffers (the same values, so the same
    // bits), and the thread that took the phase's task 0 also writes the residual stream. So no
    // thread idles through a one-task phase, and a step has 5 waits per layer, not 8.
    constexpr int64_t kPerLayer = 5;
    const int64_t L = static_cast<int64_t>(layers_.size()), P = L * kPerLayer + (with_head ? 1 : 0);
    std::vector<int64_t> counts(P);
    for (int64_t l = 0; l < L; ++l) {
      const Layer& y = layers_[l];
      const int64_t c[kPerLayer] = {tasks(y.qkv), B * kv_heads_, tasks(y.o), tasks(y.gate_up), tasks(y.down)};
      std::copy(c, c + kPerLayer, counts.begin() + l * kPerLayer);
    }
    at::Tensor head_out, logits;  // the head's bf16 outputs, widened into float32 logits
    if (with_head) {
      counts[P - 1] = tasks(head_);
      head_out = at::empty({B, head_.n}, opt);
      logits = at::empty({B, head_.n}, opt.dtype(at::kFloat));
    }
    // thread `tid`'s inputs for phase i (before its first task there; `writer`: it took task 0)
    auto prepare = [&](int64_t i, int64_t tid, bool writer) {
      bf16* h = hown + tid * B * hidden_;
      bf16* r = rown + tid * B * hidden_;
      if (i == L * kPerLayer) {  // the final norm: its residual is not returned
        parts::rms_rows_bf16(xd, r0d, head_norm_.data_ptr<bf16>(), h, r, B, hidden_, eps_);
        return;
      }
      const Layer& y = layers_[i / kPerLayer];
      switch (i % kPerLayer) {
        case 0:
          if (i == 0) {  // the first layer: the residual stream starts as x
            if (writer) std::memcpy(r1d, xd, B * hidden_ * sizeof(bf16));
            parts::rms_rows_bf16(xd, nullptr, y.input_norm.data_ptr<bf16>(), h, nullptr, B, hidden_, eps_);
          } else {
            parts::rms_rows_bf16(xd, r0d, y.input_norm.data_ptr<bf16>(), h, writer ? r1d : r, B, hidden_, eps_);
          }
          break;
        case 3: parts::rms_rows_bf16(xd, r1d, y.post_norm.data_ptr<bf16>(), h, writer ? r0d : r, B, hidden_, eps_); break;
        case 4:
          if (y.gate_up.kind != kPackedBf16) parts::silu_rows_bf16(gud, aown + tid * B * inter_, B, inter_);
          break;
        default: break;
      }
    };
    auto task = [&](int64_t i, int64_t tid, int64_t t) {
      const bf16* h = hown + tid * B * hidden_;
      if (i == L * kPerLayer) {
        bf16* ho = head_out.data_ptr<bf16>();
        float* lo = logits.data_ptr<float>();
        matmul(h, hidden_, head_, nullptr, ho, t);
        const auto [r0, r1] = rows_of(head_, t);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t r = r0; r < r1; ++r) lo[b * head_.n + r] = static_cast<float>(ho[b * head_.n + r]);
        return;
      }
      const Layer& y = layers_[i / kPerLayer];
      switch (i % kPerLayer) {
        case 0: matmul(h, hidden_, y.qkv, y.qkv_bias.defined() ? y.qkv_bias.data_ptr<bf16>() : nullptr, qkvd, t); break;
        case 1: attend(y, t); break;
        case 2: matmul(ad, q_size, y.o, nullptr, xd, t); break;
        case 3: matmul(h, hidden_, y.gate_up, nullptr, y.gate_up.kind == kPackedBf16 ? actd : gud, t); break;
        default:
          matmul(y.gate_up.kind == kPackedBf16 ? actd : aown + tid * B * inter_, inter_, y.down, nullptr, xd, t);
          break;
      }
    };
    Phases ph(P);
    auto walk = [&](int64_t tid) {
      for (int64_t i = 0; i < P; ++i) {
        if (i > 0) wait_for(ph.done[i - 1], counts[i - 1]);
        const int64_t n = counts[i];
        bool prepared = false;
        for (int64_t t = ph.next[i].fetch_add(1, std::memory_order_relaxed); t < n;
             t = ph.next[i].fetch_add(1, std::memory_order_relaxed)) {
          if (!prepared) {  // a thread's first task of a phase is task 0 if it took task 0
            prepare(i, tid, t == 0);
            prepared = true;
          }
          task(i, tid, t);
          ph.done[i].fetch_add(1, std::memory_order_release);
        }
      }
    };
    if (nt <= 1 || at::in_parallel_region()) {
      walk(0);
    } else {
      at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) walk(t);
      });
    }
    if (with_head) return {logits};
    return {x, rs0};
  }

  std::vector<Layer> layers_;
  Weight head_;
  at::Tensor head_norm_;
  int64_t heads_, kv_heads_, d_, hidden_ = 0, inter_ = 0;
  float eps_, scale_;
};

}  // namespace step

void def_decode_step(pybind11::module_& m) {
  namespace py = pybind11;
  using step::DecodeStep;
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<std::optional<at::Tensor>>, std::vector<std::optional<at::Tensor>>,
                    std::vector<std::optional<at::Tensor>>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<std::vector<int64_t>>, int64_t, int64_t, int64_t, double, double>(),
           py::arg("input_norms"), py::arg("post_norms"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("q_norms"),
           py::arg("k_norms"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("k_caches"),
           py::arg("v_caches"), py::arg("kinds"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("scale"))
      .def("set_head", &DecodeStep::set_head, py::arg("norm"), py::arg("weight"), py::arg("kind"))
      .def("run", &DecodeStep::run, py::arg("x"), py::arg("positions"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("context_lens"), py::arg("rope"), py::call_guard<py::gil_scoped_release>())
      .def("run_logits", &DecodeStep::run_logits, py::arg("x"), py::arg("positions"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("context_lens"), py::arg("rope"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_layers", &DecodeStep::num_layers);
}

}  // namespace mops
