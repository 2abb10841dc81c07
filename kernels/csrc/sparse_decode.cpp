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
// order by the same arithmetic as paged_decode.cpp (its tasks, generalized to a list of blocks),
// so the result is bit-identical to dense decode.
#include "ops.h"
#include "thread_pool.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TS_AVX2 1
#endif

namespace {

// ---- helpers shared with paged_decode.cpp's tasks (same code: same rounding) ----------------

#ifdef TS_AVX2
inline __m256 hsum8(const __m256* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

template <int G, int D>
inline void scores8(const float (&q)[G][D], const float* k, float* s, int64_t n) {
  for (int g = 0; g < G; ++g) {
    __m256 part[8];
    for (int i = 0; i < 8; ++i) {
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q[g]), _mm256_loadu_ps(k + i * D));
      for (int d = 8; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), _mm256_loadu_ps(k + i * D + d), acc);
      part[i] = acc;
    }
    _mm256_storeu_ps(s + g * n, hsum8(part));
  }
}
#endif

inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 1);
}

inline float softmax_inplace(float* s, int64_t n) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t t = 0; t < n; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = fast_exp(s[t] - m);
    sum += s[t];
  }
  return 1.f / sum;
}

// ---- one layer's inputs ----------------------------------------------------------------------

struct Layer {
  const float* q;
  const void *k, *v;            // fp32 or at::Half, as the task's T
  const float *smin, *smax;     // [Hkv, NB, D] each
  const int64_t *tables, *lens, *topk;
  int32_t* sel;                 // selected[b, h, :sel_w] at sel + b * sel_b + h * sel_h
  float* out;
  int64_t H, Hkv, S, NB, D, G, max_blocks, block_size, q_row, sel_b, sel_h, sel_w;
  float scale;
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

// ---- attention over a list of blocks ---------------------------------------------------------

constexpr int64_t kAhead = 2;  // blocks prefetched ahead, as paged_decode.cpp

template <typename T>
inline void prefetch_kv(const Layer& a, const T* kh, const T* vh, int64_t block, int64_t D) {
  const int64_t off = block * a.block_size * D;
  prefetch_block(kh + off, a.block_size * D * sizeof(T));
  prefetch_block(vh + off, a.block_size * D * sizeof(T));
}

// paged_decode.cpp's task_fixed over the logical blocks sel[0..count) instead of 0..n-1: one
// pass, online softmax, blocks kAhead on prefetched. With sel = 0..n-1 it is the same arithmetic.
template <typename T, int G, int D, int BS>
void attend_fixed(const Layer& a, int64_t b, int64_t h, const int32_t* sel, int64_t count,
                  Scratch&) {
  constexpr bool kWiden = !std::is_same_v<T, float>;
  const int64_t n = a.lens[b];
  const int64_t* table = a.tables + b * a.max_blocks;
  const T* kh = static_cast<const T*>(a.k) + h * a.S * D;
  const T* vh = static_cast<const T*>(a.v) + h * a.S * D;
  alignas(64) float kbuf[kWiden ? BS * D : 1], vbuf[kWiden ? BS * D : 1];
  float q[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) q[g][d] = a.q[b * a.q_row + (h * G + g) * D + d] * a.scale;
  for (int64_t j = 0; j < kAhead && j < count; ++j) prefetch_kv(a, kh, vh, table[sel[j]], D);
  alignas(64) float s[G][BS];
  float mx[G], sum[G];
  float acc[G][D] = {};
  for (int g = 0; g < G; ++g) mx[g] = -INFINITY, sum[g] = 0.f;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t blk = table[sel[j]];
    const T* kn = j + kAhead < count ? kh + table[sel[j + kAhead]] * BS * D : nullptr;
    const T* vn = j + kAhead < count ? vh + table[sel[j + kAhead]] * BS * D : nullptr;
    const int64_t m = std::min<int64_t>(BS, n - sel[j] * BS);
    const float* kb = kv_row(kh + blk * BS * D, kbuf, m * D);
    const float* vb = kv_row(vh + blk * BS * D, vbuf, m * D);
    int64_t i = 0;
#ifdef TS_AVX2
    if constexpr (D % 8 == 0)
      for (; i + 8 <= m; i += 8) scores8<G, D>(q, kb + i * D, &s[0][i], BS);
#endif
    for (; i < m; ++i) {
      const float* krow = kb + i * D;
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += q[g][d] * krow[d];
        s[g][i] = dot;
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int64_t t = m; t < BS; ++t) s[g][t] = -INFINITY;
      float bm = mx[g];
#pragma omp simd reduction(max : bm)
      for (int t = 0; t < BS; ++t) bm = s[g][t] > bm ? s[g][t] : bm;
      if (bm > mx[g]) {
        const float c = fast_exp(mx[g] - bm);
        sum[g] *= c;
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] *= c;
        mx[g] = bm;
      }
#pragma omp simd
      for (int t = 0; t < BS; ++t) s[g][t] = fast_exp(s[g][t] - bm);
      for (int64_t t = m; t < BS; ++t) s[g][t] = 0.f;
      float bsum = 0.f;
#pragma omp simd reduction(+ : bsum)
      for (int t = 0; t < BS; ++t) bsum += s[g][t];
      sum[g] += bsum;
    }
    for (int64_t t = 0; t < m; ++t) {
      const float* vrow = vb + t * D;
      if (kn != nullptr)
        for (int d = 0; d < D; d += 64 / static_cast<int>(sizeof(T))) {
          __builtin_prefetch(kn + t * D + d, 0, 1);
          __builtin_prefetch(vn + t * D + d, 0, 1);
        }
      for (int g = 0; g < G; ++g) {
        const float w = s[g][t];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += w * vrow[d];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    float* o = a.out + (b * a.H + h * G + g) * D;
    const float inv = 1.f / sum[g];
    for (int d = 0; d < D; ++d) o[d] = acc[g][d] * inv;
  }
}

