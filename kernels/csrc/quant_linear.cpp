// y = x W^T (+ b) for weights kept in groups of 32 along the input: 4-bit (GGUF's Q4_0 / Q4_1
// blocks, or int4 from any weights; w = d q + z, q in 0..15) and 8-bit (GGUF's Q8_0, or int8 from
// any weights: w = d q, q in -127..127, or with an offset, w = d q + z, q in 0..255), issue 31.
// The 8-bit form with an offset also holds GGUF's 5- and 6-bit blocks exactly (issue 45: Q5_0,
// Q5_1, Q5_K as codes 0..31, Q6_K as 0..63 with d and z per group of 16, Q4_K as the 4-bit form:
// each is w = d q + z with d and z exact in fp32, so one FMA gives gguf's value; see
// engine/worker/quant.py's kquant_groups).
//
// The weights are decoded to fp32 as they are used and multiplied in fp32 in the fp32 path's own
// order: every output is one FMA chain over k, from the bias (or 0), k ascending, as the packed
// fp32 tiles (gemm.cpp, tile.h) compute it. The decoded weight is exactly what gguf's dequantize
// gives (d q is exact in fp32; Q4_1's d q + m rounds once, as numpy's does), so a GGUF served with
// --quantization gguf gives the fp32 path's logits to the bit, from a fifth of the bytes, and a
// row's result does not depend on the batch it is in.
//
// Layout ("panel order", pack_linear_weight's panels of 16 output rows, packed once at load):
//   4-bit codes [NP, K/32, 16, 16] bytes: for panel p, block b, byte (j, i) holds row 16p + i's
//         codes at k = 32b + j (low nibble) and 32b + 16 + j (high nibble);
//   8-bit codes [NP, K, 16] int8 (uint8 with an offset): row 16p + i's code at k;
//   d, z  [NP, K/32, 16] fp32: the 16 rows' scale (and zero) for a block ([NP, K/16, 16] for
//         8-bit codes in groups of 16: two per block of 32).
// One 16-byte load then gives 16 output columns' weights for one k (two for 4-bit), the shape the
// fp32 tiles take, with no transpose.
//
// Two ways through, chosen by the batch (both give the same bits):
//   - up to kRegRows (2 x kFusedRows) rows of x: decode a k's 16 weights into registers and take
//     them straight to the rows' accumulators (kFusedPanels panels at once up to kFusedRows rows,
//     fewer past it, so the FMA chains overlap and the accumulators stay in registers);
//   - more rows: decode up to 3 panels into an fp32 buffer laid out as pack_linear_weight's and
//     run the fp32 path's tiles (linear_panels) over it: each weight decoded once per call.
#include "ops.h"
#include "thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;  // weights per block
constexpr int64_t kP = 16;      // output rows per panel

