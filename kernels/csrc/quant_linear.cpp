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
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kGroup = 32;

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 int32 lanes (four vectors, in order) -> 32 int8 in order (the values fit: |q| <= 127).
inline void store_i8(const __m256i q[4], int8_t* out) {
  const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i b = _mm256_packs_epi16(w01, w23);  // lanes interleaved by the 128-bit packs
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// One block of 32 values -> its two int8 terms, their scales and its exact sum (the scalar
// loop's arithmetic, 8 lanes at a time: rounding to nearest-even as lrintf does).
inline void quantize_block(const float* v, int8_t* xq, float* xs, int8_t* xr, float* xrs,
                           float* xsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[i]));
    sum = _mm256_add_ps(sum, x[i]);
  }
  const float s = hmax(amax) / 127.f;
  const __m256 vs = _mm256_set1_ps(s), inv = _mm256_set1_ps(s > 0.f ? 1.f / s : 0.f);
  __m256i q[4];
  __m256 res[4], ramax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv));
    res[i] = _mm256_fnmadd_ps(vs, _mm256_cvtepi32_ps(q[i]), x[i]);
    ramax = _mm256_max_ps(ramax, _mm256_andnot_ps(sign, res[i]));
  }
  store_i8(q, xq);
  const float rs = hmax(ramax) / 127.f;
  const __m256 rinv = _mm256_set1_ps(rs > 0.f ? 1.f / rs : 0.f);
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(res[i], rinv));
  store_i8(q, xr);
  *xs = s, *xrs = rs, *xsum = hsum(sum);
}
#else
inline void quantize_block(const float* v, int8_t* xq, float* xs, int8_t* xr, float* xrs,
                           float* xsum) {
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
    xq[i] = (int8_t)q;
    res[i] = v[i] - s * (float)q;
    ramax = std::max(ramax, std::fabs(res[i]));
  }
  const float rs = ramax / 127.f;
  const float rinv = rs > 0.f ? 1.f / rs : 0.f;
  for (int i = 0; i < kGroup; ++i) xr[i] = (int8_t)std::lrintf(res[i] * rinv);
  *xs = s, *xrs = rs, *xsum = sum;
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
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q, xv));
#else
  return _mm256_cvtepi32_ps(
      _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1)));
#endif
}

// acc + the weight block (codes q, scale wd) times activation block xb, both int8 terms.
inline __m256 add_block(__m256 acc, __m256i q, float wd, const Q4Acts& a, int64_t xb) {
  acc = _mm256_fmadd_ps(block_dot(q, a.xq.data() + xb * kGroup), _mm256_set1_ps(wd * a.xs[xb]),
                        acc);
  return _mm256_fmadd_ps(block_dot(q, a.xr.data() + xb * kGroup),
                         _mm256_set1_ps(wd * a.xrs[xb]), acc);
}

// An 8-bit block (32 signed codes w, and |w|) times 32 int8 activations, as 8 fp32 partial sums:
// |w| (unsigned) against x with w's sign, so the unsigned-by-signed multiply takes it (llama.cpp's
// way; |w| <= 128 and |x| <= 127 keep maddubs' 16-bit pair sums from saturating).
inline __m256 block_dot8(__m256i w, __m256i wabs, const int8_t* x) {
  const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wabs, xv));
#else
  return _mm256_cvtepi32_ps(
      _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xv), _mm256_set1_epi16(1)));
#endif
}

inline __m256 add_block8(__m256 acc, __m256i w, __m256i wabs, float wd, const Q4Acts& a,
                         int64_t xb) {
  acc = _mm256_fmadd_ps(block_dot8(w, wabs, a.xq.data() + xb * kGroup),
                        _mm256_set1_ps(wd * a.xs[xb]), acc);
  return _mm256_fmadd_ps(block_dot8(w, wabs, a.xr.data() + xb * kGroup),
                         _mm256_set1_ps(wd * a.xrs[xb]), acc);
}
#endif

}  // namespace

void Q4Acts::resize(int64_t rows, int64_t cols) {
  if (static_cast<int64_t>(xq.size()) < rows * cols) xq.resize(rows * cols), xr.resize(rows * cols);
  const int64_t blocks = rows * cols / kGroup;
  if (static_cast<int64_t>(xs.size()) < blocks)
    xs.resize(blocks), xrs.resize(blocks), xsum.resize(blocks);
}

