// The decoder stack of a Llama-family model for a step of decodes only (one token per sequence),
// CPU fp32, in one call, by a team of threads that take every layer together: thread `tid` of `nt`
// computes its share of each GEMM's weight panels for all rows (linear_panels: each thread streams
// 1/nt of the weights), attention for its run of sequences (about equal total context), and the
// element-wise ops for its rows, calling the same kernels as the layer-by-layer path (which run
// inline inside a worker, thread_pool.h); a barrier separates steps that read what another thread
// wrote. Every output is computed by the same code in the same order as layer by layer, so the
// result is bit-identical to it. Sparse layers (DecodeStackArgs.summaries, from dense_layers on)
// call sparse_paged_decode for their rows in place of paged_decode, each member counting into
// stats of its own. Quantized linears (DecodeStackArgs.qweights) are split by panels the same way
// and run quant_linear.cpp's panel functions (the fp32 path's order of arithmetic), or, for
// q4i8's layout (q4_int8.cpp: the weights entry a 2-D uint8 tensor, its qweights empty), each
// member rounds the linear's input to int8 (all rows: a few microseconds, and no barrier) and
// takes its share of the 16-row groups.
//
// Stack is one call's set-up (the shared activations, who takes which rows); Member::layer is one
// member's step through a layer (Member::store_kv its RoPE and K/V store, Member::attend its
// attention); decode_forward runs the team. A speculative row's 1 + k positions come as 1 + k
// rows of one sequence (the same block table, context lengths one apart), so every member stores
// its rows' K/V before any member attends.
//
// Why: a layer-by-layer step hands work to the threads ~150 times, with Python between, and each
// hand-off to a sleeping worker costs tens to hundreds of microseconds; here the team is woken
// once and meets at 8 spin barriers a layer (at batch 64, each thread waits ~1.8 ms a step at
// them in all, mostly for the other to finish its share). An earlier form gave each thread its own
// run of sequences through all layers, with no barriers; but then each thread streamed all the
// weights:
// on an Intel Xeon (2 vCPUs, context 256) the team takes 15.8 against 16.6 ms at batch 1, 28.7
// against 33.1 at 12 (one thread), 50.9 against 64.8 at 32, 94.5 against 95.5 at 64 (runs), and
// at 64 with an fp16 cache 78.6 against 83.4.
#include "ops.h"
#include "thread_pool.h"
#include "tile.h"

#include <c10/core/InferenceMode.h>
#include <sched.h>

#include <array>
#include <atomic>
#include <cstring>
#include <stdexcept>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPerLayer = 7;  // in_norm, qkv, qkv_bias, o, post_norm, gate_up, down

// A barrier for the threads of a team that run at once (ts::parallel_for chunks on the pool's
// workers). It spins, yielding the core now and then (a busy box); when a member fails, the others
// stop waiting and throw too, so an error cannot leave a thread waiting forever.
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}

  void wait() {
    const int64_t gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 1; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      if (failed_.load(std::memory_order_relaxed)) throw std::runtime_error("a team member failed");
#if defined(__x86_64__)
      _mm_pause();
#endif
      if (spins % 1024 == 0) sched_yield();
    }
  }

  void fail() { failed_.store(true); }

 private:
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<int64_t> gen_{0};
  std::atomic<bool> failed_{false};
};

inline at::Tensor rows(const at::Tensor& t, int64_t first, int64_t n) {
  return t.narrow(0, first, n);
}

