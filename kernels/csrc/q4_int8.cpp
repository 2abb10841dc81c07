// y = x W^T (+ b) for 4-bit weights (GGUF's Q4_0 / Q4_1, or int4 groups: w = d q + m, q in
// 0..15, one d and m per 32 weights) with the activations rounded to int8, so that the dot
// products are integer ones (llama.cpp's q4_1 x q8_1 scheme, with our own weight layout).
//
// Not the fp32 path's numbers: quant_linear.cpp's q4_linear decodes the weights to fp32 and gives
// the fp32 path's bits; here each row of x is rounded to int8 per block of 32, which moves y by
// ~0.5% of its norm (1-2% with outlier channels). The integer sums are exact and each row's fp32
// steps run in the same order whatever the batch, so a row's y is the same bits at any M and
// thread count. At M = 1 it reads 0.625 bytes a weight and is bound by memory (2-2.5x faster
// than q4_linear on a 2-core AVX2 EPYC); at M = 8 it does not fall back to fp32 tiles as
// q4_linear does (5-8x faster). Without AVX2 (with FMA and F16C, which every AVX2 CPU has) the
// same arithmetic runs one output at a time, to the same bits.
//
// Activations (q8_quantize_rows): per row, per block of 32: dx = max|x| / 127,
// xq = round(x / dx) in -127..127 (all 0 where max|x| < 1e-30), sx = dx * sum(xq). Then
//   y[n] = sum_b dx_b d_nb sum_k xq_k q_nk + sx_b m_nb           (+ bias[n]).
//
// Weights (q4i8_pack): groups of 16 output rows; for group g and block b (32 k) one 320-byte unit,
// units in (g, b) order, so a group's K/32 units are one contiguous stream for one thread. A unit
// is two 160-byte halves h = 0, 1 for rows 16g + 8h + r, r = 0..7:
//   bytes   0..15   d of the 8 rows, fp16 (exact for GGUF's blocks; int4's fp32 scales round once)
//   bytes  16..31   m of the 8 rows, fp16 (Q4_0: m = -8 d)
//   bytes  32..159  4 vectors of 32 bytes; vector v, byte 4r + t:
//                   low nibble  = code of row r at k = 32b + 4v + t        (step v)
//                   high nibble = code of row r at k = 32b + 16 + 4v + t   (step v + 4)
// A 32-byte load is then 8 rows x 4 consecutive k: _mm256_maddubs_epi16 against x's 4 bytes at
// that step broadcast to every lane gives row r's two partial products in int16 lanes 2r, 2r+1,
// both halves share one broadcast, and no horizontal sum is ever needed. The 8 steps of a block
// add in int16, bounded by 8 steps x 2 x 15 x 127 = 30480 < 32767; one madd with ones widens to
// 8 int32 (one per row), and one FMA by d_w[8] * dx puts the block into y's 8 fp32 accumulators.
// The m terms (m_w[8] * sx) run in a second pass over the group's units (in L1 by then), so the
// main loop carries only the d accumulators.
//
// Other block formats get their own unit beside this one (names here say Q4 for that reason):
//   - 5-bit codes (Q5_0 / Q5_1): the fifth bits in a plane after the nibbles (4 bytes a row, 32
//     for 8 rows), or'ed in per step; pairs reach 2 x 31 x 127 = 7874, so at most 4 steps add in
//     int16 before the madd to int32 (4 x 7874 = 31496).
//   - 6-bit codes (Q6_K, 16 weights per scale): a plane of 2-bit high parts; 2 x 63 x 127 = 16002
//     allows 2 steps in int16, and x needs its sums per 16 for the offset.
//   - scales not exact in fp16 (Q4_K / Q6_K's per-32 d sc_j and dmin mn_j, 11 + 6 bits): fp32
//     d and m in the unit (64 bytes a half), or the integer sub-block scales kept and applied by
//     madd_epi16 in place of the ones (then one fp32 step per 256 weights).
//   - VNNI (dpbusd) removes the int16 bound altogether.
#include "ops.h"
#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q4I8_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kQ8Block = 32;            // activations per dx, sx
constexpr int64_t kQ4Block = 32;            // weights per d, m
constexpr int64_t kQ4Rows = 16;             // output rows per group
constexpr int64_t kQ4HalfRows = 8;          // output rows per half unit
constexpr int64_t kQ4Half = 16 + 16 + 128;  // d, m, codes of 8 rows x 32 k
constexpr int64_t kQ4Unit = 2 * kQ4Half;    // bytes per (group, block)
constexpr int64_t kMaxXRows = 4;            // rows of x per pass over the weights (registers)
constexpr int64_t kRunBytes = 16384;        // units re-read per slice of rows: L1-sized
constexpr int64_t kPrefetch = 8 * kQ4Unit;  // bytes ahead (measured: 5-15% when streaming)

