// y = x W^T for 4-bit weights in groups of 32 (GGUF's Q4_0 / Q4_1 blocks, or int4 from any
// weights), by integer dot products, as llama.cpp does (issue 31).
//
// Why: torch's _weight_int4pack_mm_for_cpu widens every weight to fp32 and multiplies in fp32;
// at decode batch sizes that compute, not the 0.6 bytes a weight read, sets the time (13 ms of
// the embedded model's 18.5 ms a token). Here each row of x is quantized once per call to two
// int8 terms in blocks of 32 (x ~ xs xq + xrs xr, and the block's exact fp32 sum), and a weight
// block's 32 codes meet each term's 32 int8 values in one maddubs: per block
//     sum_k w_k x_k = d (xs sum_k q_k xq_k + xrs sum_k q_k xr_k)  +  z (sum_k x_k)
// (w_k = d q_k + z).
// with q_k in 0..15 (unsigned) and z the block's zero (Q4_1's m; Q4_0's -8d).
//
// Layout: codes [N, K/32, 16] bytes, byte j of a block holding weights j (low nibble) and 16 + j
// (high nibble): GGUF's own order, so its blocks are copied, not re-packed; d and z [N, K/32]
// fp32. Threads take disjoint runs of output rows; every row of x is applied to a weight block
// while it is in registers.
#include "ops.h"
#include "thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kGroup = 32;

// x [M, K] -> per block of 32: int8 values xq with scale xs (max |x| -> 127), the int8 residual
// xr = x - xs xq with its own scale xrs, and the block's exact sum. Two int8 terms carry ~14 bits:
// one alone (llama.cpp's Q8 activations) cost the embedded model 8% top-1 agreement with fp32,
// the pair less than bf16 does (tests/test_quant.py).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xs, int8_t* xr,
                   float* xrs, float* xsum) {
  const int64_t nb = K / kGroup;
  for (int64_t r = 0; r < M * nb; ++r) {
    const float* v = x + (r / nb) * K + (r % nb) * kGroup;
    float amax = 0.f, sum = 0.f;
    for (int i = 0; i < kGroup; ++i) {
      amax = std::max(amax, std::fabs(v[i]));
      sum += v[i];
    }
    const float s = amax / 127.f;
    const float inv = s > 0.f ? 1.f / s : 0.f;
    float res[kGroup], ramax = 0.f;
    for (int i = 0; i < kGroup; ++i) {
      const int q = (int)std::lrintf(v[i] * inv);
      xq[r * kGroup + i] = (int8_t)q;
      res[i] = v[i] - s * (float)q;
      ramax = std::max(ramax, std::fabs(res[i]));
    }
    const float rs = ramax / 127.f;
    const float rinv = rs > 0.f ? 1.f / rs : 0.f;
    for (int i = 0; i < kGroup; ++i) xr[r * kGroup + i] = (int8_t)std::lrintf(res[i] * rinv);
    xs[r] = s;
    xrs[r] = rs;
    xsum[r] = sum;
  }
}

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// sum_i a[i] b[i] over n values (the zero terms: each block's zero times its exact x sum).
inline float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float out = 0.f;
#ifdef __AVX2__
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  out = hsum(acc);
#endif
  for (; i < n; ++i) out += a[i] * b[i];
  return out;
}

#ifdef __AVX2__
// One block's 32 codes (weights 0..15 in the low nibbles, 16..31 in the high ones) as bytes.
inline __m256i unpack_block(const uint8_t* c) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// The block's integer dot with 32 int8 activations, as 8 fp32 partial sums.
inline __m256 block_dot(__m256i q, const int8_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm256_cvtepi32_ps(
      _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1)));
}

// acc + the weight block (codes q, scale wd) times activation block xb, both int8 terms.
inline __m256 add_block(__m256 acc, __m256i q, float wd, const int8_t* xq, const int8_t* xr,
                        const float* xs, const float* xrs, int64_t xb) {
  acc = _mm256_fmadd_ps(block_dot(q, xq + xb * kGroup), _mm256_set1_ps(wd * xs[xb]), acc);
  return _mm256_fmadd_ps(block_dot(q, xr + xb * kGroup), _mm256_set1_ps(wd * xrs[xb]), acc);
}
#endif