// paged_decode.cpp's task_generic (any group size and head dim: scores, softmax, weighted sum of
// V rows) over the tokens of the blocks sel[0..count), in order.
template <typename T>
void attend_generic(const Layer& a, int64_t b, int64_t h, const int32_t* sel, int64_t count,
                    Scratch& scratch) {
  const int64_t n = a.lens[b], bs = a.block_size, G = a.G, D = a.D;
  const int64_t* table = a.tables + b * a.max_blocks;
  const float* qg = a.q + b * a.q_row + h * G * D;
  float* og = a.out + (b * a.H + h * G) * D;
  const T* kc = static_cast<const T*>(a.k) + h * a.S * D;
  const T* vc = static_cast<const T*>(a.v) + h * a.S * D;
  int64_t ntok = 0;
  for (int64_t j = 0; j < count; ++j) ntok += std::min<int64_t>(bs, n - sel[j] * bs);
  scratch.attn.resize(G * ntok + D);
  float* s = scratch.attn.data();
  float* row = s + G * ntok;
  // the cache row of the t-th attended token, visiting them in order
  auto each_row = [&](auto&& fn) {
    for (int64_t j = 0, t = 0; j < count; ++j) {
      const int64_t m = std::min<int64_t>(bs, n - sel[j] * bs);
      for (int64_t o = 0; o < m; ++o, ++t) fn(t, (table[sel[j]] * bs + o) * D);
    }
  };
  each_row([&](int64_t t, int64_t off) {
    const float* krow = kv_row(kc + off, row, D);
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qg[g * D + d] * krow[d];
      s[g * ntok + t] = acc * a.scale;
    }
  });
  std::vector<float> inv(G);
  for (int64_t g = 0; g < G; ++g) inv[g] = softmax_inplace(s + g * ntok, ntok);
  std::fill(og, og + G * D, 0.f);
  each_row([&](int64_t t, int64_t off) {
    const float* vrow = kv_row(vc + off, row, D);
    for (int64_t g = 0; g < G; ++g) {
      const float w = s[g * ntok + t] * inv[g];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[g * D + d] += w * vrow[d];
    }
  });
}

using AttendFn = void (*)(const Layer&, int64_t, int64_t, const int32_t*, int64_t, Scratch&);