// Rows [m0, m1) of x (K columns, row stride lda) into the same rows of a, block by block.
void q4_quantize_rows(const float* x, int64_t lda, int64_t K, int64_t m0, int64_t m1, Q4Acts& a) {
  const int64_t nb = K / kGroup;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t r = m * nb + b;
      quantize_block(x + m * lda + b * kGroup, a.xq.data() + r * kGroup, a.xs.data() + r,
                     a.xr.data() + r * kGroup, a.xrs.data() + r, a.xsum.data() + r);
    }
}

// Output columns [n0, n1) of y [M, N] (+ bias) for every row of a, up to kMaxRows rows of x at a
// time per weight block. Two accumulators a row (alternate blocks), so the FMA chain's latency is
// not the limit at one row. Each output is computed the same way whichever range it falls in.
void q4_linear_cols(const Q4Linear& w, const Q4Acts& a, const float* bias, float* y, int64_t M,
                    int64_t n0, int64_t n1) {
  const int64_t N = w.N, nb = w.K / kGroup;
  constexpr int kMaxRows = 4;
  // weights outer: a weight row (a few hundred bytes) stays in L1 while every row of x passes
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wc = w.codes + n * nb * 16;
    const float* wd = w.d + n * nb;
    const float b0 = bias ? bias[n] : 0.f;
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
          acc0[r] = add_block(acc0[r], q0, wd[b], a, xb);
          acc1[r] = add_block(acc1[r], q1, wd[b + 1], a, xb + 1);
        }
      }
      for (; b < nb; ++b) {
        const __m256i q0 = unpack_block(wc + b * 16);
        for (int r = 0; r < mr; ++r) acc0[r] = add_block(acc0[r], q0, wd[b], a, (m0 + r) * nb + b);
      }
      for (int r = 0; r < mr; ++r)
        y[(m0 + r) * N + n] = hsum(_mm256_add_ps(acc0[r], acc1[r]))
                              + dot_f32(w.z + n * nb, a.xsum.data() + (m0 + r) * nb, nb) + b0;
#else
      for (int r = 0; r < mr; ++r) {
        float out = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t xb = (m0 + r) * nb + b;
          const int8_t *xq = a.xq.data() + xb * kGroup, *xr = a.xr.data() + xb * kGroup;
          int32_t dot = 0, rdot = 0;
          for (int j = 0; j < 16; ++j) {
            dot += (wc[b * 16 + j] & 0x0F) * xq[j] + (wc[b * 16 + j] >> 4) * xq[16 + j];
            rdot += (wc[b * 16 + j] & 0x0F) * xr[j] + (wc[b * 16 + j] >> 4) * xr[16 + j];
          }
          out += wd[b] * (a.xs[xb] * (float)dot + a.xrs[xb] * (float)rdot);
        }
        y[(m0 + r) * N + n] = out + dot_f32(w.z + n * nb, a.xsum.data() + (m0 + r) * nb, nb) + b0;
      }
#endif
    }
  }
}

void q8_linear_cols(const Q8Linear& w, const Q4Acts& a, float* y, int64_t M, int64_t n0,
                    int64_t n1) {
  const int64_t N = w.N, nb = w.K / kGroup;
  constexpr int kMaxRows = 4;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wc = w.codes + n * w.K;
    const float* wd = w.d + n * nb;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t mr = std::min<int64_t>(kMaxRows, M - m0);
#ifdef __AVX2__
      __m256 acc0[kMaxRows], acc1[kMaxRows];
      for (int r = 0; r < mr; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
      int64_t b = 0;
      for (; b + 2 <= nb; b += 2) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + b * kGroup));
        const __m256i w1 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + (b + 1) * kGroup));
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        for (int r = 0; r < mr; ++r) {
          const int64_t xb = (m0 + r) * nb + b;
          acc0[r] = add_block8(acc0[r], w0, a0, wd[b], a, xb);
          acc1[r] = add_block8(acc1[r], w1, a1, wd[b + 1], a, xb + 1);
        }
      }
      for (; b < nb; ++b) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + b * kGroup));
        const __m256i a0 = _mm256_abs_epi8(w0);
        for (int r = 0; r < mr; ++r)
          acc0[r] = add_block8(acc0[r], w0, a0, wd[b], a, (m0 + r) * nb + b);
      }
      for (int r = 0; r < mr; ++r) y[(m0 + r) * N + n] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
