// Sparse (Quest-style top-k block) paged decode attention for the CPU, and the per-block key
// summaries it selects by. kernels/sparse.py has the same algorithm in plain torch (the oracle).
//
// Each KV block keeps, per KV head, the element-wise min and max of its keys. For a decode query,
// sum_i max(q_i min_i, q_i max_i) bounds q.k from above for every key of the block; per
// (sequence, KV head) the topk - 2 blocks with the highest bound summed over the head's GQA group
// are attended, plus the first block (attention sinks) and the newest (the local window), and no
// other. Selection and attention run in one task per (sequence, KV head), so a layer is one call.
//
// topk         [B] int64              each sequence's budget in blocks: >= 2, or 0 for dense
// summary      [2, Hkv, NB, D] fp32   [0] min, [1] max of each block's keys (fp16 widened)
// selected     [B, Hkv, W] int32      logical block indices (0..n-1) attended, ascending (W >=
//                                     every topk); entries past min(n, topk) are -1, as block
//                                     table padding; a dense sequence's row is all -1
// stats        [2] float64            += blocks attended by sequences with a topk, summed over
//                                     their KV heads; += nanoseconds of selection over threads
//
// Where a head's n = ceil(context / block) blocks fit in topk (or topk is 0), all are attended in
// order by the same code as paged_decode.cpp (paged_attention.h, over a list of blocks), so the
// result is bit-identical to dense decode.
#include "ops.h"
#include "paged_attention.h"
#include "thread_pool.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

using ts::paged::prefetch_block;

// ---- one layer's inputs ----------------------------------------------------------------------

// The attention inputs (paged_attention.h) and the selection's.
struct Layer : ts::paged::Attn {
  const float *smin, *smax;     // [Hkv, NB, D] each
  const int64_t* topk;
  int32_t* sel;                 // selected[b, h, :sel_w] at sel + b * sel_b + h * sel_h
  int64_t NB, sel_b, sel_h, sel_w;
};

// Per-thread scratch, reused across tasks.
struct Scratch {
  std::vector<float> pos, neg, score, attn;
  std::vector<int32_t> order, list;
};

inline int64_t num_blocks(const Layer& a, int64_t b) {
  return (a.lens[b] + a.block_size - 1) / a.block_size;
}

// ---- selection -------------------------------------------------------------------------------

constexpr int64_t kSummaryAhead = 8;  // blocks whose summary rows are prefetched ahead

// Quest bounds of blocks 1..n-2 into s.score[j]. Summed over the group, max(q min, q max) is
// P.max + N.min with P = sum_g max(q_g, 0), N = sum_g min(q_g, 0) (q_g > 0 takes max, q_g < 0
// min): two FMAs per dimension per block, whatever the group size. Unscaled q: the softmax scale
// (> 0) does not change the order.
void score_blocks(const Layer& a, int64_t b, int64_t h, int64_t n, Scratch& s) {
  const int64_t D = a.D, G = a.G;
  const float* qg = a.q + b * a.q_row + h * G * D;
  s.pos.assign(D, 0.f);
  s.neg.assign(D, 0.f);
  float* P = s.pos.data();
  float* N = s.neg.data();
  for (int64_t g = 0; g < G; ++g)
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
      const float x = qg[g * D + d];
      P[d] += x > 0.f ? x : 0.f;
      N[d] += x < 0.f ? x : 0.f;
    }
  s.score.resize(n);
  const int64_t* table = a.tables + b * a.max_blocks;
  const float* mn_h = a.smin + h * a.NB * D;
  const float* mx_h = a.smax + h * a.NB * D;
  for (int64_t j = 1; j < n - 1; ++j) {
    // Blocks are scattered: each summary row is a miss of its own unless asked for ahead.
    if (j + kSummaryAhead < n - 1) {
      prefetch_block(mn_h + table[j + kSummaryAhead] * D, D * sizeof(float));
      prefetch_block(mx_h + table[j + kSummaryAhead] * D, D * sizeof(float));
    }
    const float* mn = mn_h + table[j] * D;
    const float* mx = mx_h + table[j] * D;
    float sc = 0.f;
#pragma omp simd reduction(+ : sc)
    for (int64_t d = 0; d < D; ++d) sc += P[d] * mx[d] + N[d] * mn[d];
    s.score[j] = sc == sc ? sc : -INFINITY;  // NaN (a NaN query) would break the ordering
  }
}

