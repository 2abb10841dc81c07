// The native CPU ops of the tierserve extension (bindings.cpp exposes them to Python).
// Only the ATen headers the kernels use, not <torch/extension.h> (the C++ frontend and Python,
// which every file including it parsed): the first start's build took ~4x longer with it.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

// e^x: range reduction to 2^k * e^r, |r| <= ln2/2, degree-6 polynomial (about 2 ulp); inputs
// clamped to [-87, 88]. Branch-free so `omp simd` loops vectorize it.
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float k = __builtin_rintf(x * 1.44269504088896341f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
// fast_exp on 8 lanes with the same steps, for loops GCC does not vectorize itself (it leaves
// fast_exp scalar in some of them: "control flow in loop").
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(k, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.3981999507e-3f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// KV caches hold fp32 or fp16 (at::Half, `--kv-cache-dtype float16`). fp16 rows are widened to
// fp32 as they are read (exact), so a kernel computes on them what it computes on an fp32 cache
// holding the same values; they are rounded to nearest-even as they are stored, as
// tensor.to(torch.float16) rounds. F16C (any AVX2 CPU) converts 8 values per instruction.
inline void kv_to_float(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
// n cache values as fp32: an fp32 cache's own memory, an fp16 cache's widened into buf.
inline const float* kv_row(const float* src, float*, int64_t) { return src; }
inline const float* kv_row(const at::Half* src, float* buf, int64_t n) {
  kv_to_float(src, buf, n);
  return buf;
}
inline void kv_from_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void kv_from_float(const float* src, at::Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = at::Half(src[i]);
}

// Whether the native kernels read and write this KV cache's dtype.
inline bool kv_dtype_supported(const at::Tensor& kv_cache) {
  return kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kHalf;
}

// Boundaries 0 = c[0] <= c[1] <= ... <= c[parts] = n that cut items 0..n-1 into `parts` runs of
// about equal total cost, for work whose items differ in cost (attention over contexts of
// different lengths): a thread that finishes early leaves the other alone with the memory bus.
inline std::vector<int64_t> balanced_cuts(const std::vector<int64_t>& cost, int64_t parts) {
  const int64_t n = static_cast<int64_t>(cost.size());
  parts = std::max<int64_t>(1, std::min(parts, n));
  std::vector<int64_t> cut(parts + 1, n);
  cut[0] = 0;
  int64_t total = 0, seen = 0;
  for (int64_t c : cost) total += c;
  for (int64_t i = 0, part = 1; i < n && part < parts; ++i) {
    seen += cost[i];
    while (part < parts && seen * parts >= total * part) cut[part++] = i + 1;
  }
  return cut;
}

// Paged decode attention, fp32: q [B, H, D], kv_cache [2, Hkv, S, D] (fp32 or fp16) -> [B, H, D];
// window > 0: each sequence attends only its last `window` tokens (a sliding-window layer's).
at::Tensor paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                           at::Tensor context_lens, int64_t block_size, double scale,
                           int64_t window = 0);

// Sparse (Quest top-k block) paged decode (sparse_decode.cpp): per (sequence, KV head), the
// first and newest blocks plus the topk - 2 others whose key summary bounds q.k highest, summed
// over the GQA group; all blocks where topk is 0 or n = ceil(context / block_size) <= topk (then
// bit-identical to paged_decode). q [B, H, D] fp32; topk [B] int64 (0 or >= 2 each); summary
// [2, Hkv, NB, D] fp32 (min, max of each block's keys); selected [B, Hkv, W >= topk] int32 gets
// the attended logical blocks, ascending (-1 past min(n, topk), and for topk 0); stats [2] float64
// += (blocks attended by sequences with a topk, selection ns). Returns [B, H * D].
at::Tensor sparse_paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor summary,
                                  at::Tensor block_tables, at::Tensor context_lens,
                                  int64_t block_size, double scale, at::Tensor topk,
                                  at::Tensor selected, at::Tensor stats);

// Each layer's summary after the step's K is stored: for every slot in order, its block's
// [min, max] reset to the key (offset 0) or widened by it.
void kv_summary_update_(std::vector<at::Tensor> kv_caches, std::vector<at::Tensor> summaries,
                        at::Tensor slot_mapping, int64_t block_size);

// Causal prefill attention of every chunk in the batch over the paged cache (see
// prefill_attention.cpp), written into out's rows; supported: head_dim % 16 == 0, block % 16 == 0.
bool paged_prefill_supported(int64_t head_dim, int64_t block_size);
void paged_prefill_(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                    at::Tensor query_start, at::Tensor context_lens, int64_t block_size,
                    double scale, at::Tensor out);

// residual += x; x = rms_norm(residual) * weight (rows of x, both [M, N], in place).
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
// rms_norm(x) * w over x's last dim (add_rms_norm_'s steps without the residual), a new tensor.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);

// [M, 2N] (gate | up) -> silu(gate) * up [M, N]; fp32, or bf16 (computed in fp32, rounded once).
at::Tensor silu_and_mul(at::Tensor gate_up);

// Rotate the q and k heads of qkv [T, (H + 2 Hkv) * D] in place (rotate-half RoPE from the cos and
// signed sin tables [max_pos, D]) and store k and v at their slots of kv_cache [2, Hkv, S, D]
// (fp32, or fp16 rounded to nearest-even).
void rope_store_kv_(at::Tensor qkv, at::Tensor positions, at::Tensor cos,
                    at::Tensor sin_signed, at::Tensor kv_cache, at::Tensor slots,
                    int64_t num_heads, int64_t num_kv_heads);

// Index of each row's first maximum: [M, N] -> [M] int64.
at::Tensor argmax_rows(at::Tensor x);

// y [M, N] = x [M, K] . W^T (+ bias) for weights in groups of 32 along K, decoded to fp32 and
// multiplied in the fp32 path's order (csrc/quant_linear.cpp; the layouts are described there):
// 4-bit, w = d q + z: codes [N/16, K/32, 16, 16] uint8, d and z [N/16, K/32, 16] fp32; 8-bit,
// w = d q: codes [N/16, K, 16] int8, d [N/16, K/32, 16] (or w = d q + z with uint8 codes and z
// as d). n is the weight's rows (N).
at::Tensor q4_linear(at::Tensor x, at::Tensor codes, at::Tensor d, at::Tensor z, int64_t n,
                     c10::optional<at::Tensor> bias);
at::Tensor q8_linear(at::Tensor x, at::Tensor codes, at::Tensor d, int64_t n,
                     c10::optional<at::Tensor> bias, c10::optional<at::Tensor> z);

// The weights themselves, decoded to [N, K]: fp32, or rounded to bf16 (nearest-even) for a
// bf16 prefill GEMM.
at::Tensor q4_decode(at::Tensor codes, at::Tensor d, at::Tensor z, int64_t n, bool bf16);
at::Tensor q8_decode(at::Tensor codes, at::Tensor d, int64_t n, c10::optional<at::Tensor> z,
                     bool bf16);

// The same for callers that split the work themselves (decode_forward.cpp): a weight as
// pointers into its tensors, and panels [p0, p1) of y (row stride ldy) from M rows of x (row
// stride lda), bias whole panels long or null.
struct Q4Linear {
  const uint8_t* codes;
  const float *d, *z;
  int64_t N, K;
};
struct Q8Linear {
  const uint8_t* codes;  // int8 codes, or uint8 ones where z is given
  const float *d, *z;    // z: null for w = d q
  int64_t N, K;
  int64_t group = 32;    // weights per d (and z): 32, or 16 (GGUF's Q6_K sub-blocks)
};
Q4Linear q4_weight(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& z, int64_t N);
Q8Linear q8_weight(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& z,
                   int64_t N);
void q4_linear_panels(const Q4Linear& w, const float* x, int64_t lda, const float* bias, float* y,
                      int64_t ldy, int64_t M, int64_t p0, int64_t p1);
void q8_linear_panels(const Q8Linear& w, const float* x, int64_t lda, const float* bias, float* y,
                      int64_t ldy, int64_t M, int64_t p0, int64_t p1);

// 4-bit weights x int8 activations (csrc/q4_int8.cpp; the unit layout is described there): each
// row of x rounded to int8 per block of 32, integer dot products, so not the fp32 path's bits
// (about 0.5% of y's norm off it) but the same bits for a row at any batch size.
// q uint8 [N, K] codes 0..15, d and m fp32 [N, K/32] (w = d q + m; Q4_0 is m = -8 d) -> packed
// uint8 [ceil(N/16), K/32 * 320] (rows past N zero; d and m stored as fp16).
at::Tensor q4i8_pack(at::Tensor q, at::Tensor d, at::Tensor m);
// x fp32 [M, K] -> (xq int8 [M, K], dx fp32 [M, K/32], sx fp32 [M, K/32]): per block of 32,
// dx = max|x| / 127, xq = round(x / dx), sx = dx sum(xq).
std::tuple<at::Tensor, at::Tensor, at::Tensor> q8_quantize(at::Tensor x);
// y [M, n] = x [M, K] fp32 . W^T (+ bias [n]), x quantized inside, groups split between threads.
at::Tensor q4i8_linear(at::Tensor x, at::Tensor packed, int64_t n,
                       c10::optional<at::Tensor> bias);

// The same for callers that split the work themselves: the packed weight as a pointer, checked
// to be [ceil(N/16), K/32 * 320] contiguous uint8.
struct Q4I8Linear {
  const uint8_t* packed;
  int64_t N, K;
};
Q4I8Linear q4i8_weight(const at::Tensor& packed, int64_t N);
// Rows of x [M, K] (row stride ldx) to int8 codes [M, K] and dx, sx [M, K/32] on the calling
// thread; K % 32 == 0.
void q8_quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* xq, float* dx,
                      float* sx);