#if defined(__AVX512F__)
constexpr int kFusedRows = 4, kFusedPanels = 4;
// 16 floats: one panel's row of weights, or its accumulators for one row of x.
struct V16 {
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  // acc + x w (x broadcast), as the fp32 tiles' _mm512_fmadd_ps(a, p, c)
  void fma(float x, const V16& w) { v = _mm512_fmadd_ps(_mm512_set1_ps(x), w.v, v); }
  void store(float* p, int64_t n) const {
    if (n == kP) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
  // 16 codes (bytes, 0..255 or int8) widened to fp32
  static V16 from_u8(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))}; }
  static V16 from_s8(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))}; }
  V16 times_plus(const V16& d, const V16& z) const { return {_mm512_fmadd_ps(v, d.v, z.v)}; }
  V16 times(const V16& d) const { return {_mm512_mul_ps(v, d.v)}; }
};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kFusedRows = 2, kFusedPanels = 2;
struct V16 {
  __m256 lo, hi;
  static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  void fma(float x, const V16& w) {
    const __m256 a = _mm256_set1_ps(x);
    lo = _mm256_fmadd_ps(a, w.lo, lo), hi = _mm256_fmadd_ps(a, w.hi, hi);
  }
  void store(float* p, int64_t n) const {
    alignas(32) float t[16];
    _mm256_store_ps(t, lo), _mm256_store_ps(t + 8, hi);
    std::copy(t, t + n, p);
  }
  static V16 from_u8(__m128i b) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
  }
  static V16 from_s8(__m128i b) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
  }
  V16 times_plus(const V16& d, const V16& z) const {
    return {_mm256_fmadd_ps(lo, d.lo, z.lo), _mm256_fmadd_ps(hi, d.hi, z.hi)};
  }
  V16 times(const V16& d) const { return {_mm256_mul_ps(lo, d.lo), _mm256_mul_ps(hi, d.hi)}; }
};
#else
constexpr int kFusedRows = 1, kFusedPanels = 1;
struct V16 {
  float v[16];
  static V16 zero() { return V16{}; }
  static V16 load(const float* p) {
    V16 r;
    std::copy(p, p + 16, r.v);
    return r;
  }
  void fma(float x, const V16& w) {  // as gemm.cpp's panel_scalar writes it
    for (int i = 0; i < 16; ++i) v[i] += x * w.v[i];
  }
  void store(float* p, int64_t n) const { std::copy(v, v + n, p); }
  static V16 from_u8(__m128i b) {
    alignas(16) uint8_t t[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), b);
    V16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = t[i];
    return r;
  }
  static V16 from_s8(__m128i b) {
    alignas(16) int8_t t[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), b);
    V16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = t[i];
    return r;
  }
  V16 times_plus(const V16& d, const V16& z) const {
    V16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = __builtin_fmaf(v[i], d.v[i], z.v[i]);
    return r;
  }
  V16 times(const V16& d) const {
    V16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = v[i] * d.v[i];
    return r;
  }
};
#endif

inline __m128i load16(const void* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// A weight format's k-th row of 16 weights in panel p, block by block: begin(p, b) loads the
// block's scales, row(j) gives k = 32b + j.
struct Q4Rows {
  const Q4Linear* w;
  int64_t nb;
  const uint8_t* c = nullptr;
  V16 d, z;
  void begin(int64_t p, int64_t b) {
    const int64_t at = (p * nb + b) * kP;
    c = w->codes + at * kP, d = V16::load(w->d + at), z = V16::load(w->z + at);
  }
  V16 row(int64_t j) const {
    const __m128i raw = load16(c + (j & 15) * kP);
    const __m128i q = j < 16 ? _mm_and_si128(raw, _mm_set1_epi8(0x0F))
                             : _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
    return V16::from_u8(q).times_plus(d, z);
  }
};

// 8-bit: signed codes, w = d q (kOffset false), or unsigned ones with an offset, w = d q + z;
// kHalves: d and z per 16 weights (a block's second half has its own).
template <bool kOffset, bool kHalves = false>
struct Q8Rows {
  const Q8Linear* w;
  int64_t nb;
  const uint8_t* c = nullptr;
  V16 d, z, d1, z1;
  void begin(int64_t p, int64_t b) {
    constexpr int64_t per = kHalves ? 2 : 1;
    const int64_t at = (p * nb * per + b * per) * kP;
    c = w->codes + (p * w->K + b * kGroup) * kP, d = V16::load(w->d + at);
    if (kOffset) z = V16::load(w->z + at);
    if (kHalves) d1 = V16::load(w->d + at + kP);
    if (kHalves && kOffset) z1 = V16::load(w->z + at + kP);
  }
  V16 row(int64_t j) const {
    const V16& dj = kHalves && j >= 16 ? d1 : d;
    const V16& zj = kHalves && j >= 16 ? z1 : z;
    return kOffset ? V16::from_u8(load16(c + j * kP)).times_plus(dj, zj)
                   : V16::from_s8(load16(c + j * kP)).times(dj);
  }
};

// The 8-bit format's forms, by whether the weight has an offset and its group size.
template <class F>
void with_q8_rows(const Q8Linear& w, F f) {
  const int64_t nb = w.K / kGroup;
  if (w.group == 16 && w.z) f(Q8Rows<true, true>{&w, nb});
  else if (w.group == 16) f(Q8Rows<false, true>{&w, nb});
  else if (w.z) f(Q8Rows<true>{&w, nb});
  else f(Q8Rows<false>{&w, nb});
}

// Panel p decoded into out [K, 16] (pack_linear_weight's layout of one panel).
template <class Rows>
void decode_panel(Rows rows, int64_t p, int64_t K, float* out) {
  for (int64_t b = 0; b < K / kGroup; ++b) {
    rows.begin(p, b);
    for (int64_t k = 0; k < kGroup; ++k) rows.row(k).store(out + (b * kGroup + k) * kP, kP);
  }
}

// Panels [p, p + NPAN) for R rows of x: the weights decoded k by k into registers.
template <int R, int NPAN, class Rows>
void fused_tile(Rows rows[NPAN], int64_t p, int64_t K, const float* x, int64_t lda,
                const float* bias, float* y, int64_t ldy, int64_t N) {
  V16 acc[R][NPAN];
  for (int j = 0; j < NPAN; ++j) {
    const V16 b0 = bias ? V16::load(bias + (p + j) * kP) : V16::zero();
    for (int r = 0; r < R; ++r) acc[r][j] = b0;
  }
  const int64_t nb = K / kGroup;
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < NPAN; ++j) rows[j].begin(p + j, b);
    const float* xb = x + b * kGroup;
    for (int64_t k = 0; k < kGroup; ++k)
      for (int j = 0; j < NPAN; ++j) {
        const V16 wv = rows[j].row(k);
        for (int r = 0; r < R; ++r) acc[r][j].fma(xb[r * lda + k], wv);
      }
  }
  for (int j = 0; j < NPAN; ++j) {
    const int64_t n = (p + j) * kP, width = std::min(kP, N - n);
    for (int r = 0; r < R; ++r) acc[r][j].store(y + r * ldy + n, width);
  }
}