// Output rows [n0, n1) for every row of x, up to kMaxRows rows of x at a time per weight block.
// Two accumulators a row (alternate blocks), so the FMA chain's latency is not the limit at one
// row.
void rows_range(const uint8_t* codes, const float* d, const float* z, const int8_t* xq,
                const float* xs, const int8_t* xr, const float* xrs, const float* xsum, float* y,
                int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t nb = K / kGroup;
  constexpr int kMaxRows = 4;
  // weights outer: a weight row (a few hundred bytes) stays in L1 while every row of x passes
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wc = codes + n * nb * 16;
    const float* wd = d + n * nb;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t mr = std::min<int64_t>(kMaxRows, M - m0);
#ifdef __AVX2__
      __m256 acc0[kMaxRows], acc1[kMaxRows];
      for (int r = 0; r < mr; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
      int64_t b = 0;
      for (; b + 2 <= nb; b += 2) {
        const __m256i q0 = unpack_block(wc + b * 16), q1 = unpack_block(wc + (b + 1) * 16);
        for (int r = 0; r < mr; ++r) {
          const int64_t xb = (m0 + r) * nb + b;
          acc0[r] = add_block(acc0[r], q0, wd[b], xq, xr, xs, xrs, xb);
          acc1[r] = add_block(acc1[r], q1, wd[b + 1], xq, xr, xs, xrs, xb + 1);
        }
      }
      for (; b < nb; ++b) {
        const __m256i q0 = unpack_block(wc + b * 16);
        for (int r = 0; r < mr; ++r)
          acc0[r] = add_block(acc0[r], q0, wd[b], xq, xr, xs, xrs, (m0 + r) * nb + b);
      }
      for (int r = 0; r < mr; ++r)
        y[(m0 + r) * N + n] = hsum(_mm256_add_ps(acc0[r], acc1[r]))
                              + dot_f32(z + n * nb, xsum + (m0 + r) * nb, nb);
#else
      for (int r = 0; r < mr; ++r) {
        float out = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t xb = (m0 + r) * nb + b;
          int32_t dot = 0, rdot = 0;
          for (int j = 0; j < 16; ++j) {
            dot += (wc[b * 16 + j] & 0x0F) * xq[xb * kGroup + j];
            dot += (wc[b * 16 + j] >> 4) * xq[xb * kGroup + 16 + j];
            rdot += (wc[b * 16 + j] & 0x0F) * xr[xb * kGroup + j];
            rdot += (wc[b * 16 + j] >> 4) * xr[xb * kGroup + 16 + j];
          }
          out += wd[b] * (xs[xb] * (float)dot + xrs[xb] * (float)rdot);
        }
        y[(m0 + r) * N + n] = out + dot_f32(z + n * nb, xsum + (m0 + r) * nb, nb);
      }
#endif
    }
  }
}

}  // namespace

at::Tensor q4_linear(at::Tensor x, at::Tensor codes, at::Tensor d, at::Tensor z) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] fp32");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 16 && codes.scalar_type() == at::kByte,
              "codes must be [N, K/32, 16] uint8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = codes.size(1);
  TORCH_CHECK(K == nb * kGroup, "x has ", K, " columns, the weights ", nb * kGroup);
  TORCH_CHECK(d.sizes() == z.sizes() && d.size(0) == N && d.size(1) == nb, "d, z: [N, K/32]");
  auto y = at::empty({M, N}, x.options());
  std::vector<int8_t> xq(M * K), xr(M * K);
  std::vector<float> xs(M * nb), xrs(M * nb), xsum(M * nb);
  quantize_rows(x.data_ptr<float>(), M, K, xq.data(), xs.data(), xr.data(), xrs.data(),
                xsum.data());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  ts::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    rows_range(c, dp, zp, xq.data(), xs.data(), xr.data(), xrs.data(), xsum.data(), yp, M, N, K,
               n0, n1);
  });
  return y;
}
