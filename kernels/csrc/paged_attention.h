// Decode attention over the block-paged cache for one (sequence, KV head), shared by
// paged_decode.cpp (every block of the sequence) and sparse_decode.cpp (the blocks it selected):
// the same code for both, so dense decode and sparse decode with every block selected round
// identically. One task serves the head's whole GQA group, so every K/V row is read once.
// Compiled shapes (G, D, block size) take one pass with online softmax (attend_fixed); any other
// shape takes three passes: scores (reads K), softmax, then the weighted sum of V rows
// (attend_generic). fp32 arithmetic; an fp16 cache's blocks are widened to fp32 as they are read
// (ops.h: kv_row).
#pragma once
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TS_AVX2 1
#endif

namespace ts::paged {

#ifdef TS_AVX2
// [sum(v[0]), ..., sum(v[7])]: one transpose-add tree instead of eight horizontal sums.
inline __m256 hsum8(const __m256* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Scores of 8 consecutive K rows (k) against G query heads; s[g * n] is token 0's slot for head g.
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

// Blocks are scattered in memory, so the hardware prefetcher stops at each block's end: ask for
// a later block's cache lines while this one is computed. Into L2 (locality 1, prefetcht2): with
// L1 as the target the misses queue up behind its few fill buffers (measured on Zen 4 with
// round-robin block tables: 38 ms against 54 ms for 30 layers at batch 64, context 256), and a
// row at a time, spread over the work, rather than a block in one burst (another ~15%).
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

// One layer's attention inputs (decode here; prefill_attention.cpp adds where each chunk starts).
//
// q            [B, H, D]            heads and dims contiguous, rows q_row apart (heads_contiguous)
// k, v         [Hkv, S, D] each     S = num_blocks * block_size, fp32 or at::Half (the task's T)
// tables       [B, max_blocks]      int64
// lens         [B]                  int64
// out          [B, H, D]
struct Attn {
  const float* q;
  const void *k, *v;
  const int64_t *tables, *lens;
  float* out;
  int64_t H, Hkv, S, D, G, max_blocks, block_size, q_row;
  float scale;
  int64_t window = 0;  // > 0: each sequence attends only its last `window` tokens (Gemma 3)
};

// The first context position a sequence of n tokens attends.
inline int64_t first_attended(const Attn& a, int64_t n) {
  return a.window > 0 && n > a.window ? n - a.window : 0;
}

// q as the kernels read it: heads and dims contiguous, rows any stride apart, so a view into the
// fused qkv rows is read in place (copied only where its heads are strided).
inline at::Tensor heads_contiguous(const at::Tensor& q) {
  return q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
}

// The pointers and sizes every attention kernel reads, from its tensors (q already
// heads_contiguous); out [B, H, D] or [B, H * D] fp32.
inline Attn make_attn(const at::Tensor& q, const at::Tensor& kv_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens,
                      int64_t block_size, double scale, const at::Tensor& out) {
  Attn a;
  a.H = q.size(1);
  a.D = q.size(2);
  a.Hkv = kv_cache.size(1);
  a.S = kv_cache.size(2);
  a.G = a.H / a.Hkv;
  a.max_blocks = block_tables.size(1);
  a.block_size = block_size;
  a.scale = static_cast<float>(scale);
  a.q = q.data_ptr<float>();
  a.q_row = q.stride(0);
  a.k = kv_cache.data_ptr();
  a.v = static_cast<const char*>(a.k) + a.Hkv * a.S * a.D * kv_cache.element_size();
  a.tables = block_tables.data_ptr<int64_t>();
  a.lens = context_lens.data_ptr<int64_t>();
  a.out = out.data_ptr<float>();
  return a;
}

// The logical blocks a task attends, in order: a run of the sequence's blocks (FromBlock, no list
// in memory: all of them, or those a sliding window reaches) or a selected few (Blocks).
struct Blocks {
  const int32_t* sel;
  int64_t count;
  int64_t operator[](int64_t j) const { return sel[j]; }
};
struct FromBlock {  // blocks first, first + 1, ..., count of them
  int64_t first, count;
  int64_t operator[](int64_t j) const { return first + j; }
};

constexpr int64_t kAhead = 2;  // blocks prefetched ahead (1: too late; 4: no better)

template <typename T>
inline void prefetch_kv(const Attn& a, const T* kh, const T* vh, int64_t block, int64_t D) {
  const int64_t off = block * a.block_size * D;
  prefetch_block(kh + off, a.block_size * D * sizeof(T));
  prefetch_block(vh + off, a.block_size * D * sizeof(T));
}

// The steps of attend_fixed over one block of m <= BS rows, forced inline: in the caller's frame
// its q, scores and accumulator stay fixed-size arrays GCC keeps in registers. (GCC 12: the
// same instructions as the loop written in one body, up to register choice.)
#define TS_INLINE inline __attribute__((always_inline))

// s[g][i] = q[g] . K row i for the block's rows (q is pre-scaled).
template <int G, int D, int BS>
TS_INLINE void block_scores(const float (&q)[G][D], const float* kb, int64_t m,
                            float (&s)[G][BS]) {
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
}

// Online softmax over the block: each head's running max (mx) and sum, and its accumulator
// rescaled when the max grows; s becomes the block's weights, 0 past row m and before row skip
// (a window's start). The loops run the full block width (a short block padded with score -inf),
// so they vectorize.
template <int G, int D, int BS>
TS_INLINE void block_softmax(float (&s)[G][BS], int64_t m, int64_t skip, float (&mx)[G],
                             float (&sum)[G], float (&acc)[G][D]) {
  for (int g = 0; g < G; ++g) {
    for (int64_t t = m; t < BS; ++t) s[g][t] = -INFINITY;
    for (int64_t t = 0; t < skip; ++t) s[g][t] = -INFINITY;
    float bm = mx[g];
#pragma omp simd reduction(max : bm)
    for (int t = 0; t < BS; ++t) bm = s[g][t] > bm ? s[g][t] : bm;
    if (bm > mx[g]) {  // a new maximum: rescale what was summed so far
      const float c = fast_exp(mx[g] - bm);
      sum[g] *= c;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] *= c;
      mx[g] = bm;
    }
#pragma omp simd
    for (int t = 0; t < BS; ++t) s[g][t] = fast_exp(s[g][t] - bm);
    for (int64_t t = m; t < BS; ++t) s[g][t] = 0.f;
    for (int64_t t = 0; t < skip; ++t) s[g][t] = 0.f;
    float bsum = 0.f;
#pragma omp simd reduction(+ : bsum)
    for (int t = 0; t < BS; ++t) bsum += s[g][t];
    sum[g] += bsum;
  }
}

// acc += weights . V rows; the block kAhead on (kn, vn; null past the last) is prefetched a row
// at a time here, spread over the work.
template <typename T, int G, int D, int BS>
TS_INLINE void block_values(const float (&s)[G][BS], const float* vb, int64_t m, const T* kn,
                            const T* vn, float (&acc)[G][D]) {
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

// One (sequence, KV head) task with the group size, head dim and block size known at compile
// time, in one pass over the blocks: each block's K and V are used together (online softmax: a
// running max and sum per head, the accumulator rescaled when the max grows), and the blocks two
// ahead are prefetched, so the scattered blocks stream instead of waiting on memory one at a time.
// An fp16 block is widened into kbuf/vbuf first.
template <typename T, int G, int D, int BS, typename List>
void attend_fixed(const Attn& a, int64_t b, int64_t h, List sel, std::vector<float>&) {
  constexpr bool kWiden = !std::is_same_v<T, float>;
  const int64_t n = a.lens[b], count = sel.count, first = first_attended(a, n);
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
    block_scores<G, D, BS>(q, kb, m, s);
    block_softmax<G, D, BS>(s, m, std::max<int64_t>(0, first - sel[j] * BS), mx, sum, acc);
    block_values<T, G, D, BS>(s, vb, m, kn, vn, acc);
  }
  for (int g = 0; g < G; ++g) {
    float* o = a.out + (b * a.H + h * G + g) * D;
    const float inv = 1.f / sum[g];
    for (int d = 0; d < D; ++d) o[d] = acc[g][d] * inv;
  }
}

// Any group size and head dim: the same passes with runtime bounds (rows widened one at a time),
// over the tokens of the listed blocks in order; `scores` is the caller's reused scratch.
template <typename T, typename List>
void attend_generic(const Attn& a, int64_t b, int64_t h, List sel, std::vector<float>& scores) {
  const int64_t n = a.lens[b], bs = a.block_size, G = a.G, D = a.D;
  const int64_t first = first_attended(a, n);
  const int64_t* table = a.tables + b * a.max_blocks;
  const float* qg = a.q + b * a.q_row + h * G * D;
  float* og = a.out + (b * a.H + h * G) * D;
  const T* kc = static_cast<const T*>(a.k) + h * a.S * D;
  const T* vc = static_cast<const T*>(a.v) + h * a.S * D;
  int64_t ntok = 0;  // tokens attended: a block's rows from `first` on
  for (int64_t j = 0; j < sel.count; ++j)
    ntok += std::min<int64_t>(bs, n - sel[j] * bs) - std::clamp<int64_t>(first - sel[j] * bs, 0, bs);
  scores.resize(G * ntok + D);
  float* s = scores.data();
  float* row = s + G * ntok;
  // the cache row of the t-th attended token, visiting them in order
  auto each_row = [&](auto&& fn) {
    for (int64_t j = 0, t = 0; j < sel.count; ++j) {
      const int64_t m = std::min<int64_t>(bs, n - sel[j] * bs);
      for (int64_t o = std::clamp<int64_t>(first - sel[j] * bs, 0, bs); o < m; ++o, ++t)
        fn(t, (table[sel[j]] * bs + o) * D);
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

template <typename List>
using AttendFn = void (*)(const Attn&, int64_t, int64_t, List, std::vector<float>&);

// The task for this cache type and shape: attend_fixed where it is compiled, else attend_generic.
template <typename T, typename List>
AttendFn<List> pick(int64_t G, int64_t D, int64_t block_size) {
#define TS_CASE(g, d, bs) \
  if (G == g && D == d && block_size == bs) return attend_fixed<T, g, d, bs, List>;
#define TS_CASES(bs)                                                                          \
  TS_CASE(1, 64, bs) TS_CASE(2, 64, bs) TS_CASE(3, 64, bs) TS_CASE(4, 64, bs) TS_CASE(8, 64, bs) \
  TS_CASE(1, 128, bs) TS_CASE(2, 128, bs) TS_CASE(4, 128, bs) TS_CASE(8, 128, bs)
  TS_CASES(16) TS_CASES(32)
#undef TS_CASES
#undef TS_CASE
  return attend_generic<T, List>;
}

template <typename List>
AttendFn<List> pick(const Attn& a, const at::Tensor& kv_cache) {
  return kv_cache.scalar_type() == at::kHalf ? pick<at::Half, List>(a.G, a.D, a.block_size)
                                             : pick<float, List>(a.G, a.D, a.block_size);
}

}  // namespace ts::paged
