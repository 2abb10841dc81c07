// Paged decode attention for the CPU: one query token per sequence, K/V read in place from the
// block-paged cache (no gather copy). One task per (sequence, KV head) serves that head's whole
// GQA group, so every K/V row is read once. Two passes per task: scores (reads K), then the
// softmax-weighted sum (reads V). fp32 throughout.
//
// q            [B, H, D]            contiguous
// kv_cache     [2, Hkv, S, D]       S = num_blocks * block_size
// block_tables [B, max_blocks]      int64
// context_lens [B]                  int64
// out          [B, H, D]
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// -fopenmp makes ATen's header-inlined parallel_for actually run on torch's OpenMP threads
// (libgomp.so.1, the one torch already loaded).
static inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

static inline void axpy(float w, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat, "fp32 only");
  q = q.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = kv_cache.size(1), S = kv_cache.size(2), G = H / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = kv_cache.data_ptr<float>();
  const float* vp = kp + Hkv * S * D;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, n = lens[b];
      const int64_t* table = tables + b * max_blocks;
      const float* kh = kp + h * S * D;
      const float* vh = vp + h * S * D;
      const float* qg = qp + (b * H + h * G) * D;
      float* og = op + (b * H + h * G) * D;
      scores.resize(G * n);
      for (int64_t t = 0; t < n; ++t) {
        const float* krow = kh + (table[t / block_size] * block_size + t % block_size) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * n + t] = dot(qg + g * D, krow, D) * fscale;
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * n;
        float m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
        for (int64_t t = 0; t < n; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) s[t] *= inv;
        std::fill(og + g * D, og + (g + 1) * D, 0.f);
      }
      for (int64_t t = 0; t < n; ++t) {
        const float* vrow = vh + (table[t / block_size] * block_size + t % block_size) * D;
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * n + t], vrow, og + g * D, D);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU, fp32)");
}
