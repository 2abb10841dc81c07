// Fused element-wise ops for the CPU model path (fp32): each is one pass over its rows where torch
// needs three to five ops, each its own OpenMP region. At decode sizes a region costs more to wake
// (tens of microseconds with OMP_WAIT_POLICY=PASSIVE) than the work in it, so small inputs run on
// the calling thread and only prefill-sized ones are split across threads.
//
// No FMA contraction in this file: every product and sum rounds as torch's separate ops do, so RoPE
// gives the same bits as the unfused torch code (and as Hugging Face's); RMSNorm's sum of squares
// is reduced in another order, which can move its last bit.
#include "ops.h"
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>

// Every function defined below, the parallel_for lambdas included (headers above are unaffected).
#pragma GCC optimize("fp-contract=off")

namespace {

// Rows per task so that a task holds at least ~64K floats; fewer rows than that stay inline.
int64_t grain_rows(int64_t row_floats) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_floats));
}

}  // namespace

void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "contiguous inputs");
  const int64_t M = x.size(0), N = x.size(1);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  ts::parallel_for(0, M, grain_rows(N), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* xr = xp + i * N;
      float* rr = rp + i * N;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < N; ++j) {
        const float h = xr[j] + rr[j];
        rr[j] = h;
        ss += h * h;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(N) + e);
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) xr[j] = w[j] * (rr[j] * inv);
    }
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "fp32 only");
  const int64_t N = weight.numel();
  TORCH_CHECK(N > 0 && x.size(-1) == N, "x's last dim must be the weight's ", N);
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = at::empty(x.sizes(), x.options());
  const int64_t M = x.numel() / N;
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  ts::parallel_for(0, M, grain_rows(N), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // add_rms_norm_'s steps, without the add
      const float* xr = xp + i * N;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < N; ++j) ss += xr[j] * xr[j];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(N) + e);
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) op[i * N + j] = w[j] * (xr[j] * inv);
    }
  });
  return out;
}

namespace {

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// 8 bf16 values widened to fp32 (exact: bf16 is fp32's upper half).
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 8 fp32 values rounded to bf16, nearest-even (as c10::BFloat16; finite inputs).
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif

// silu(gate) * up row by row in fp32; T = float, or c10::BFloat16 (--prefill-bf16's MLP: widened
// as read, rounded once as written, where torch's bf16 silu then mul round twice in two passes).
template <class T>
at::Tensor silu_and_mul_as(const at::Tensor& gate_up) {
  const int64_t M = gate_up.size(0), N = gate_up.size(1) / 2;
  auto out = at::empty({M, N}, gate_up.options());
  const T* in = gate_up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  ts::parallel_for(0, M, grain_rows(2 * N), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = in + i * 2 * N;
      const T* u = g + N;
      T* orow = o + i * N;
      int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      for (; j + 8 <= N; j += 8) {
        const __m256 gv = load8(g + j);
        const __m256 e = fast_exp8(_mm256_sub_ps(zero, gv));
        store8(orow + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), load8(u + j)));
      }
#endif
      for (; j < N; ++j) {
        const float gf = static_cast<float>(g[j]);
        orow[j] = T(gf / (1.0f + fast_exp(-gf)) * static_cast<float>(u[j]));
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK((gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16) &&
                  gate_up.is_contiguous(),
              "contiguous fp32 or bf16");
  return gate_up.scalar_type() == at::kBFloat16 ? silu_and_mul_as<c10::BFloat16>(gate_up)
                                                : silu_and_mul_as<float>(gate_up);
}

void rope_store_kv_(at::Tensor qkv, at::Tensor positions, at::Tensor cos,
                    at::Tensor sin_signed, at::Tensor kv_cache, at::Tensor slots,
                    int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && kv_dtype_supported(kv_cache),
              "fp32 qkv, fp32 or fp16 KV cache");
  TORCH_CHECK(qkv.is_contiguous() && kv_cache.is_contiguous() && cos.is_contiguous() &&
                  sin_signed.is_contiguous(),
              "contiguous inputs");
  const int64_t T = qkv.size(0), D = cos.size(1), half = D / 2;
  const int64_t H = num_heads, Hkv = num_kv_heads, S = kv_cache.size(2);
  TORCH_CHECK(D <= 512 && D % 2 == 0, "head dim must be even and at most 512");
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D, "qkv width != (H + 2 Hkv) * D");
  float* base = qkv.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* ct = cos.data_ptr<float>();
  const float* st = sin_signed.data_ptr<float>();
  const bool fp16 = kv_cache.scalar_type() == at::kHalf;
  float* kc32 = fp16 ? nullptr : kv_cache.data_ptr<float>();
  at::Half* kc16 = fp16 ? kv_cache.data_ptr<at::Half>() : nullptr;
  ts::parallel_for(0, T, grain_rows((H + 2 * Hkv) * D), [&](int64_t begin, int64_t end) {
    float tmp[512];
    for (int64_t t = begin; t < end; ++t) {
      const float* c = ct + pos[t] * D;
      const float* s = st + pos[t] * D;
      float* row = base + t * (H + 2 * Hkv) * D;
      // x * cos + roll(x, D/2) * sin_signed: q and k heads rotated in place.
      for (int64_t h = 0; h < H + Hkv; ++h) {
        float* x = row + h * D;
        std::memcpy(tmp, x, D * sizeof(float));
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) x[d] = tmp[d] * c[d] + tmp[d + half] * s[d];
#pragma omp simd
        for (int64_t d = half; d < D; ++d) x[d] = tmp[d] * c[d] + tmp[d - half] * s[d];
      }
      const float* k = row + H * D;
      const float* v = k + Hkv * D;
      for (int64_t h = 0; h < Hkv; ++h) {  // K at [0, h, slot], V at [1, h, slot]
        const int64_t at_k = (h * S + slot[t]) * D, at_v = ((Hkv + h) * S + slot[t]) * D;
        if (fp16) {
          kv_from_float(k + h * D, kc16 + at_k, D);
          kv_from_float(v + h * D, kc16 + at_v, D);
        } else {
          kv_from_float(k + h * D, kc32 + at_k, D);
          kv_from_float(v + h * D, kc32 + at_v, D);
        }
      }
    }
  });
}

at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "2-D fp32");
  const int64_t M = x.size(0), N = x.size(1);
  auto out = at::empty({M}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  ts::parallel_for(0, M, grain_rows(N), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* r = p + i * N;
      float m = -INFINITY;
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < N; ++j) m = r[j] > m ? r[j] : m;
      int64_t at = 0;  // the first index holding the maximum, as torch.argmax returns
      while (at < N && !(r[at] == m)) ++at;
      o[i] = at < N ? at : 0;  // an all-NaN row: 0
    }
  });
  return out;
}