#else
      for (int r = 0; r < mr; ++r) {
        float out = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t xb = (m0 + r) * nb + b;
          const int8_t *xq = a.xq.data() + xb * kGroup, *xr = a.xr.data() + xb * kGroup;
          int32_t dot = 0, rdot = 0;
          for (int j = 0; j < kGroup; ++j)
            dot += wc[b * kGroup + j] * xq[j], rdot += wc[b * kGroup + j] * xr[j];
          out += wd[b] * (a.xs[xb] * (float)dot + a.xrs[xb] * (float)rdot);
        }
        y[(m0 + r) * N + n] = out;
      }
#endif
    }
  }
}

// ---- the dense form: weight rows decoded to fp32, then fp32 dot products ------------------
//
// A batch of rows pays for decoding each weight once and then multiplies in fp32 at the FMA
// units' rate; the integer form above pays its per-block scale work for every row of x. The
// decoded weights are exact (w = d q + z in fp32), so this form's only rounding is fp32's.

namespace {

#if defined(__AVX512F__)
// One Q4 block's 32 weights, d q + z, into out[0..32).
inline void decode_q4_block(const uint8_t* c, float d, float z, float* out) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
  const __m512 vd = _mm512_set1_ps(d), vz = _mm512_set1_ps(z);
  _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vd, vz));
  _mm512_storeu_ps(out + 16,
                   _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vd, vz));
}
inline void decode_q8_block(const int8_t* c, float d, float* out) {
  const __m512 vd = _mm512_set1_ps(d);
  for (int i = 0; i < 2; ++i) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * i));
    _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), vd));
  }
}
// The fp32 vector dot4 is written once over these.
struct VecF {
  using T = __m512;
  static constexpr int kWidth = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__)
inline void decode_q4_block(const uint8_t* c, float d, float z, float* out) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
  const __m256 vd = _mm256_set1_ps(d), vz = _mm256_set1_ps(z);
  const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int i = 0; i < 4; ++i) {
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[i]));
    _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(q, vd, vz));
  }
}
inline void decode_q8_block(const int8_t* c, float d, float* out) {
  const __m256 vd = _mm256_set1_ps(d);
  for (int i = 0; i < 4; ++i) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * i));
    _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vd));
  }
}
struct VecF {
  using T = __m256;
  static constexpr int kWidth = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(T v) { return hsum(v); }
};
#else
inline void decode_q4_block(const uint8_t* c, float d, float z, float* out) {
  for (int j = 0; j < 16; ++j) out[j] = d * (c[j] & 0x0F) + z, out[16 + j] = d * (c[j] >> 4) + z;
}
inline void decode_q8_block(const int8_t* c, float d, float* out) {
  for (int j = 0; j < kGroup; ++j) out[j] = d * c[j];
}
template <int R>
inline void dot4(const float* w, int64_t K, const float* x, int64_t lda, float* out, int64_t ldo) {
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += w[i * K + k] * x[r * lda + k];
      out[r * ldo + i] = acc;
    }
}
#endif