void check_args(const DecodeStackArgs& a) {
  const int64_t layers = static_cast<int64_t>(a.kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(a.weights.size()) == layers * kPerLayer,
              "weights: 7 tensors per layer");
  TORCH_CHECK(a.summaries.empty() ||
                  (static_cast<int64_t>(a.summaries.size()) == layers && a.topk.defined() &&
                   a.selected.has_value() && a.stats.has_value()),
              "sparse layers: one summary per layer, topk, a selected scratch and stats");
  const at::Tensor &x = a.x, &residual = a.residual;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && residual.is_contiguous() &&
                  x.sizes() == residual.sizes(),
              "x and residual: contiguous fp32 [B, hidden]");
  const int64_t B = x.size(0);
  TORCH_CHECK(a.positions.size(0) == B && a.slots.size(0) == B && a.context_lens.size(0) == B &&
                  a.block_tables.size(0) == B,
              "one position, slot, context and block table per row");
  TORCH_CHECK(a.positions.is_contiguous() && a.slots.is_contiguous() &&
                  a.context_lens.is_contiguous() && a.block_tables.is_contiguous(),
              "contiguous positions, slots, context lengths and block tables");
  for (const at::Tensor& c : a.kv_caches)
    TORCH_CHECK(kv_dtype_supported(c) && c.is_contiguous(), "contiguous fp32 or fp16 KV caches");
  TORCH_CHECK(a.qweights.empty() || static_cast<int64_t>(a.qweights.size()) == layers * 8,
              "qweights: none, or d and z for each of a layer's 4 linears");
}

// One of a layer's linears: fp32 panels (pack_linear_weight's), or 4-bit groups (q4_linear's
// uint8 codes in the panels' slot, d and z from qweights), or 8-bit groups (q8_linear's int8
// codes there, d from qweights).
struct StackLinear {
  at::Tensor panels;
  Q4Linear q4{};
  Q8Linear q8{};
  Q4I8Linear dot{};
  bool quant = false, eight = false, int8_dot = false;
  int64_t N = 0;
  const float* bias = nullptr;  // whole panels long, or none
};

// What the team shares for one call: the step's activations (every row; each member writes its
// share), each layer's qkv bias and each member's attention rows.
struct Stack {
  explicit Stack(const DecodeStackArgs& args);

  const DecodeStackArgs& a;
  const int64_t layers, team, B, hidden, D, qkv_n, q_n, inter;
  const bool sparse;
  std::vector<at::Tensor> bias;  // qkv biases, whole panels long (or undefined)
  std::vector<std::array<StackLinear, 4>> lin;  // each layer's qkv, o, gate_up, down
  // x (in DecodeStackArgs) holds each layer's normed input: layer 0's from the caller, later ones
  // the down projection's output normed in place.
  at::Tensor qkv, attn, o, gate_up, act;
  std::vector<int64_t> acut;  // member i attends rows [acut[i], acut[i + 1]): about equal context
  SpinBarrier barrier;
  std::vector<at::Tensor> member_stats;  // each member's sparse stats, summed once it is done
};