// Up to kRegRows rows of x go through the registers in one pass over the weights: past
// kFusedRows, fewer panels at once, so the accumulators (R x panels vectors) still fit.
constexpr int kRegRows = 2 * kFusedRows;
template <int R>
constexpr int kPanelsFor = R <= kFusedRows ? kFusedPanels
                                           : std::max(1, kFusedPanels * kFusedRows / R);

template <int R, class Rows>
void fused_rows(Rows proto, int64_t K, const float* x, int64_t lda, const float* bias, float* y,
                int64_t ldy, int64_t N, int64_t p0, int64_t p1) {
  constexpr int NPAN = kPanelsFor<R>;
  Rows rows[NPAN];
  for (auto& r : rows) r = proto;
  int64_t p = p0;
  for (; p + NPAN <= p1; p += NPAN) fused_tile<R, NPAN>(rows, p, K, x, lda, bias, y, ldy, N);
  for (; p < p1; ++p) fused_tile<R, 1>(rows, p, K, x, lda, bias, y, ldy, N);
}

// Panels [p0, p1) of y [M, N] (row stride ldy) from x [M, K] (row stride lda), + bias (whole
// panels long) where given. Up to kRegRows rows (a decode batch, or a speculative row's 1 + k
// positions): one pass from the registers; more: the panels decoded into a buffer for the fp32
// tiles (the same products in the same order either way).
template <class Rows>
void panels(Rows proto, int64_t K, const float* x, int64_t lda, const float* bias, float* y,
            int64_t ldy, int64_t M, int64_t N, int64_t p0, int64_t p1) {
  if (M > kRegRows) {
    constexpr int64_t kGroupPanels = 3;  // the wide tiles' width (tile.h)
    std::vector<float> buf(kGroupPanels * K * kP);
    for (int64_t p = p0; p < p1; p += kGroupPanels) {
      const int64_t np = std::min(kGroupPanels, p1 - p);
      for (int64_t j = 0; j < np; ++j) decode_panel(proto, p + j, K, buf.data() + j * K * kP);
      linear_panels(x, lda, M, K, buf.data(), std::min(np * kP, N - p * kP),
                    bias ? bias + p * kP : nullptr, y + p * kP, 0, np, ldy);
    }
    return;
  }
  switch (M) {
#if defined(__AVX512F__)
    case 8: fused_rows<8>(proto, K, x, lda, bias, y, ldy, N, p0, p1); break;
    case 7: fused_rows<7>(proto, K, x, lda, bias, y, ldy, N, p0, p1); break;
    case 6: fused_rows<6>(proto, K, x, lda, bias, y, ldy, N, p0, p1); break;
    case 5: fused_rows<5>(proto, K, x, lda, bias, y, ldy, N, p0, p1); break;
#endif
#if defined(__AVX2__)
    case 4: fused_rows<4>(proto, K, x, lda, bias, y, ldy, N, p0, p1); break;
    case 3: fused_rows<3>(proto, K, x, lda, bias, y, ldy, N, p0, p1); break;
    case 2: fused_rows<2>(proto, K, x, lda, bias, y, ldy, N, p0, p1); break;
#endif
    default:  // 1 row, or the scalar build: row by row
      for (int64_t m = 0; m < M; ++m)
        fused_rows<1>(proto, K, x + m * lda, lda, bias, y + m * ldy, ldy, N, p0, p1);
  }
}

}  // namespace