#if defined(__AVX2__)
// out[r][i] = sum_k w_i[k] x_r[k] for 4 weight rows and R rows of x (K a multiple of 32), each
// an FMA chain over vectors then a lane sum.
template <int R>
inline void dot4(const float* w, int64_t K, const float* x, int64_t lda, float* out, int64_t ldo) {
  typename VecF::T acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = VecF::zero();
  for (int64_t k = 0; k < K; k += VecF::kWidth) {
    typename VecF::T wv[4];
    for (int i = 0; i < 4; ++i) wv[i] = VecF::load(w + i * K + k);
    for (int r = 0; r < R; ++r) {
      const typename VecF::T xv = VecF::load(x + r * lda + k);
      for (int i = 0; i < 4; ++i) acc[r][i] = VecF::fma(wv[i], xv, acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) out[r * ldo + i] = VecF::sum(acc[r][i]);
}
#endif

constexpr int64_t kPanel = 16;         // pack_linear_weight's panel width
constexpr int64_t kPanelMinRows = 48;  // batches this large take the fp32 tiles

// Columns [n0, n1) of y [M, N] (+ bias) from x [M, K] (row stride lda). A run of weight rows
// (~128 KB of them as fp32, a multiple of 4) is decoded into buf by decode(n, row); then each
// group of 4 rows of x (in L1) meets the run 4 weight rows at a time, so x is read once per run
// and each weight is decoded once per call. A last group of fewer than 4 weight rows is padded
// with zero rows (their outputs dropped): every output is the same FMA chain whichever range it
// falls in.
template <class Decode>
void dense_cols(Decode decode, int64_t N, int64_t K, const float* x, int64_t lda,
                const float* bias, float* y, int64_t M, int64_t n0, int64_t n1) {
  if (M >= kPanelMinRows) {
    // Whole panels of 16 columns (callers start ranges on one): decoded, laid out as
    // pack_linear_weight's panels, and multiplied by the fp32 path's own tiles (gemm.cpp).
    constexpr int64_t kGroupPanels = 3;  // the wide tiles' width (tile.h)
    std::vector<float> rowbuf(kPanel * K), panels(kGroupPanels * kPanel * K);
    while (n0 + kPanel <= n1) {
      const int64_t np = std::min(kGroupPanels, (n1 - n0) / kPanel);
      for (int64_t p = 0; p < np; ++p) {
        float* panel = panels.data() + p * kPanel * K;
        for (int64_t i = 0; i < kPanel; ++i) decode(n0 + p * kPanel + i, rowbuf.data() + i * K);
        for (int64_t k = 0; k < K; ++k)
          for (int64_t i = 0; i < kPanel; ++i) panel[k * kPanel + i] = rowbuf[i * K + k];
      }
      linear_panels(x, lda, M, K, panels.data(), np * kPanel, bias ? bias + n0 : nullptr, y + n0,
                    0, np, N);
      n0 += np * kPanel;
    }
  }
  const int64_t run = std::max<int64_t>(4, (32768 / K) / 4 * 4);
  std::vector<float> buf(run * K);
  for (int64_t nr0 = n0; nr0 < n1; nr0 += run) {
    const int64_t rows = std::min(run, n1 - nr0), padded = (rows + 3) / 4 * 4;
    for (int64_t i = 0; i < padded; ++i) {
      if (i < rows) decode(nr0 + i, buf.data() + i * K);
      else std::fill(buf.data() + i * K, buf.data() + (i + 1) * K, 0.f);
    }
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t mr = std::min<int64_t>(4, M - m);
      const float* xm = x + m * lda;
      for (int64_t g = 0; g < padded; g += 4) {
        float out[4][4];
        const float* wg = buf.data() + g * K;
        switch (mr) {
          case 4: dot4<4>(wg, K, xm, lda, out[0], 4); break;
          case 3: dot4<3>(wg, K, xm, lda, out[0], 4); break;
          case 2: dot4<2>(wg, K, xm, lda, out[0], 4); break;
          default: dot4<1>(wg, K, xm, lda, out[0], 4);
        }
        const int64_t n = nr0 + g, nr = std::min<int64_t>(4, rows - g);
        for (int64_t r = 0; r < mr; ++r)
          for (int64_t i = 0; i < nr; ++i)
            y[(m + r) * N + n + i] = out[r][i] + (bias ? bias[n + i] : 0.f);
      }
    }
  }
}

}  // namespace

void q4_dense_cols(const Q4Linear& w, const float* x, int64_t lda, const float* bias, float* y,
                   int64_t M, int64_t n0, int64_t n1) {
  const int64_t nb = w.K / kGroup;
  dense_cols(
      [&](int64_t n, float* out) {
        for (int64_t b = 0; b < nb; ++b)
          decode_q4_block(w.codes + (n * nb + b) * 16, w.d[n * nb + b], w.z[n * nb + b],
                          out + b * kGroup);
      },
      w.N, w.K, x, lda, bias, y, M, n0, n1);
}

