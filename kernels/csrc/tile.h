// The fp32 register tile shared by the packed GEMM (gemm.cpp) and prefill attention
// (prefill_attention.cpp): up to 6 rows by 16 columns in 12 AVX2 accumulators, 2 loads of B and
// one broadcast of A per row for each k. Every loop over rows is unrolled: a rolled one makes GCC
// keep the accumulators in a stack array and store them on every k (half the speed).
// Where AVX-512 is compiled in, tile512 (below) serves the GEMM's small products (decode steps).
#pragma once
#include <array>
#include <cstdint>
#include <utility>

namespace ts {

constexpr int64_t kNR = 16;  // columns of a tile (and of a packed weight panel)
constexpr int kMR = 6;       // most rows of a tile

// Rows of the t-th of ceil(M / 6) tiles of near-equal height (M = 7: 4 + 3, not 6 + 1: a short
// tile keeps too few FMA chains in flight and costs nearly a full one).
inline int64_t tile_rows(int64_t M, int64_t t) {
  const int64_t tiles = (M + kMR - 1) / kMR;
  return M / tiles + (t < M % tiles ? 1 : 0);
}

}  // namespace ts

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace ts {

// C[0:MR, 0:ncols] = (ACC ? C : bias or 0) + A[0:MR, 0:K] . B[0:K, 0:16]; rows of A, B and C are
// lda, ldb and ldc floats apart; B holds 16 readable columns even where ncols < 16.
template <int MR, bool ACC>
inline void tile(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K,
                 const float* bias, float* C, int64_t ldc, int64_t ncols) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(ncols)), lane);
  const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(ncols) - 8), lane);
  __m256 c0[MR], c1[MR];
  if constexpr (ACC) {
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
      c0[m] = _mm256_maskload_ps(C + m * ldc, m0), c1[m] = _mm256_maskload_ps(C + m * ldc + 8, m1);
  } else {
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) c0[m] = b0, c1[m] = b1;
  }
  for (int64_t k = 0; k < K; ++k) {
    // ~1 KB ahead in a packed panel, which the first row tile streams from DRAM.
    __builtin_prefetch(B + (k + 16) * ldb, 0, 3);
    const __m256 p0 = _mm256_loadu_ps(B + k * ldb), p1 = _mm256_loadu_ps(B + k * ldb + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 a = _mm256_broadcast_ss(A + m * lda + k);
      c0[m] = _mm256_fmadd_ps(a, p0, c0[m]);
      c1[m] = _mm256_fmadd_ps(a, p1, c1[m]);
    }
  }
  if (ncols == kNR) {
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      _mm256_storeu_ps(C + m * ldc, c0[m]);
      _mm256_storeu_ps(C + m * ldc + 8, c1[m]);
    }
    return;
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    _mm256_maskstore_ps(C + m * ldc, m0, c0[m]);
    _mm256_maskstore_ps(C + m * ldc + 8, m1, c1[m]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*,
                        float*, int64_t, int64_t);
template <bool ACC>
constexpr TileFn kTiles[kMR + 1] = {nullptr,        tile<1, ACC>, tile<2, ACC>, tile<3, ACC>,
                                    tile<4, ACC>, tile<5, ACC>, tile<6, ACC>};

}  // namespace ts
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

namespace ts {

constexpr int kMR512 = 24;  // most rows of an AVX-512 tile

inline int64_t tile_rows512(int64_t M, int64_t t) {
  const int64_t tiles = (M + kMR512 - 1) / kMR512;
  return M / tiles + (t < M % tiles ? 1 : 0);
}

// The same product as tile<MR, false> (the same FMA chain per output, so bit-identical), with
// one 16-column vector per row: up to 24 accumulators, one panel load and MR broadcast FMAs per
// k. `next` (or null): a panel to bring into L2 meanwhile, one 64-byte line per k (prefetcht1;
// into L1 (t0) was slower: the panel is larger than L1).
template <int MR>
inline void tile512(const float* A, int64_t lda, const float* B, int64_t K, const float* bias,
                    float* C, int64_t ldc, int64_t ncols, const float* next) {
  const __mmask16 mask = ncols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
  __m512 c[MR];
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
#pragma GCC unroll 24
  for (int m = 0; m < MR; ++m) c[m] = b0;
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(B + (k + 16) * 16, 0, 3);
    if (next != nullptr) __builtin_prefetch(next + k * 16, 0, 2);
    const __m512 p = _mm512_loadu_ps(B + k * 16);
#pragma GCC unroll 24
    for (int m = 0; m < MR; ++m) c[m] = _mm512_fmadd_ps(_mm512_set1_ps(A[m * lda + k]), p, c[m]);
  }
#pragma GCC unroll 24
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(C + m * ldc, mask, c[m]);
}

using Tile512Fn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*,
                           int64_t, int64_t, const float*);
// kTiles512[rows] for rows 1..24 (entry 0 unused).
template <int... I>
constexpr std::array<Tile512Fn, sizeof...(I) + 1> make_tiles512(std::integer_sequence<int, I...>) {
  return {nullptr, tile512<I + 1>...};
}
inline constexpr auto kTiles512 = make_tiles512(std::make_integer_sequence<int, kMR512>{});

}  // namespace ts
#endif