void q4_linear_panels(const Q4Linear& w, const float* x, int64_t lda, const float* bias, float* y,
                      int64_t ldy, int64_t M, int64_t p0, int64_t p1) {
  panels(Q4Rows{&w, w.K / kGroup}, w.K, x, lda, bias, y, ldy, M, w.N, p0, p1);
}

void q8_linear_panels(const Q8Linear& w, const float* x, int64_t lda, const float* bias, float* y,
                      int64_t ldy, int64_t M, int64_t p0, int64_t p1) {
  with_q8_rows(w, [&](auto rows) { panels(rows, w.K, x, lda, bias, y, ldy, M, w.N, p0, p1); });
}

namespace {

void check_scales(const at::Tensor& t, int64_t NP, int64_t nb, const char* what) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == NP && t.size(1) == nb && t.size(2) == kP &&
                  t.scalar_type() == at::kFloat && t.is_contiguous(),
              what, ": contiguous fp32 [N/16, ", nb, " (K/32, or K/16 for groups of 16), 16]");
}

// y [M, N] (+ bias) by `run` over whole panels, split between the pool's threads.
template <class Run>
at::Tensor run_linear(at::Tensor x, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias,
                      Run run) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] fp32");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weights ", K);
  x = x.contiguous();
  const int64_t M = x.size(0), NP = (N + kP - 1) / kP;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = panel_bias(bias->contiguous(), NP);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  ts::parallel_for(0, NP, 4, [&](int64_t p0, int64_t p1) { run(xp, K, bp, yp, N, M, p0, p1); });
  return y;
}

}  // namespace

Q4Linear q4_weight(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& z, int64_t N) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kP && codes.size(3) == kP &&
                  codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "4-bit codes: contiguous [N/16, K/32, 16, 16] uint8");
  const int64_t NP = codes.size(0), nb = codes.size(1);
  TORCH_CHECK(N > (NP - 1) * kP && N <= NP * kP, "4-bit codes hold ", NP, " panels, not ", N,
              " rows");
  check_scales(d, NP, nb, "d");
  check_scales(z, NP, nb, "z");
  return Q4Linear{codes.data_ptr<uint8_t>(), d.data_ptr<float>(), z.data_ptr<float>(), N,
                  nb * kGroup};
}

Q8Linear q8_weight(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& z,
                   int64_t N) {
  const bool offset = z.defined() && z.numel() > 0;
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kP && codes.is_contiguous() &&
                  codes.size(1) % kGroup == 0 &&
                  codes.scalar_type() == (offset ? at::kByte : at::kChar),
              "8-bit codes: contiguous [N/16, K, 16], int8 (or uint8 with an offset z)");
  const int64_t NP = codes.size(0), K = codes.size(1);
  TORCH_CHECK(N > (NP - 1) * kP && N <= NP * kP, "8-bit codes hold ", NP, " panels, not ", N,
              " rows");
  const int64_t group = d.dim() == 3 && d.size(1) == K / 16 ? 16 : kGroup;
  check_scales(d, NP, K / group, "d");
  if (offset) check_scales(z, NP, K / group, "z");
  return Q8Linear{static_cast<const uint8_t*>(codes.data_ptr()), d.data_ptr<float>(),
                  offset ? z.data_ptr<float>() : nullptr, N, K, group};
}

