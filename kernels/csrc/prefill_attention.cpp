// Causal prefill attention for the CPU over the paged cache, fp32 (an fp16 cache's chunks widened
// to fp32 as they are read, ops.h: kv_row): every prefill chunk of a step in one call, K/V read in
// place from their blocks (this step's K/V already stored there), the chunk's queries at the
// context's end (bottom-right causal: query i of a chunk of n in a context of c tokens sees keys
// 0 .. c - n + i).
//
// One task per (sequence, KV head, tile of 16 query positions) serves the head's whole GQA group:
// its G * 16 query rows meet each 16-key chunk of K and V once. Per chunk: S = Q K^T through the
// GEMM register tile (the chunk's K transposed to [D][16] first), online softmax per row (running
// max and sum, the row's output rescaled when the max grows), O += P V through the same tile.
// Chunks past a tile's last position are skipped, so causal attention does about half the work
// of the full square. Tasks are split between threads by their key count, not their number.
//
// q            [T, H, D]   rows may be strided (a view of the fused qkv rows)
// kv_cache     [2, Hkv, S, D]  fp32 or fp16
// block_tables [P, max_blocks] int64, the prefill sequences' rows
// query_start  [P + 1] int64, rows of q (and out) where each sequence's chunk begins
// context_lens [P] int64, tokens in each sequence's KV including this chunk
// out          [T, H * D], the chunks' rows are written
#include "ops.h"
#include "paged_attention.h"
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "tile.h"

namespace {

constexpr int64_t kQT = 16;   // query positions per task
constexpr int64_t kKC = 16;   // keys per chunk (a tile's width)

struct Task {
  int64_t seq, head, q0;  // q0: first query of the tile, counted within the sequence's chunk
};

// The attention inputs as decode has them (paged_attention.h: make_attn sets up both), and where
// each sequence's chunk begins among q's rows.
struct Args : ts::paged::Attn {
  const int64_t* qstart;
};

#if defined(__AVX2__) && defined(__FMA__)
// One task's working set, in the thread's reused buffer. Rows r = g * nq + i: query head
// h * G + g at chunk position q0 + i.
struct Work {
  int64_t nq, R;          // the tile's query positions, and its rows (G per position)
  int64_t first_pos;      // absolute position of the tile's first query
  float *Q, *O;           // [R, D]: scaled queries; the unnormalized output
  float *P, *Kt;          // this chunk's scores (then weights) [R, 16]; its K transposed [D, 16]
  float *mx, *sum;        // [R]: each row's running max and sum
  float *kwide, *vwide;   // an fp16 chunk's K and V rows, widened
};

// The task's working set carved from buf, its queries scaled, its running max, sum and output
// reset.
Work start_task(const Args& a, const Task& t, std::vector<float>& buf, bool widen) {
  const int64_t G = a.G, D = a.D, s = t.seq;
  const int64_t n = a.qstart[s + 1] - a.qstart[s], ctx = a.lens[s];
  Work w;
  w.nq = std::min(kQT, n - t.q0);
  w.R = G * w.nq;
  w.first_pos = ctx - n + t.q0;
  const int64_t R = w.R;
  buf.resize(R * D * 2 + R * kKC + D * kKC + 2 * R + (widen ? 2 * kKC * D : 0));
  w.Q = buf.data();
  w.O = w.Q + R * D;
  w.P = w.O + R * D;
  w.Kt = w.P + R * kKC;
  w.mx = w.Kt + D * kKC;
  w.sum = w.mx + R;
  w.kwide = w.sum + R;
  w.vwide = w.kwide + kKC * D;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < w.nq; ++i) {
      const float* src = a.q + (a.qstart[s] + t.q0 + i) * a.q_row + (t.head * G + g) * D;
      float* dst = w.Q + (g * w.nq + i) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * a.scale;
    }
  std::fill(w.O, w.O + R * D, 0.f);
  std::fill(w.mx, w.mx + R, -INFINITY);
  std::fill(w.sum, w.sum + R, 0.f);
  return w;
}