// Groups of 16 output rows [g0, g1) of y [M, N] (row stride ldy) for all M rows of
// q8_quantize_rows' output, + bias [N] where not null, on the calling thread; rows past N are not
// written.
void q4i8_linear_groups(const Q4I8Linear& w, const int8_t* xq, const float* dx, const float* sx,
                        int64_t M, const float* bias, float* y, int64_t ldy, int64_t g0,
                        int64_t g1);

// W [N, K] fp32 -> panels [ceil(N/16), K, 16] for packed_linear (zero-padded past N).
at::Tensor pack_linear_weight(at::Tensor w);

// y [M, N] = x [M, K] . W^T (+ bias), W as packed by pack_linear_weight (decode-sized M).
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, int64_t N,
                            c10::optional<at::Tensor> bias);

// A bias for the packed kernels, whole panels long (a tile loads 16 values for the last panel):
// bias itself where it already is (Linear.pack pads it once), else a zero-padded copy.
inline at::Tensor panel_bias(const at::Tensor& bias, int64_t panels) {
  if (bias.numel() == panels * 16 && bias.is_contiguous()) return bias;
  at::Tensor b = at::zeros({panels * 16}, bias.options());
  b.narrow(0, 0, bias.numel()).copy_(bias);
  return b;
}

// Panels [begin, end) of packed_linear's product on the calling thread: C [M, N] (row stride
// ldc, N where it is -1) from A [M, K] (row stride lda), panels P, bias padded to whole panels
// (or null).
void linear_panels(const float* A, int64_t lda, int64_t M, int64_t K, const float* P, int64_t N,
                   const float* bias, float* C, int64_t begin, int64_t end, int64_t ldc = -1);