int64_t q4_groups_for(int64_t N) { return (N + kQ4Rows - 1) / kQ4Rows; }

// The byte of a unit that holds row r's (0..15) code at k = j (0..31) of the block: its low
// nibble for j < 16, its high nibble for j >= 16.
inline int64_t q4_code_at(int64_t r, int64_t j) {
  const int64_t step = j % 16;
  return (r / kQ4HalfRows) * kQ4Half + 32 + 32 * (step / 4) + 4 * (r % kQ4HalfRows) + step % 4;
}

// The byte of a unit that holds row r's d (m 16 bytes on).
inline int64_t q4_scale_at(int64_t r) {
  return (r / kQ4HalfRows) * kQ4Half + 2 * (r % kQ4HalfRows);
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline void half_put(uint8_t* p, float v) {
  const uint16_t bits = c10::Half(v).x;  // nearest-even, as _cvtss_sh
  std::memcpy(p, &bits, 2);
}

// Output rows [0, rows) of 8 (rows may be <= 0 or > 8) from v, plus bias where given.
inline void store_rows(float* y, const float* v, const float* bias, int64_t rows) {
  for (int64_t i = 0; i < std::min(rows, kQ4HalfRows); ++i) y[i] = bias ? v[i] + bias[i] : v[i];
}

// A block's max|x| for its scale: below 1e-30 (where 127 / max would overflow to inf and the
// codes would be garbage) the block counts as zero: codes, dx and sx 0.
inline float q8_block_max(float amax) { return amax >= 1e-30f ? amax : 0.f; }

#if defined(Q4I8_AVX2)

// One block of 32 activations: its int8 codes, dx and sx.
inline void quantize_block(const float* x, int8_t* q, float* dx, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = q8_block_max(_mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))));
  const __m256 inv = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i)
    c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  // packs interleave the 128-bit lanes; the permute puts the 32 codes back in order
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                            _mm256_packs_epi32(c[2], c[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(packed, order));
  *dx = amax / 127.f;
  *sx = *dx * static_cast<float>(_mm_cvtsi128_si32(s4));
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline __m256 load_halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One unit's integer dot products with MR rows of x (row stride K) at block b: s[m][h] gets half
// h's 8 rows' sums as int16 pairs (lanes 2r, 2r + 1 belong to row r).
template <int MR>
inline void q4_unit_sums(const uint8_t* u, const int8_t* xq, int64_t K, int64_t b,
                         __m256i s[][2]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) {
    const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32 + 32 * v));
    const __m256i r1 =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + kQ4Half + 32 + 32 * v));
    const __m256i lo0 = _mm256_and_si256(r0, low4);
    const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), low4);
    const __m256i lo1 = _mm256_and_si256(r1, low4);
    const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), low4);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const int8_t* xb = xq + m * K + b * kQ4Block;
      const __m256i xl = _mm256_set1_epi32(load_i32(xb + 4 * v));
      const __m256i xh = _mm256_set1_epi32(load_i32(xb + 16 + 4 * v));
      s[m][0] = _mm256_add_epi16(s[m][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl),
                                                           _mm256_maddubs_epi16(hi0, xh)));
      s[m][1] = _mm256_add_epi16(s[m][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl),
                                                           _mm256_maddubs_epi16(hi1, xh)));
      // Keeps each sum a running one: left free, GCC reassociates the integer adds, makes all
      // 8 MR products first and spills them to the stack (measured 10-15% slower at MR = 4).
      __asm__("" : "+x"(s[m][0]), "+x"(s[m][1]));
    }
  }
}

