// The native CPU ops of the tierserve extension (bindings.cpp exposes them to Python).
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

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

// Paged decode attention, fp32: q [B, H, D], kv_cache [2, Hkv, S, D] -> [B, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, int64_t block_size, double scale);

// residual += x; x = rms_norm(residual) * weight (rows of x, both [M, N], in place).
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);

// [M, 2N] (gate | up) -> silu(gate) * up [M, N].
torch::Tensor silu_and_mul(torch::Tensor gate_up);

// Rotate the q and k heads of qkv [T, (H + 2 Hkv) * D] in place (rotate-half RoPE from the cos and
// signed sin tables [max_pos, D]) and store k and v at their slots of kv_cache [2, Hkv, S, D].
void rope_store_kv_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                    torch::Tensor sin_signed, torch::Tensor kv_cache, torch::Tensor slots,
                    int64_t num_heads, int64_t num_kv_heads);

// Index of each row's first maximum: [M, N] -> [M] int64.
torch::Tensor argmax_rows(torch::Tensor x);