// The logical blocks this (sequence, KV head) attends, ascending, into sel (room for n); returns
// how many.
int64_t select_blocks(const Layer& a, int64_t b, int64_t h, Scratch& s, int32_t* sel) {
  const int64_t n = num_blocks(a, b), k = a.topk[b];
  if (k == 0 || n <= k) {
    std::iota(sel, sel + n, 0);
    return n;
  }
  score_blocks(a, b, h, n, s);
  s.order.resize(n - 2);
  std::iota(s.order.begin(), s.order.end(), 1);
  const float* sc = s.score.data();
  auto better = [sc](int32_t x, int32_t y) { return sc[x] > sc[y] || (sc[x] == sc[y] && x < y); };
  std::nth_element(s.order.begin(), s.order.begin() + (k - 2), s.order.end(), better);
  sel[0] = 0;
  std::copy(s.order.begin(), s.order.begin() + (k - 2), sel + 1);
  std::sort(sel + 1, sel + k - 1);
  sel[k - 1] = static_cast<int32_t>(n - 1);
  return k;
}

Layer make_layer(const at::Tensor& q, const at::Tensor& kv_cache,
                 const at::Tensor& summary, const at::Tensor& block_tables,
                 const at::Tensor& context_lens, int64_t block_size, double scale,
                 const at::Tensor& topk, const at::Tensor& selected,
                 const at::Tensor& out) {
  Layer a;
  static_cast<ts::paged::Attn&>(a) =
      ts::paged::make_attn(q, kv_cache, block_tables, context_lens, block_size, scale, out);
  a.NB = summary.size(2);
  a.smin = summary.data_ptr<float>();
  a.smax = a.smin + a.Hkv * a.NB * a.D;
  a.topk = topk.data_ptr<int64_t>();
  a.sel = selected.data_ptr<int32_t>();
  a.sel_b = selected.stride(0);
  a.sel_h = selected.stride(1);
  a.sel_w = selected.size(2);
  return a;
}

void check_inputs(const at::Tensor& q, const at::Tensor& kv_cache,
                  const at::Tensor& summary, const at::Tensor& block_tables,
                  const at::Tensor& context_lens, const at::Tensor& topk,
                  const at::Tensor& selected, const at::Tensor& stats, int64_t block_size) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, "q: fp32 [B, H, D]");
  TORCH_CHECK(kv_dtype_supported(kv_cache) && kv_cache.is_contiguous(),
              "kv_cache: contiguous fp32 or fp16 [2, Hkv, slots, D]");
  const int64_t B = q.size(0), Hkv = kv_cache.size(1), D = q.size(2);
  TORCH_CHECK(q.size(1) % Hkv == 0 && kv_cache.size(3) == D, "q heads a multiple of Hkv, same D");
  TORCH_CHECK(summary.scalar_type() == at::kFloat && summary.is_contiguous() &&
                  summary.dim() == 4 && summary.size(0) == 2 && summary.size(1) == Hkv &&
                  summary.size(2) * block_size == kv_cache.size(2) && summary.size(3) == D,
              "summary: contiguous fp32 [2, Hkv, slots / block_size, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.size(0) == B && context_lens.scalar_type() == at::kLong &&
                  context_lens.is_contiguous() && context_lens.size(0) == B,
              "block_tables [B, W] and context_lens [B]: contiguous int64");
  TORCH_CHECK(topk.scalar_type() == at::kLong && topk.is_contiguous() && topk.numel() == B,
              "topk: contiguous int64 [B]");
  TORCH_CHECK(selected.scalar_type() == at::kInt && selected.dim() == 3 &&
                  selected.size(0) == B && selected.size(1) == Hkv && selected.stride(2) == 1,
              "selected: int32 [B, Hkv, W], rows contiguous");
  const int64_t* k = topk.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(k[b] == 0 || (k[b] >= 2 && k[b] <= selected.size(2)), "topk[", b, "] = ", k[b],
                ": 0 (dense) or 2..", selected.size(2), " (the first and newest blocks are "
                "always attended; selected holds ", selected.size(2), ")");
  TORCH_CHECK(stats.scalar_type() == at::kDouble && stats.is_contiguous() && stats.numel() == 2,
              "stats: float64 [2]");
}

}  // namespace