// The decoder layers for a step of decodes only (decode_forward.cpp), as one value: the Python
// binding (bindings.cpp) fills it once, so the argument list is written in one place. B rows
// (one token of each sequence), Hkv KV heads of D dims, S cache slots.
struct DecodeStackArgs {
  at::Tensor x;              // [B, hidden] fp32, layer 0's normed input; gets the final norm's
                             // output (returned)
  at::Tensor residual;       // [B, hidden] fp32, layer 0's input: the residual stream, updated
  at::Tensor positions;      // [B] int64
  at::Tensor slots;          // [B] int64, where each row's K and V are stored
  std::vector<at::Tensor> weights;  // 7 per layer: input norm, qkv panels, qkv bias or an empty
                                    // tensor, o panels, post-attention norm, gate_up panels, down
                                    // panels (pack_linear_weight's, or 4-bit codes: qweights)
  at::Tensor final_norm;     // [hidden]
  std::vector<at::Tensor> kv_caches;  // one per layer, [2, Hkv, S, D] fp32 or fp16
  at::Tensor cos, sin_signed;         // RoPE tables [max_pos, D] (rope_store_kv_)
  at::Tensor block_tables;   // [B, max_blocks] int64
  at::Tensor context_lens;   // [B] int64, this step's token included
  int64_t block_size;
  double scale, eps;         // attention's softmax scale, the RMS norms' epsilon
  int64_t num_heads, num_kv_heads;
  int64_t team;              // threads that take every layer together (at least 1 runs)
  // Layers from dense_layers on attend by sparse_paged_decode with their summaries entry (one per
  // layer), topk [B], selected [B, Hkv, W] (left holding the last layer's choice) and stats
  // (summed over the layers); with no summaries every layer is dense.
  std::vector<at::Tensor> summaries;
  at::Tensor topk;
  int64_t dense_layers;
  c10::optional<at::Tensor> selected, stats;
  // Quantized linears: where a layer's weights entry holds q4_linear's codes (uint8) or
  // q8_linear's (int8) in place of panels, its d and z (an empty tensor for 8-bit) are here, 8
  // per layer (qkv, o, gate_up, down); empty when none are.
  std::vector<at::Tensor> qweights;
};

// Runs every layer of `args` and returns args.x. `team` threads take every layer together (each
// GEMM's panels split between them, attention and element-wise ops by rows, a barrier between
// steps).
at::Tensor decode_forward(const DecodeStackArgs& args);