// P = Q K^T for the chunk's 16 keys. All 16 rows of the chunk: rows past the context hold finite
// values of this block's unused slots and are masked in chunk_softmax, for every query.
TS_INLINE void chunk_scores(const Work& w, const float* kb, int64_t D) {
  for (int64_t j = 0; j < kKC; ++j)
    for (int64_t d = 0; d < D; ++d) w.Kt[d * kKC + j] = kb[j * D + d];
  for (int64_t r0 = 0, ti = 0, rows = 0; r0 < w.R; ++ti, r0 += rows) {
    rows = ts::tile_rows(w.R, ti);
    ts::kTiles<false>[rows](w.Q + r0 * D, D, w.Kt, kKC, D, nullptr, w.P + r0 * kKC, kKC, kKC);
  }
}

// Online softmax per row over the keys of the chunk (from c0) it sees: P becomes the weights
// (0 for keys past the row's position), the row's output rescaled when its max grows.
TS_INLINE void chunk_softmax(const Work& w, int64_t c0, int64_t D) {
  const __m256 lane0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 lane1 = _mm256_add_ps(lane0, _mm256_set1_ps(8));
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t r = 0; r < w.R; ++r) {
    float* p = w.P + r * kKC;
    // keys of this chunk the row sees: lanes j < seen (seen <= 0: none)
    const float seen = static_cast<float>(w.first_pos + r % w.nq - c0 + 1);
    const __m256 k0 = _mm256_cmp_ps(lane0, _mm256_set1_ps(seen), _CMP_LT_OQ);
    const __m256 k1 = _mm256_cmp_ps(lane1, _mm256_set1_ps(seen), _CMP_LT_OQ);
    const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(p), k0);
    const __m256 s1 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(p + 8), k1);
    __m256 mv = _mm256_max_ps(s0, s1);
    mv = _mm256_max_ps(mv, _mm256_permute2f128_ps(mv, mv, 1));
    mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0x4e));
    mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0xb1));
    const float m = std::max(w.mx[r], _mm256_cvtss_f32(mv));
    if (m == -INFINITY) {  // nothing seen yet (a later chunk than the row's position)
      _mm256_storeu_ps(p, _mm256_setzero_ps());
      _mm256_storeu_ps(p + 8, _mm256_setzero_ps());
      continue;
    }
    if (m > w.mx[r]) {  // a new maximum: rescale what was summed so far
      const float c = fast_exp(w.mx[r] - m);
      w.sum[r] *= c;
      float* o = w.O + r * D;
      for (int64_t d = 0; d < D; ++d) o[d] *= c;
      w.mx[r] = m;
    }
    const __m256 mm = _mm256_set1_ps(m);
    const __m256 e0 = _mm256_and_ps(fast_exp8(_mm256_sub_ps(s0, mm)), k0);
    const __m256 e1 = _mm256_and_ps(fast_exp8(_mm256_sub_ps(s1, mm)), k1);
    _mm256_storeu_ps(p, e0);
    _mm256_storeu_ps(p + 8, e1);
    __m256 t = _mm256_add_ps(e0, e1);
    t = _mm256_add_ps(t, _mm256_permute2f128_ps(t, t, 1));
    t = _mm256_add_ps(t, _mm256_shuffle_ps(t, t, 0x4e));
    t = _mm256_add_ps(t, _mm256_shuffle_ps(t, t, 0xb1));
    w.sum[r] += _mm256_cvtss_f32(t);
  }
}

// O += P V over the chunk's 16 V rows (weight 0 past the context; a chunk never crosses its
// block, and all of a block's rows exist in the cache).
TS_INLINE void chunk_values(const Work& w, const float* vb, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += ts::kNR)
    for (int64_t r0 = 0, ti = 0, rows = 0; r0 < w.R; ++ti, r0 += rows) {
      rows = ts::tile_rows(w.R, ti);
      ts::kTiles<true>[rows](w.P + r0 * kKC, kKC, vb + d0, D, kKC, nullptr, w.O + r0 * D + d0, D,
                             ts::kNR);
    }
}

