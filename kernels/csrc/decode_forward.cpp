// The decoder stack of a Llama-family model for a step of decodes only (one token per sequence),
// CPU fp32, in one call: the batch is cut into one run of sequences per thread, and each thread
// takes its run through every layer on its own (data parallel), calling the same kernels as the
// layer-by-layer path (packed_linear, rope_store_kv_, paged_decode, add_rms_norm_, silu_and_mul),
// which run inline inside a worker (thread_pool.h). Every kernel computes a row independently of
// the other rows, so the result is bit-identical to the layer-by-layer path.
//
// Why: the ~150 thread hand-offs and Python calls of a layer-by-layer step are gone. (The runs
// start together and cost about the same, so in practice both threads are in attention, and in
// the GEMMs, at the same moments, as layer by layer: measured on an Intel Xeon, holding them to
// the same projection with barriers changed nothing.) The cost: each thread streams all the
// weights, which a few rows per thread cannot repay, so the caller picks the batch sizes and
// the number of runs (llama.py: a batch under 16 runs as one).
#include "ops.h"
#include "thread_pool.h"

#include <c10/core/InferenceMode.h>
#include <cstring>

namespace {

constexpr int64_t kPerLayer = 7;  // in_norm, qkv, qkv_bias, o, post_norm, gate_up, down

}  // namespace

torch::Tensor decode_forward(torch::Tensor x, torch::Tensor residual, torch::Tensor positions,
                             torch::Tensor slots, std::vector<torch::Tensor> weights,
                             torch::Tensor final_norm, std::vector<torch::Tensor> kv_caches,
                             torch::Tensor cos, torch::Tensor sin_signed,
                             torch::Tensor block_tables, torch::Tensor context_lens,
                             int64_t block_size, double scale, double eps, int64_t num_heads,
                             int64_t num_kv_heads, int64_t row_cost, int64_t parts) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer,
              "weights: 7 tensors per layer");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && residual.is_contiguous() &&
                  x.sizes() == residual.sizes(),
              "x and residual: contiguous fp32 [B, hidden]");
  const int64_t B = x.size(0), hidden = x.size(1);
  const int64_t D = cos.size(1), qkv_n = (num_heads + 2 * num_kv_heads) * D;
  TORCH_CHECK(positions.size(0) == B && slots.size(0) == B && context_lens.size(0) == B &&
                  block_tables.size(0) == B,
              "one position, slot, context and block table per row");
  // Runs of sequences of about equal cost: a row's GEMMs weigh row_cost context tokens.
  std::vector<int64_t> cost(B);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) cost[i] = lens[i] + row_cost;
  const std::vector<int64_t> cut = balanced_cuts(cost, std::max<int64_t>(1, parts));
  const int64_t runs = static_cast<int64_t>(cut.size()) - 1;

  ts::parallel_for(0, runs, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard;  // worker threads do not inherit the caller's mode
    for (int64_t r = begin; r < end; ++r) {
      const int64_t r0 = cut[r], n = cut[r + 1] - cut[r];
      if (n == 0) continue;
      torch::Tensor h = x.narrow(0, r0, n);
      torch::Tensor res = residual.narrow(0, r0, n);
      const torch::Tensor pos = positions.narrow(0, r0, n), slot = slots.narrow(0, r0, n);
      const torch::Tensor tables = block_tables.narrow(0, r0, n);
      const torch::Tensor ctx = context_lens.narrow(0, r0, n);
      for (int64_t l = 0; l < layers; ++l) {
        const torch::Tensor* w = weights.data() + l * kPerLayer;
        if (l > 0) add_rms_norm_(h, res, w[0], eps);  // layer 0's norm: the caller's
        const c10::optional<torch::Tensor> bias =
            w[2].defined() && w[2].numel() > 0 ? c10::optional<torch::Tensor>(w[2]) : c10::nullopt;
        torch::Tensor qkv = packed_linear(h, w[1], qkv_n, bias);
        rope_store_kv_(qkv, pos, cos, sin_signed, kv_caches[l], slot, num_heads, num_kv_heads);
        const torch::Tensor q = qkv.view({n, num_heads + 2 * num_kv_heads, D}).narrow(1, 0, num_heads);
        const torch::Tensor attn = paged_decode(q, kv_caches[l], tables, ctx, block_size, scale);
        h = packed_linear(attn.view({n, num_heads * D}), w[3], hidden, c10::nullopt);
        add_rms_norm_(h, res, w[4], eps);
        const torch::Tensor act = silu_and_mul(packed_linear(h, w[5], 2 * w[6].size(1), c10::nullopt));
        h = packed_linear(act, w[6], hidden, c10::nullopt);
      }
      add_rms_norm_(h, res, final_norm, eps);
      std::memcpy(x.data_ptr<float>() + r0 * hidden, h.data_ptr<float>(), n * hidden * sizeof(float));
    }
  });
  return x;
}