// One group (16 output rows, all K) for MR rows of x: rows [0, rows) of y's rows m (stride ldy).
template <int MR>
void q4_group(const uint8_t* w, int64_t nb, const int8_t* xq, int64_t K, const float* dx,
              const float* sx, const float* bias, float* y, int64_t ldy, int64_t rows) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* u = w + b * kQ4Unit;
    for (int64_t o = 0; o < kQ4Unit; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(u + kPrefetch + o), _MM_HINT_T0);
    __m256i s[MR][2];
    for (int m = 0; m < MR; ++m) s[m][0] = s[m][1] = _mm256_setzero_si256();
    q4_unit_sums<MR>(u, xq, K, b, s);
    const __m256 d0 = load_halves8(u), d1 = load_halves8(u + kQ4Half);
    for (int m = 0; m < MR; ++m) {
      const __m256 xd = _mm256_set1_ps(dx[m * nb + b]);
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[m][0], ones)),
                                  _mm256_mul_ps(d0, xd), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[m][1], ones)),
                                  _mm256_mul_ps(d1, xd), acc[m][1]);
    }
  }
  for (int64_t b = 0; b < nb; ++b) {  // the m terms
    const uint8_t* u = w + b * kQ4Unit;
    const __m256 m0 = load_halves8(u + 16), m1 = load_halves8(u + kQ4Half + 16);
    for (int m = 0; m < MR; ++m) {
      const __m256 xs = _mm256_set1_ps(sx[m * nb + b]);
      acc[m][0] = _mm256_fmadd_ps(m0, xs, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(m1, xs, acc[m][1]);
    }
  }
  alignas(32) float t[kQ4Rows];
  for (int m = 0; m < MR; ++m) {
    _mm256_store_ps(t, acc[m][0]), _mm256_store_ps(t + kQ4HalfRows, acc[m][1]);
    store_rows(y + m * ldy, t, bias, rows);
    store_rows(y + m * ldy + kQ4HalfRows, t + kQ4HalfRows, bias ? bias + kQ4HalfRows : nullptr,
               rows - kQ4HalfRows);
  }
}

#else  // no AVX2: the same arithmetic one output at a time (integer sums exact, fp32 steps fused)

inline void quantize_block(const float* x, int8_t* q, float* dx, float* sx) {
  float amax = 0.f;
  for (int64_t k = 0; k < kQ8Block; ++k) amax = std::max(amax, std::fabs(x[k]));
  amax = q8_block_max(amax);
  const float inv = amax != 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t k = 0; k < kQ8Block; ++k) {
    q[k] = static_cast<int8_t>(std::nearbyint(x[k] * inv));  // nearest-even, as _mm256_round_ps
    sum += q[k];
  }
  *dx = amax / 127.f;
  *sx = *dx * static_cast<float>(sum);
}

// Output row r of a group for one row of x, in the AVX2 kernel's order of fp32 steps.
inline float q4_row_dot(const uint8_t* w, int64_t nb, int64_t r, const int8_t* xq,
                        const float* dx, const float* sx) {
  const int64_t at = q4_scale_at(r);
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* u = w + b * kQ4Unit;
    int32_t dot = 0;
    for (int64_t j = 0; j < kQ4Block; ++j) {
      const uint8_t byte = u[q4_code_at(r, j)];
      dot += (j < 16 ? byte & 15 : byte >> 4) * xq[b * kQ4Block + j];
    }
    acc = std::fma(static_cast<float>(dot), half_at(u + at) * dx[b], acc);
  }
  for (int64_t b = 0; b < nb; ++b) acc = std::fma(half_at(w + b * kQ4Unit + at + 16), sx[b], acc);
  return acc;
}