void q8_dense_cols(const Q8Linear& w, const float* x, int64_t lda, float* y, int64_t M,
                   int64_t n0, int64_t n1) {
  const int64_t nb = w.K / kGroup;
  dense_cols(
      [&](int64_t n, float* out) {
        for (int64_t b = 0; b < nb; ++b)
          decode_q8_block(w.codes + n * w.K + b * kGroup, w.d[n * nb + b], out + b * kGroup);
      },
      w.N, w.K, x, lda, nullptr, y, M, n0, n1);
}

namespace {
// One row takes the integer form only where AVX-512 is missing: on AVX2 it decodes a block in ~22
// instructions against the integer form's ~14 a row, and one row is then compute-bound.
#if defined(__AVX512F__)
std::atomic<int64_t> g_dense_min_rows{1};
#else
std::atomic<int64_t> g_dense_min_rows{2};
#endif
}  // namespace
int64_t quant_dense_min_rows() { return g_dense_min_rows.load(std::memory_order_relaxed); }
void set_quant_dense_min_rows(int64_t rows) { g_dense_min_rows.store(rows); }

Q4Linear q4_weight(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& z) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 16 && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous(),
              "codes must be contiguous [N, K/32, 16] uint8");
  const int64_t N = codes.size(0), nb = codes.size(1);
  TORCH_CHECK(d.sizes() == z.sizes() && d.size(0) == N && d.size(1) == nb &&
                  d.scalar_type() == at::kFloat && z.scalar_type() == at::kFloat &&
                  d.is_contiguous() && z.is_contiguous(),
              "d, z: contiguous fp32 [N, K/32]");
  return Q4Linear{codes.data_ptr<uint8_t>(), d.data_ptr<float>(), z.data_ptr<float>(), N,
                  nb * kGroup};
}


at::Tensor q4_linear(at::Tensor x, at::Tensor codes, at::Tensor d, at::Tensor z, int64_t form) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] fp32");
  const Q4Linear w = q4_weight(codes, d, z);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K == w.K, "x has ", K, " columns, the weights ", w.K);
  auto y = at::empty({M, w.N}, x.options());
  if (form == 1 || (form < 0 && M >= quant_dense_min_rows())) {
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    // ranges of whole panels (the last may be short), as the decode stack splits them
    ts::parallel_for(0, (w.N + 15) / 16, 4, [&](int64_t p0, int64_t p1) {
      q4_dense_cols(w, xp, K, nullptr, yp, M, p0 * 16, std::min(w.N, p1 * 16));
    });
    return y;
  }
  Q4Acts a;
  a.resize(M, K);
  q4_quantize_rows(x.data_ptr<float>(), K, K, 0, M, a);
  float* yp = y.data_ptr<float>();
  ts::parallel_for(0, w.N, 64, [&](int64_t n0, int64_t n1) {
    q4_linear_cols(w, a, nullptr, yp, M, n0, n1);
  });
  return y;
}

at::Tensor q8_linear(at::Tensor x, at::Tensor codes, at::Tensor d, int64_t form) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] fp32");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes must be contiguous [N, K] int8");
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(K % kGroup == 0 && d.dim() == 2 && d.size(0) == N && d.size(1) == K / kGroup &&
                  d.scalar_type() == at::kFloat && d.is_contiguous(),
              "d: contiguous fp32 [N, K/32]");
  x = x.contiguous();
  const int64_t M = x.size(0);
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weights ", K);
  const Q8Linear w{codes.data_ptr<int8_t>(), d.data_ptr<float>(), N, K};
  auto y = at::empty({M, N}, x.options());
  if (form == 1 || (form < 0 && M >= quant_dense_min_rows())) {
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    ts::parallel_for(0, (N + 15) / 16, 16, [&](int64_t p0, int64_t p1) {
      q8_dense_cols(w, xp, K, yp, M, p0 * 16, std::min(N, p1 * 16));
    });
    return y;
  }
  Q4Acts a;
  a.resize(M, K);
  q4_quantize_rows(x.data_ptr<float>(), K, K, 0, M, a);
  float* yp = y.data_ptr<float>();
  ts::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) { q8_linear_cols(w, a, yp, M, n0, n1); });
  return y;
}