// The task's rows of out: each row's output over its sum.
void finish_task(const Args& a, const Task& t, const Work& w) {
  const int64_t G = a.G, D = a.D;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < w.nq; ++i) {
      const int64_t r = g * w.nq + i;
      float* dst = a.out + (a.qstart[t.seq] + t.q0 + i) * a.H * D + (t.head * G + g) * D;
      const float inv = 1.f / w.sum[r];
      for (int64_t d = 0; d < D; ++d) dst[d] = w.O[r * D + d] * inv;
    }
}

// One task: the chunks of 16 keys up to its last query's position, in order.
template <typename T>
void run_task(const Args& a, const Task& t, std::vector<float>& buf) {
  const Work w = start_task(a, t, buf, !std::is_same_v<T, float>);
  const int64_t D = a.D;
  const int64_t* table = a.tables + t.seq * a.max_blocks;
  const T* kh = static_cast<const T*>(a.k) + t.head * a.S * D;
  const T* vh = static_cast<const T*>(a.v) + t.head * a.S * D;
  const int64_t keys = w.first_pos + w.nq;  // the last query sees keys [0, keys)
  for (int64_t c0 = 0; c0 < keys; c0 += kKC) {
    const int64_t slot = table[c0 / a.block_size] * a.block_size + c0 % a.block_size;
    const float* kb = kv_row(kh + slot * D, w.kwide, kKC * D);
    const float* vb = kv_row(vh + slot * D, w.vwide, kKC * D);
    chunk_scores(w, kb, D);
    chunk_softmax(w, c0, D);
    chunk_values(w, vb, D);
  }
  finish_task(a, t, w);
}

// One task per (sequence, KV head, tile of kQT query positions), and the keys each reads: tasks
// are split between threads by that, not by their number.
void make_tasks(const Args& a, int64_t seqs, std::vector<Task>& tasks,
                std::vector<int64_t>& cost) {
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t n = a.qstart[s + 1] - a.qstart[s];
    for (int64_t h = 0; h < a.Hkv; ++h)
      for (int64_t q0 = 0; q0 < n; q0 += kQT) {
        tasks.push_back({s, h, q0});
        cost.push_back(a.lens[s] - n + std::min(n, q0 + kQT));
      }
  }
}
#endif

}  // namespace

bool paged_prefill_supported(int64_t head_dim, int64_t block_size) {
#if defined(__AVX2__) && defined(__FMA__)
  return head_dim % ts::kNR == 0 && block_size % kKC == 0;
#else
  return false;
#endif
}

void paged_prefill_(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                    at::Tensor query_start, at::Tensor context_lens, int64_t block_size,
                    double scale, at::Tensor out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_dtype_supported(kv_cache),
              "fp32 queries, fp32 or fp16 KV cache");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.is_contiguous() && out.is_contiguous(),
              "contiguous cache, tables and out");
  TORCH_CHECK(paged_prefill_supported(q.size(2), block_size), "head dim or block size unsupported");
  q = ts::paged::heads_contiguous(q);
#if defined(__AVX2__) && defined(__FMA__)
  Args a;
  static_cast<ts::paged::Attn&>(a) =
      ts::paged::make_attn(q, kv_cache, block_tables, context_lens, block_size, scale, out);
  a.qstart = query_start.data_ptr<int64_t>();
  const bool half = kv_cache.scalar_type() == at::kHalf;
  std::vector<Task> tasks;
  std::vector<int64_t> cost;  // keys a task reads
  make_tasks(a, context_lens.size(0), tasks, cost);
  const std::vector<int64_t> cut = balanced_cuts(cost, at::get_num_threads());
  ts::parallel_for(0, static_cast<int64_t>(cut.size()) - 1, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t i = cut[begin]; i < cut[end]; ++i)
      half ? run_task<at::Half>(a, tasks[i], buf) : run_task<float>(a, tasks[i], buf);
  });
#endif
}
