// The fp32 register tile shared by the packed GEMM (gemm.cpp) and prefill attention
// (prefill_attention.cpp): up to 6 rows by 16 columns in 12 AVX2 accumulators, 2 loads of B and
// one broadcast of A per row for each k. Every loop over rows is unrolled: a rolled one makes GCC
// keep the accumulators in a stack array and store them on every k (half the speed).
// Where AVX-512 is compiled in, the GEMM uses the wide tiles below instead (tile512w).
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

constexpr int kMRWide = 8;  // most rows of a wide tile
constexpr int kNBWide = 3;  // most panels of a wide tile

// Rows of the t-th of ceil(M / 8) wide tiles of near-equal height.
inline int64_t tile_rows_wide(int64_t M, int64_t t) {
  const int64_t tiles = (M + kMRWide - 1) / kMRWide;
  return M / tiles + (t < M % tiles ? 1 : 0);
}

// The same product as tile<MR, false> (the same FMA chain per output, so bit-identical) over NB
// panels at once: up to 8 rows by 48 columns in 24 accumulators, NB panel loads and one broadcast
// per row for each k: a third of the 6x16 tile's loads per FMA. Panels are `pstride` floats apart;
// all but the last are whole, that one has `ncols` columns; bias (or null) holds NB * 16 values.
// Measured (median, 2 threads): against the 6x16 tile at M = 96..1024, ~200 GFLOP/s against
// ~140-180 (AMD Zen 4); against the 24x16 one-panel tiles once used for M <= 64, 8-25% less time
// for the model's five projections at every M from 1 to 64 (Intel Xeon with AVX-512).
//
// `pf_lines` cache lines from `pf` on (the next panel group, when the caller sweeps this one with
// several tiles) are prefetched into L2, spread evenly over the k loop: a share per tile, so the
// next group's first tile finds its panels in L2 rather than waiting on DRAM or L3 while the
// FMA units idle. Measured on an Intel Xeon, 30 layers' projections on one thread at M = 32:
// 47 against 40 ms with the weights in L3, 68 against ~60 from DRAM; in whole decode steps at
// batch 32-64 (two threads, 16-32 rows each) about 1% less time; neutral at M = 1024. At M <= 8
// (one tile per group) it costs (33 against 44 ms), so the caller passes none there.
template <int MR, int NB>
inline void tile512w(const float* A, int64_t lda, const float* B, int64_t pstride, int64_t K,
                     const float* bias, float* C, int64_t ldc, int64_t ncols, const char* pf,
                     int64_t pf_lines) {
  __m512 c[NB][MR];
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    const __m512 b0 = bias ? _mm512_loadu_ps(bias + j * 16) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) c[j][m] = b0;
  }
  int64_t pf_done = 0;
  for (int64_t k = 0; k < K; ++k) {
    for (const int64_t upto = (k + 1) * pf_lines / K; pf_done < upto; ++pf_done)
      _mm_prefetch(pf + pf_done * 64, _MM_HINT_T1);
    __m512 p[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      __builtin_prefetch(B + j * pstride + (k + 8) * 16, 0, 3);
      p[j] = _mm512_loadu_ps(B + j * pstride + k * 16);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(A[m * lda + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) c[j][m] = _mm512_fmadd_ps(a, p[j], c[j][m]);
    }
  }
  const __mmask16 last = ncols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j + 1 < NB; ++j) _mm512_storeu_ps(C + m * ldc + j * 16, c[j][m]);
    _mm512_mask_storeu_ps(C + m * ldc + (NB - 1) * 16, last, c[NB - 1][m]);
  }
}

using TileWideFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*,
                            float*, int64_t, int64_t, const char*, int64_t);
// kTilesWide[NB - 1][rows] for 1..3 panels and rows 1..8 (entry 0 of each unused).
template <int NB, int... I>
constexpr std::array<TileWideFn, sizeof...(I) + 1> make_tiles_wide(
    std::integer_sequence<int, I...>) {
  return {nullptr, tile512w<I + 1, NB>...};
}
inline constexpr std::array<std::array<TileWideFn, kMRWide + 1>, kNBWide> kTilesWide = {
    make_tiles_wide<1>(std::make_integer_sequence<int, kMRWide>{}),
    make_tiles_wide<2>(std::make_integer_sequence<int, kMRWide>{}),
    make_tiles_wide<3>(std::make_integer_sequence<int, kMRWide>{})};

}  // namespace ts
#endif
