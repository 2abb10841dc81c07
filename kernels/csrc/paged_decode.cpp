// Paged decode attention for the CPU: one query token per sequence, K/V read in place from the
// block-paged cache (no gather copy). One task per (sequence, KV head) attends every block of the
// sequence (paged_attention.h: one pass with online softmax for compiled shapes, three otherwise);
// with a window (Gemma 3's sliding-window layers) only the blocks holding its last `window`
// tokens, the rows before the window masked.
// fp32 arithmetic; an fp16 cache's blocks are widened to fp32 as they are read (ops.h: kv_row),
// so the result is bit-identical to an fp32 cache holding the same values, from half the bytes.
//
// q            [B, H, D]            contiguous
// kv_cache     [2, Hkv, S, D]       S = num_blocks * block_size, fp32 or fp16
// block_tables [B, max_blocks]      int64
// context_lens [B]                  int64
// out          [B, H, D]
//
// Tasks run on the extension's worker pool (thread_pool.h), as many threads as torch uses.
#include "ops.h"
#include "paged_attention.h"
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <cstdint>
#include <vector>

at::Tensor paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                           at::Tensor context_lens, int64_t block_size, double scale,
                           int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_dtype_supported(kv_cache),
              "fp32 queries, fp32 or fp16 KV cache");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.is_contiguous(), "contiguous inputs");
  q = ts::paged::heads_contiguous(q);
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  ts::paged::Attn a =
      ts::paged::make_attn(q, kv_cache, block_tables, context_lens, block_size, scale, out);
  a.window = window;
  const auto fn = ts::paged::pick<ts::paged::FromBlock>(a, kv_cache);
  const int64_t B = q.size(0);
  // Tasks cost in proportion to their context, and contexts in a batch differ by several times:
  // one run of sequences per thread of about equal total context.
  std::vector<int64_t> cost(a.lens, a.lens + B);
  for (int64_t& c : cost) c = c - ts::paged::first_attended(a, c) + 1;
  const std::vector<int64_t> cut = balanced_cuts(cost, at::get_num_threads());
  ts::parallel_for(0, static_cast<int64_t>(cut.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = cut[begin] * a.Hkv; task < cut[end] * a.Hkv; ++task) {
      const int64_t b = task / a.Hkv;
      const int64_t first = ts::paged::first_attended(a, a.lens[b]) / a.block_size;
      fn(a, b, task % a.Hkv, {first, (a.lens[b] + a.block_size - 1) / a.block_size - first},
         scores);
    }
  });
  return out;
}