Stack::Stack(const DecodeStackArgs& args)
    : a(args),
      layers(static_cast<int64_t>(a.kv_caches.size())),
      team(std::max<int64_t>(1, a.team)),
      B(a.x.size(0)),
      hidden(a.x.size(1)),
      D(a.cos.size(1)),
      qkv_n((a.num_heads + 2 * a.num_kv_heads) * D),
      q_n(a.num_heads * D),
      // down's panels or 8-bit codes: [hidden / 16, inter, 16]; 4-bit codes [hidden / 16,
      // inter / 32, 16, 16]; q4i8 units [hidden / 16, inter / 32 * 320]
      inter(a.weights[6].dim() == 2 ? a.weights[6].size(1) / 320 * 32
                                    : a.weights[6].size(1) * (a.weights[6].dim() == 4 ? 32 : 1)),
      sparse(!a.summaries.empty()),
      bias(layers),
      lin(layers),
      barrier(static_cast<int>(team)) {
  const int64_t outs[4] = {qkv_n, hidden, 2 * inter, hidden};
  const int64_t ins[4] = {hidden, q_n, hidden, inter}, slot[4] = {1, 3, 5, 6};
  for (int64_t l = 0; l < layers; ++l) {
    for (int i = 0; i < 4; ++i) {
      StackLinear& L = lin[l][i];
      L.N = outs[i];
      L.panels = a.weights[l * kPerLayer + slot[i]];
      // 8-bit: int8 codes [NP, K, 16], or uint8 ones with an offset; 4-bit: [NP, K/32, 16, 16]
      L.eight = L.panels.dim() == 3 &&
                (L.panels.scalar_type() == at::kChar || L.panels.scalar_type() == at::kByte);
      L.int8_dot = L.panels.dim() == 2 && L.panels.scalar_type() == at::kByte;
      L.quant = L.eight || L.panels.scalar_type() == at::kByte;
      if (L.int8_dot) {
        L.dot = q4i8_weight(L.panels, L.N);
        TORCH_CHECK(L.dot.K == ins[i], "layer ", l, ": a q4i8 linear takes ", L.dot.K,
                    " inputs, not ", ins[i]);
      } else if (L.quant) {
        TORCH_CHECK(!a.qweights.empty(), "quantized codes without their scales (qweights)");
        const at::Tensor &d = a.qweights[l * 8 + 2 * i], &z = a.qweights[l * 8 + 2 * i + 1];
        if (L.eight) L.q8 = q8_weight(L.panels, d, z, L.N);  // checks the rows (N)
        else L.q4 = q4_weight(L.panels, d, z, L.N);
        const int64_t K = L.eight ? L.q8.K : L.q4.K;
        TORCH_CHECK(K == ins[i], "layer ", l, ": a quantized linear takes ", K, " inputs, not ",
                    ins[i]);
      }
    }
    const at::Tensor& b = a.weights[l * kPerLayer + 2];
    if (b.defined() && b.numel() > 0) {  // Linear.pack pads them, so this copies nothing
      bias[l] = panel_bias(b, (qkv_n + 15) / 16);
      lin[l][0].bias = bias[l].data_ptr<float>();
    }
  }
  const auto opts = a.x.options();
  qkv = at::empty({B, qkv_n}, opts), attn = at::empty({B, q_n}, opts);
  o = at::empty({B, hidden}, opts), gate_up = at::empty({B, 2 * inter}, opts);
  act = at::empty({B, inter}, opts);
  std::vector<int64_t> cost(B);
  const int64_t* lens = a.context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) cost[i] = lens[i] + 1;
  acut = balanced_cuts(cost, team);
  acut.resize(team + 1, B);
  if (sparse)
    for (int64_t i = 0; i < team; ++i) member_stats.push_back(at::zeros({2}, a.stats->options()));
}

// Member `tid` of `nt` (nt is 1 for a thread that runs the whole stack alone): its rows of the
// element-wise ops, its run of sequences for attention, its share of every GEMM's panels.
class Member {
 public:
  Member(Stack& s, int64_t tid, int64_t nt)
      : s_(s), a_(s.a), tid_(tid), nt_(nt),
        r0_(s.B * tid / nt), rn_(s.B * (tid + 1) / nt - r0_),
        a0_(nt == 1 ? 0 : s.acut[tid]), an_(nt == 1 ? s.B : s.acut[tid + 1] - s.acut[tid]) {}

  void run() {
    c10::InferenceMode guard;  // worker threads do not inherit the caller's mode
    for (int64_t l = 0; l < s_.layers; ++l) layer(l);
    if (rn_ > 0) add_rms_norm_(rows(a_.x, r0_, rn_), rows(a_.residual, r0_, rn_), a_.final_norm,
                               a_.eps);
  }

 private:
  void sync() {
    if (nt_ > 1) s_.barrier.wait();
  }

  // This member's panels of out = in . W^T (+ b), for all rows (fp32 panels, or quantized
  // weights decoded as they are used: quant_linear.cpp).
  void gemm(const at::Tensor& in, const StackLinear& L, const at::Tensor& out) {
    const int64_t NP = (L.N + 15) / 16, p0 = NP * tid_ / nt_, p1 = NP * (tid_ + 1) / nt_;
    const float* x = in.data_ptr<float>();
    float* y = out.data_ptr<float>();
    if (L.int8_dot) {
      const int64_t K = in.size(1);
      xq_.resize(s_.B * K), dx_.resize(s_.B * K / 32), sx_.resize(s_.B * K / 32);
      q8_quantize_rows(x, s_.B, K, K, xq_.data(), dx_.data(), sx_.data());
      q4i8_linear_groups(L.dot, xq_.data(), dx_.data(), sx_.data(), s_.B, L.bias, y, L.N, p0, p1);
    } else if (L.eight)
      q8_linear_panels(L.q8, x, in.size(1), L.bias, y, L.N, s_.B, p0, p1);
    else if (L.quant)
      q4_linear_panels(L.q4, x, in.size(1), L.bias, y, L.N, s_.B, p0, p1);
    else
      linear_panels(x, in.size(1), s_.B, in.size(1), L.panels.data_ptr<float>(), L.N, L.bias, y,
                    p0, p1);
  }