template <int MR>
void q4_group(const uint8_t* w, int64_t nb, const int8_t* xq, int64_t K, const float* dx,
              const float* sx, const float* bias, float* y, int64_t ldy, int64_t rows) {
  float t[kQ4Rows];
  for (int m = 0; m < MR; ++m) {
    for (int64_t r = 0; r < std::min(rows, kQ4Rows); ++r)
      t[r] = q4_row_dot(w, nb, r, xq + m * K, dx + m * nb, sx + m * nb);
    store_rows(y + m * ldy, t, bias, rows);
    store_rows(y + m * ldy + kQ4HalfRows, t + kQ4HalfRows, bias ? bias + kQ4HalfRows : nullptr,
               rows - kQ4HalfRows);
  }
}

#endif

// Groups [g0, g1) for MR rows of x.
template <int MR>
void q4_groups(const Q4I8Linear& w, const int8_t* xq, const float* dx, const float* sx,
               const float* bias, float* y, int64_t ldy, int64_t g0, int64_t g1) {
  const int64_t nb = w.K / kQ4Block;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n = g * kQ4Rows;
    q4_group<MR>(w.packed + g * nb * kQ4Unit, nb, xq, w.K, dx, sx, bias ? bias + n : nullptr,
                 y + n, ldy, w.N - n);
  }
}

void q4_groups_rows(int64_t mr, const Q4I8Linear& w, const int8_t* xq, const float* dx,
                    const float* sx, const float* bias, float* y, int64_t ldy, int64_t g0,
                    int64_t g1) {
  switch (mr) {
    case 1: return q4_groups<1>(w, xq, dx, sx, bias, y, ldy, g0, g1);
    case 2: return q4_groups<2>(w, xq, dx, sx, bias, y, ldy, g0, g1);
    case 3: return q4_groups<3>(w, xq, dx, sx, bias, y, ldy, g0, g1);
    case 4: return q4_groups<4>(w, xq, dx, sx, bias, y, ldy, g0, g1);
  }
}

}  // namespace

void q8_quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* xq, float* dx,
                      float* sx) {
  const int64_t nb = K / kQ8Block;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b)
      quantize_block(x + m * ldx + b * kQ8Block, xq + m * K + b * kQ8Block, dx + m * nb + b,
                     sx + m * nb + b);
}

// More than kMaxXRows rows of x: the groups in runs small enough to stay in L1, each run swept
// once per slice of rows (near-equal slices: 8 -> 4 + 4, 5 -> 3 + 2), so the weights still come
// from memory once. A row's arithmetic is the same in any slice (batch invariance).
void q4i8_linear_groups(const Q4I8Linear& w, const int8_t* xq, const float* dx, const float* sx,
                        int64_t M, const float* bias, float* y, int64_t ldy, int64_t g0,
                        int64_t g1) {
  if (M <= kMaxXRows) return q4_groups_rows(M, w, xq, dx, sx, bias, y, ldy, g0, g1);
  const int64_t nb = w.K / kQ4Block;
  const int64_t run = std::max<int64_t>(1, kRunBytes / (nb * kQ4Unit));
  const int64_t slices = (M + kMaxXRows - 1) / kMaxXRows;
  for (int64_t g = g0; g < g1; g += run) {
    const int64_t ge = std::min(g1, g + run);
    for (int64_t t = 0, m0 = 0; t < slices; ++t) {
      const int64_t mr = M / slices + (t < M % slices ? 1 : 0);
      q4_groups_rows(mr, w, xq + m0 * w.K, dx + m0 * nb, sx + m0 * nb, bias, y + m0 * ldy, ldy,
                     g, ge);
      m0 += mr;
    }
  }
}

Q4I8Linear q4i8_weight(const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) % kQ4Unit == 0 && packed.size(1) > 0,
              "q4i8 weight: contiguous uint8 [ceil(N/16), K/32 * ", kQ4Unit, "]");
  TORCH_CHECK(N > 0 && packed.size(0) == q4_groups_for(N), "q4i8 weight holds ", packed.size(0),
              " groups of 16 rows, not the ", q4_groups_for(N), " of ", N, " rows");
  return Q4I8Linear{packed.data_ptr<uint8_t>(), N, packed.size(1) / kQ4Unit * kQ4Block};
}