template <typename T>
AttendFn pick(int64_t G, int64_t D, int64_t block_size) {
#define TS_CASE(g, d, bs) \
  if (G == g && D == d && block_size == bs) return attend_fixed<T, g, d, bs>;
#define TS_CASES(bs)                                                                          \
  TS_CASE(1, 64, bs) TS_CASE(2, 64, bs) TS_CASE(3, 64, bs) TS_CASE(4, 64, bs) TS_CASE(8, 64, bs) \
  TS_CASE(1, 128, bs) TS_CASE(2, 128, bs) TS_CASE(4, 128, bs) TS_CASE(8, 128, bs)
  TS_CASES(16) TS_CASES(32)
#undef TS_CASES
#undef TS_CASE
  return attend_generic<T>;
}

Layer make_layer(const torch::Tensor& q, const torch::Tensor& kv_cache,
                 const torch::Tensor& summary, const torch::Tensor& block_tables,
                 const torch::Tensor& context_lens, int64_t block_size, double scale,
                 const torch::Tensor& topk, const torch::Tensor& selected,
                 const torch::Tensor& out) {
  Layer a;
  a.H = q.size(1);
  a.D = q.size(2);
  a.Hkv = kv_cache.size(1);
  a.S = kv_cache.size(2);
  a.NB = summary.size(2);
  a.G = a.H / a.Hkv;
  a.max_blocks = block_tables.size(1);
  a.block_size = block_size;
  a.scale = static_cast<float>(scale);
  a.q = q.data_ptr<float>();
  a.q_row = q.stride(0);
  a.k = kv_cache.data_ptr();
  a.v = static_cast<const char*>(a.k) + a.Hkv * a.S * a.D * kv_cache.element_size();
  a.smin = summary.data_ptr<float>();
  a.smax = a.smin + a.Hkv * a.NB * a.D;
  a.tables = block_tables.data_ptr<int64_t>();
  a.lens = context_lens.data_ptr<int64_t>();
  a.topk = topk.data_ptr<int64_t>();
  a.sel = selected.data_ptr<int32_t>();
  a.sel_b = selected.stride(0);
  a.sel_h = selected.stride(1);
  a.sel_w = selected.size(2);
  a.out = out.data_ptr<float>();
  return a;
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& kv_cache,
                  const torch::Tensor& summary, const torch::Tensor& block_tables,
                  const torch::Tensor& context_lens, const torch::Tensor& topk,
                  const torch::Tensor& selected, const torch::Tensor& stats, int64_t block_size) {
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

torch::Tensor sparse_paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor summary,
                                  torch::Tensor block_tables, torch::Tensor context_lens,
                                  int64_t block_size, double scale, torch::Tensor topk,
                                  torch::Tensor selected, torch::Tensor stats) {
  check_inputs(q, kv_cache, summary, block_tables, context_lens, topk, selected, stats, block_size);
  // q may be a view into the fused qkv rows: heads and dims contiguous, rows strided.
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  const int64_t B = q.size(0);
  auto out = torch::empty({B, q.size(1) * q.size(2)}, q.options());
  const Layer a = make_layer(q, kv_cache, summary, block_tables, context_lens, block_size, scale,
                             topk, selected, out);
  const AttendFn fn = kv_cache.scalar_type() == at::kHalf ? pick<at::Half>(a.G, a.D, block_size)
                                                          : pick<float>(a.G, a.D, block_size);
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
        fn(a, b, h, list, count, scratch);
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

void kv_summary_update_(std::vector<torch::Tensor> kv_caches, std::vector<torch::Tensor> summaries,
                        torch::Tensor slot_mapping, int64_t block_size) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(summaries.size()) == L, "one summary per KV cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1,
              "slot_mapping: int64 [T]");
  if (L == 0 || slot_mapping.numel() == 0) return;
  const torch::Tensor slots = slot_mapping.contiguous();
  const int64_t T = slots.numel(), Hkv = kv_caches[0].size(1), S = kv_caches[0].size(2);
  const int64_t D = kv_caches[0].size(3);
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor &c = kv_caches[l], &s = summaries[l];
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