namespace {

// The weight decoded to [N, K], fp32 or rounded to bf16 (for --prefill-bf16's GEMMs), panels split
// between the pool's threads: each panel's rows decoded k by k, then written row by row.
template <class Rows, class Out>
at::Tensor decode_all(Rows proto, int64_t N, int64_t K) {
  auto out = at::empty({N, K}, at::TensorOptions().dtype(c10::CppTypeToScalarType<Out>::value));
  Out* o = out.template data_ptr<Out>();
  const int64_t NP = (N + kP - 1) / kP;
  ts::parallel_for(0, NP, 4, [&](int64_t p0, int64_t p1) {
    std::vector<float> panel(K * kP);
    for (int64_t p = p0; p < p1; ++p) {
      decode_panel(proto, p, K, panel.data());
      for (int64_t i = 0; i < std::min(kP, N - p * kP); ++i)
        for (int64_t k = 0; k < K; ++k) o[(p * kP + i) * K + k] = Out(panel[k * kP + i]);
    }
  });
  return out;
}

// The weight decoded and rounded to bf16, for --prefill-bf16's GEMMs, as the [N, K] view of a
// [K, N] buffer: a panel's 16 values at each k are 16 neighbours there (written in one run, where
// [N, K] scatters them a row apart), and x W^T reads W^T = the buffer as it lies.
template <class Rows>
at::Tensor decode_bf16_kn(Rows proto, int64_t N, int64_t K) {
  auto out = at::empty({K, N}, at::TensorOptions().dtype(at::kBFloat16));
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const int64_t NP = (N + kP - 1) / kP;
  ts::parallel_for(0, NP, 4, [&](int64_t p0, int64_t p1) {
    std::vector<float> panel(K * kP);
    for (int64_t p = p0; p < p1; ++p) {
      decode_panel(proto, p, K, panel.data());
      const int64_t rows = std::min(kP, N - p * kP);
      for (int64_t k = 0; k < K; ++k) {
        c10::BFloat16* dst = o + k * N + p * kP;
        const float* src = panel.data() + k * kP;
        for (int64_t i = 0; i < rows; ++i) dst[i] = c10::BFloat16(src[i]);
      }
    }
  });
  return out.t();
}

}  // namespace

template <class Rows>
at::Tensor decode_as(Rows rows, int64_t N, int64_t K, bool bf16) {
  return bf16 ? decode_bf16_kn<Rows>(rows, N, K) : decode_all<Rows, float>(rows, N, K);
}

at::Tensor q4_decode(at::Tensor codes, at::Tensor d, at::Tensor z, int64_t n, bool bf16) {
  const Q4Linear w = q4_weight(codes, d, z, n);
  return decode_as(Q4Rows{&w, w.K / kGroup}, w.N, w.K, bf16);
}

at::Tensor q8_decode(at::Tensor codes, at::Tensor d, int64_t n, c10::optional<at::Tensor> z,
                     bool bf16) {
  const Q8Linear w = q8_weight(codes, d, z.value_or(at::Tensor()), n);
  at::Tensor out;
  with_q8_rows(w, [&](auto rows) { out = decode_as(rows, w.N, w.K, bf16); });
  return out;
}

at::Tensor q4_linear(at::Tensor x, at::Tensor codes, at::Tensor d, at::Tensor z, int64_t n,
                     c10::optional<at::Tensor> bias) {
  const Q4Linear w = q4_weight(codes, d, z, n);
  return run_linear(x, w.N, w.K, bias,
                    [&](const float* xp, int64_t K, const float* bp, float* yp, int64_t N,
                        int64_t M, int64_t p0, int64_t p1) {
                      q4_linear_panels(w, xp, K, bp, yp, N, M, p0, p1);
                    });
}

at::Tensor q8_linear(at::Tensor x, at::Tensor codes, at::Tensor d, int64_t n,
                     c10::optional<at::Tensor> bias, c10::optional<at::Tensor> z) {
  const Q8Linear w = q8_weight(codes, d, z.value_or(at::Tensor()), n);
  return run_linear(x, w.N, w.K, bias,
                    [&](const float* xp, int64_t K, const float* bp, float* yp, int64_t N,
                        int64_t M, int64_t p0, int64_t p1) {
                      q8_linear_panels(w, xp, K, bp, yp, N, M, p0, p1);
                    });
}