namespace {

// Group g's units from codes [N, K] and d, m [N, K/32] (rows past N stay zero); returns the
// codes' bits or'ed together, for the caller's range check.
uint8_t pack_group(const uint8_t* q, const float* d, const float* m, int64_t N, int64_t K,
                   int64_t g, uint8_t* out) {
  const int64_t nb = K / kQ4Block;
  uint8_t seen = 0;
  for (int64_t r = 0; r < std::min(kQ4Rows, N - g * kQ4Rows); ++r) {
    const int64_t n = g * kQ4Rows + r, at = q4_scale_at(r);
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* u = out + (g * nb + b) * kQ4Unit;
      half_put(u + at, d[n * nb + b]);
      half_put(u + at + 16, m[n * nb + b]);
      const uint8_t* c = q + n * K + b * kQ4Block;
      for (int64_t j = 0; j < 16; ++j) {
        u[q4_code_at(r, j)] = static_cast<uint8_t>((c[j] & 15) | (c[j + 16] << 4));
        seen |= c[j] | c[j + 16];
      }
    }
  }
  return seen;
}

void check_fp16_range(const at::Tensor& t, const char* what) {
  const float* p = t.data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i)
    TORCH_CHECK(std::isfinite(p[i]) && std::fabs(p[i]) <= 65504.f, "q4i8_pack: ", what, "[", i,
                "] = ", p[i], " does not fit the unit's fp16");
}

}  // namespace

at::Tensor q4i8_pack(at::Tensor q, at::Tensor d, at::Tensor m) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.size(1) % kQ4Block == 0,
              "q: uint8 codes [N, K], K a multiple of ", kQ4Block);
  const int64_t N = q.size(0), K = q.size(1), nb = K / kQ4Block;
  for (const at::Tensor* s : {&d, &m})
    TORCH_CHECK(s->dim() == 2 && s->size(0) == N && s->size(1) == nb &&
                    s->scalar_type() == at::kFloat,
                "d and m: fp32 [N, K/32] = [", N, ", ", nb, "]");
  q = q.contiguous(), d = d.contiguous(), m = m.contiguous();
  check_fp16_range(d, "d");
  check_fp16_range(m, "m");
  auto out = at::zeros({q4_groups_for(N), nb * kQ4Unit}, q.options());
  std::atomic<uint8_t> seen{0};
  ts::parallel_for(0, q4_groups_for(N), 16, [&](int64_t g0, int64_t g1) {
    uint8_t mine = 0;
    for (int64_t g = g0; g < g1; ++g)
      mine |= pack_group(q.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), N, K,
                         g, out.data_ptr<uint8_t>());
    seen.fetch_or(mine);
  });
  TORCH_CHECK(seen.load() < 16, "q4i8_pack: codes must be 0..15");
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> q8_quantize(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kQ8Block == 0,
              "x: fp32 [M, K], K a multiple of ", kQ8Block);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto xq = at::empty({M, K}, x.options().dtype(at::kChar));
  auto dx = at::empty({M, K / kQ8Block}, x.options());
  auto sx = at::empty({M, K / kQ8Block}, x.options());
  q8_quantize_rows(x.data_ptr<float>(), M, K, K, xq.data_ptr<int8_t>(), dx.data_ptr<float>(),
                   sx.data_ptr<float>());
  return {xq, dx, sx};
}

at::Tensor q4i8_linear(at::Tensor x, at::Tensor packed, int64_t n,
                       c10::optional<at::Tensor> bias) {
  const Q4I8Linear w = q4i8_weight(packed, n);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] fp32");
  TORCH_CHECK(x.size(1) == w.K, "x has ", x.size(1), " columns, the weights ", w.K);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == n, "bias must be fp32 [", n, "]");
  }
  const auto xq = q8_quantize(x);  // on this thread: 0.2-4 us, less than a wake-up
  const int8_t* q = std::get<0>(xq).data_ptr<int8_t>();
  const float *dx = std::get<1>(xq).data_ptr<float>(), *sx = std::get<2>(xq).data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t M = x.size(0);
  auto y = at::empty({M, n}, x.options());
  float* yp = y.data_ptr<float>();
  ts::parallel_for(0, q4_groups_for(n), 4, [&](int64_t g0, int64_t g1) {
    q4i8_linear_groups(w, q, dx, sx, M, bp, yp, n, g0, g1);
  });
  return y;
}
