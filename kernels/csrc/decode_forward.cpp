// The decoder stack of a Llama-family model for a step of decodes only (one token per sequence),
// CPU fp32, in one call, by a team of threads that take every layer together: thread `tid` of `nt`
// computes its share of each GEMM's weight panels for all rows (linear_panels: each thread streams
// 1/nt of the weights), attention for its run of sequences (about equal total context), and the
// element-wise ops for its rows, calling the same kernels as the layer-by-layer path (which run
// inline inside a worker, thread_pool.h); a barrier separates steps that read what another thread
// wrote. Every output is computed by the same code in the same order as layer by layer, so the
// result is bit-identical to it. Sparse layers (decode_forward_sparse) call sparse_paged_decode
// for their rows in place of paged_decode, each member counting into stats of its own.
//
// Why: a layer-by-layer step hands work to the threads ~150 times, with Python between, and each
// hand-off to a sleeping worker costs tens to hundreds of microseconds; here the team is woken
// once and meets at 7 spin barriers a layer (at batch 64, each thread waits ~1.8 ms a step at
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

}  // namespace

at::Tensor decode_forward_sparse(at::Tensor x, at::Tensor residual,
                                    at::Tensor positions, at::Tensor slots,
                                    std::vector<at::Tensor> weights, at::Tensor final_norm,
                                    std::vector<at::Tensor> kv_caches, at::Tensor cos,
                                    at::Tensor sin_signed, at::Tensor block_tables,
                                    at::Tensor context_lens, int64_t block_size, double scale,
                                    double eps, int64_t num_heads, int64_t num_kv_heads,
                                    int64_t team, std::vector<at::Tensor> summaries,
                                    at::Tensor topk, int64_t dense_layers,
                                    c10::optional<at::Tensor> selected,
                                    c10::optional<at::Tensor> stats) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer,
              "weights: 7 tensors per layer");
  const bool sparse = !summaries.empty();
  TORCH_CHECK(!sparse || (static_cast<int64_t>(summaries.size()) == layers &&
                          selected.has_value() && stats.has_value()),
              "sparse layers: one summary per layer, a selected scratch and stats");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && residual.is_contiguous() &&
                  x.sizes() == residual.sizes(),
              "x and residual: contiguous fp32 [B, hidden]");
  const int64_t B = x.size(0), hidden = x.size(1), D = cos.size(1);
  const int64_t qkv_n = (num_heads + 2 * num_kv_heads) * D, q_n = num_heads * D;
  TORCH_CHECK(positions.size(0) == B && slots.size(0) == B && context_lens.size(0) == B &&
                  block_tables.size(0) == B,
              "one position, slot, context and block table per row");
  TORCH_CHECK(positions.is_contiguous() && slots.is_contiguous() && context_lens.is_contiguous() &&
                  block_tables.is_contiguous(),
              "contiguous positions, slots, context lengths and block tables");
  for (const at::Tensor& c : kv_caches)
    TORCH_CHECK(kv_dtype_supported(c) && c.is_contiguous(), "contiguous fp32 or fp16 KV caches");
  team = std::max<int64_t>(1, team);
  const int64_t inter = weights[6].size(1);  // down's panels: [hidden / 16, inter, 16]
  // qkv biases, whole panels long (Linear.pack pads them, so this copies nothing)
  std::vector<at::Tensor> bias(layers);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& b = weights[l * kPerLayer + 2];
    if (b.defined() && b.numel() > 0) bias[l] = panel_bias(b, weights[l * kPerLayer + 1].size(0));
  }
  const auto opts = x.options();
  // x holds each layer's normed input: layer 0's from the caller, later ones the down
  // projection's output normed in place.
  at::Tensor qkv = at::empty({B, qkv_n}, opts), attn = at::empty({B, q_n}, opts);
  at::Tensor o = at::empty({B, hidden}, opts), gate_up = at::empty({B, 2 * inter}, opts);
  at::Tensor act = at::empty({B, inter}, opts);
  std::vector<int64_t> cost(B);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) cost[i] = lens[i] + 1;
  std::vector<int64_t> acut = balanced_cuts(cost, team);
  acut.resize(team + 1, B);
  SpinBarrier barrier(static_cast<int>(team));
  // each member's sparse stats, summed into `stats` once the team is done
  std::vector<at::Tensor> member_stats;
  if (sparse)
    for (int64_t i = 0; i < team; ++i) member_stats.push_back(at::zeros({2}, stats->options()));

  auto member = [&](int64_t tid, int64_t nt) {
    c10::InferenceMode guard;  // worker threads do not inherit the caller's mode
    const int64_t r0 = B * tid / nt, rn = B * (tid + 1) / nt - r0;  // element-wise rows
    const int64_t a0 = nt == 1 ? 0 : acut[tid], an = nt == 1 ? B : acut[tid + 1] - acut[tid];
    auto sync = [&] {
      if (nt > 1) barrier.wait();
    };
    auto gemm = [&](const at::Tensor& in, const at::Tensor& panels, int64_t N,
                    const at::Tensor& b, at::Tensor& out) {
      const int64_t NP = panels.size(0);
      linear_panels(in.data_ptr<float>(), in.size(1), B, in.size(1), panels.data_ptr<float>(), N,
                    b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>(),
                    NP * tid / nt, NP * (tid + 1) / nt);
    };
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* w = weights.data() + l * kPerLayer;
      if (l > 0) {
        if (rn > 0) add_rms_norm_(rows(x, r0, rn), rows(residual, r0, rn), w[0], eps);
        sync();
      }
      gemm(x, w[1], qkv_n, bias[l], qkv);
      sync();
      if (an > 0) {
        at::Tensor mine = rows(qkv, a0, an);
        rope_store_kv_(mine, rows(positions, a0, an), cos, sin_signed, kv_caches[l],
                       rows(slots, a0, an), num_heads, num_kv_heads);
        const at::Tensor q =
            mine.view({an, num_heads + 2 * num_kv_heads, D}).narrow(1, 0, num_heads);
        const at::Tensor out =
            sparse && l >= dense_layers
                ? sparse_paged_decode(q, kv_caches[l], summaries[l], rows(block_tables, a0, an),
                                      rows(context_lens, a0, an), block_size, scale,
                                      rows(topk, a0, an), rows(*selected, a0, an),
                                      member_stats[tid])
                : paged_decode(q, kv_caches[l], rows(block_tables, a0, an),
                               rows(context_lens, a0, an), block_size, scale);
        std::memcpy(attn.data_ptr<float>() + a0 * q_n, out.data_ptr<float>(),
                    an * q_n * sizeof(float));
      }
      sync();
      gemm(attn, w[3], hidden, at::Tensor(), o);
      sync();
      if (rn > 0) add_rms_norm_(rows(o, r0, rn), rows(residual, r0, rn), w[4], eps);
      sync();
      gemm(o, w[5], 2 * inter, at::Tensor(), gate_up);
      sync();
      if (rn > 0) {
        const at::Tensor a = silu_and_mul(rows(gate_up, r0, rn));
        std::memcpy(act.data_ptr<float>() + r0 * inter, a.data_ptr<float>(),
                    rn * inter * sizeof(float));
      }
      sync();
      gemm(act, w[6], hidden, at::Tensor(), x);
      sync();
    }
    if (rn > 0) add_rms_norm_(rows(x, r0, rn), rows(residual, r0, rn), final_norm, eps);
  };

  // The team's chunks run at once on the pool's workers. Where the pool runs the loop inline (a
  // nested call, or another caller's loop running), the one chunk is the whole range: that thread
  // then takes every step alone, without barriers.
  ts::parallel_for(
      0, team, 1,
      [&](int64_t begin, int64_t end) {
        const bool alone = end - begin != 1 || team == 1;
        try {
          member(alone ? 0 : begin, alone ? 1 : team);
        } catch (...) {
          barrier.fail();
          throw;
        }
      },
      static_cast<int>(team));
  for (const at::Tensor& m : member_stats) stats->add_(m);
  return x;
}