  // One layer, steps separated by barriers where they read what another member wrote.
  void layer(int64_t l) {
    const at::Tensor* w = a_.weights.data() + l * kPerLayer;
    const std::array<StackLinear, 4>& lin = s_.lin[l];
    if (l > 0) {
      if (rn_ > 0) add_rms_norm_(rows(a_.x, r0_, rn_), rows(a_.residual, r0_, rn_), w[0], a_.eps);
      sync();
    }
    gemm(a_.x, lin[0], s_.qkv);
    sync();
    if (an_ > 0) store_kv(l);
    sync();  // a verified row's positions may be split between members: all K/V stored first
    if (an_ > 0) attend(l);
    sync();
    gemm(s_.attn, lin[1], s_.o);
    sync();
    if (rn_ > 0) add_rms_norm_(rows(s_.o, r0_, rn_), rows(a_.residual, r0_, rn_), w[4], a_.eps);
    sync();
    gemm(s_.o, lin[2], s_.gate_up);
    sync();
    if (rn_ > 0) {
      const at::Tensor act = silu_and_mul(rows(s_.gate_up, r0_, rn_));
      std::memcpy(s_.act.data_ptr<float>() + r0_ * s_.inter, act.data_ptr<float>(),
                  rn_ * s_.inter * sizeof(float));
    }
    sync();
    gemm(s_.act, lin[3], a_.x);
    sync();
  }

  // RoPE and the K/V store for this member's rows.
  void store_kv(int64_t l) {
    rope_store_kv_(rows(s_.qkv, a0_, an_), rows(a_.positions, a0_, an_), a_.cos, a_.sin_signed,
                   a_.kv_caches[l], rows(a_.slots, a0_, an_), a_.num_heads, a_.num_kv_heads);
  }

  // Attention for this member's rows (their queries rotated by store_kv), into their rows of attn.
  void attend(int64_t l) {
    const int64_t a0 = a0_, an = an_, H = a_.num_heads;
    const at::Tensor mine = rows(s_.qkv, a0, an);
    const at::Tensor q = mine.view({an, H + 2 * a_.num_kv_heads, s_.D}).narrow(1, 0, H);
    const at::Tensor tables = rows(a_.block_tables, a0, an), lens = rows(a_.context_lens, a0, an);
    const at::Tensor out =
        s_.sparse && l >= a_.dense_layers
            ? sparse_paged_decode(q, a_.kv_caches[l], a_.summaries[l], tables, lens,
                                  a_.block_size, a_.scale, rows(a_.topk, a0, an),
                                  rows(*a_.selected, a0, an), s_.member_stats[tid_])
            : paged_decode(q, a_.kv_caches[l], tables, lens, a_.block_size, a_.scale);
    std::memcpy(s_.attn.data_ptr<float>() + a0 * s_.q_n, out.data_ptr<float>(),
                an * s_.q_n * sizeof(float));
  }

  Stack& s_;
  const DecodeStackArgs& a_;
  const int64_t tid_, nt_, r0_, rn_, a0_, an_;
  std::vector<int8_t> xq_;  // this member's copy of a q4i8 linear's input, rounded to int8
  std::vector<float> dx_, sx_;
};

}  // namespace

at::Tensor decode_forward(const DecodeStackArgs& args) {
  check_args(args);
  Stack stack(args);
  const int64_t team = stack.team;
  // The team's chunks run at once on the pool's workers. Where the pool runs the loop inline (a
  // nested call, or another caller's loop running), the one chunk is the whole range: that thread
  // then takes every step alone, without barriers.
  ts::parallel_for(
      0, team, 1,
      [&](int64_t begin, int64_t end) {
        const bool alone = end - begin != 1 || team == 1;
        try {
          Member(stack, alone ? 0 : begin, alone ? 1 : team).run();
        } catch (...) {
          stack.barrier.fail();
          throw;
        }
      },
      static_cast<int>(team));
  for (const at::Tensor& m : stack.member_stats) args.stats->add_(m);
  return args.x;
}