at::Tensor sparse_paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor summary,
                                  at::Tensor block_tables, at::Tensor context_lens,
                                  int64_t block_size, double scale, at::Tensor topk,
                                  at::Tensor selected, at::Tensor stats) {
  check_inputs(q, kv_cache, summary, block_tables, context_lens, topk, selected, stats, block_size);
  q = ts::paged::heads_contiguous(q);
  const int64_t B = q.size(0);
  auto out = at::empty({B, q.size(1) * q.size(2)}, q.options());
  const Layer a = make_layer(q, kv_cache, summary, block_tables, context_lens, block_size, scale,
                             topk, selected, out);
  const auto fn = ts::paged::pick<ts::paged::Blocks>(a, kv_cache);
  // One item per (sequence, KV head), b-major; cost ~ tokens attended plus the summaries scored
  // (a summary is 2 rows against a block's 2 * block_size).
  std::vector<int64_t> cost(B * a.Hkv);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = num_blocks(a, b), k = a.topk[b] == 0 ? n : std::min(n, a.topk[b]);
    const int64_t c = k * block_size + (k < n ? 2 * n : 0) + 1;
    std::fill(cost.begin() + b * a.Hkv, cost.begin() + (b + 1) * a.Hkv, c);
  }
  const std::vector<int64_t> cut = balanced_cuts(cost, at::get_num_threads());
  const int64_t parts = static_cast<int64_t>(cut.size()) - 1;
  std::vector<double> blocks(parts, 0.0), nanos(parts, 0.0);
  ts::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    using Clock = std::chrono::steady_clock;
    Scratch scratch;
    for (int64_t part = begin; part < end; ++part)
      for (int64_t item = cut[part]; item < cut[part + 1]; ++item) {
        const int64_t b = item / a.Hkv, h = item % a.Hkv;
        const bool dense = a.topk[b] == 0;
        scratch.list.resize(num_blocks(a, b));
        int32_t* list = scratch.list.data();
        const auto t0 = Clock::now();
        const int64_t count = select_blocks(a, b, h, scratch, list);
        if (!dense) {
          nanos[part] += std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
          blocks[part] += static_cast<double>(count);
        }
        int32_t* sel = a.sel + b * a.sel_b + h * a.sel_h;
        const int64_t kept = dense ? 0 : count;
        std::copy(list, list + kept, sel);
        std::fill(sel + kept, sel + a.sel_w, -1);
        fn(a, b, h, {list, count}, scratch.attn);
      }
  });
  double* st = stats.data_ptr<double>();
  for (int64_t p = 0; p < parts; ++p) st[0] += blocks[p], st[1] += nanos[p];
  return out;
}

// ---- summaries -------------------------------------------------------------------------------

namespace {

// One (layer, KV head): the written keys in slot order, each resetting (offset 0) or widening its
// block's [min, max].
template <typename T>
void update_head(const T* k, float* mn_h, float* mx_h, const int64_t* slots, int64_t n,
                 int64_t bs, int64_t D, float* buf) {
  for (int64_t t = 0; t < n; ++t) {
    const float* key = kv_row(k + slots[t] * D, buf, D);
    float* mn = mn_h + (slots[t] / bs) * D;
    float* mx = mx_h + (slots[t] / bs) * D;
    if (slots[t] % bs == 0) {
      std::copy(key, key + D, mn);
      std::copy(key, key + D, mx);
      continue;
    }
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
      mn[d] = key[d] < mn[d] ? key[d] : mn[d];
      mx[d] = key[d] > mx[d] ? key[d] : mx[d];
    }
  }
}

}  // namespace

void kv_summary_update_(std::vector<at::Tensor> kv_caches, std::vector<at::Tensor> summaries,
                        at::Tensor slot_mapping, int64_t block_size) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(summaries.size()) == L, "one summary per KV cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1,
              "slot_mapping: int64 [T]");
  if (L == 0 || slot_mapping.numel() == 0) return;
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t T = slots.numel(), Hkv = kv_caches[0].size(1), S = kv_caches[0].size(2);
  const int64_t D = kv_caches[0].size(3);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor &c = kv_caches[l], &s = summaries[l];
    TORCH_CHECK(kv_dtype_supported(c) && c.is_contiguous() && c.sizes() == kv_caches[0].sizes(),
                "kv_caches: contiguous fp32 or fp16 [2, Hkv, slots, D], all one shape");
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 4 &&
                    s.size(0) == 2 && s.size(1) == Hkv && s.size(2) * block_size == S &&
                    s.size(3) == D,
                "summaries: contiguous fp32 [2, Hkv, slots / block_size, D]");
  }
  const int64_t* sl = slots.data_ptr<int64_t>();
  const auto [lo, hi] = std::minmax_element(sl, sl + T);
  TORCH_CHECK(*lo >= 0 && *hi < S, "slot_mapping: slots in [0, ", S, ")");
  const int64_t NB = S / block_size;
  // Items are (layer, head); a decode step's few tokens stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, 32768 / (T * D));
  ts::parallel_for(0, L * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t l = item / Hkv, h = item % Hkv;
      float* mn = summaries[l].data_ptr<float>() + h * NB * D;
      float* mx = mn + Hkv * NB * D;
      if (kv_caches[l].scalar_type() == at::kHalf)
        update_head(kv_caches[l].data_ptr<at::Half>() + h * S * D, mn, mx, sl, T, block_size, D,
                    buf.data());
      else
        update_head(kv_caches[l].data_ptr<float>() + h * S * D, mn, mx, sl, T, block_size, D,
                    buf.data());
    }
  });
}
