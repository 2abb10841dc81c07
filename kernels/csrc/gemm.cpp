// y = x W^T (+ b) for every linear layer of the CPU model path, fp32, AVX2 + FMA.
//
// Why not oneDNN: at decode batch sizes every step streams all 540 MB of the embedded model's
// weights from DRAM, and oneDNN reached 9-11 GB/s of the box's ~21 GB/s at M = 1..8 and ~100
// GFLOP/s at M = 64 with cold weights; this kernel 18-24 GB/s and ~120 GFLOP/s, and matches oneDNN
// on prefill chunks (M = 1024) (30 layers' projections, 2-core Zen 3, 2026-12-02).
//
// Layout: W [N, K] is packed once into panels of 16 output columns, P [ceil(N/16)][K][16]
// (zero-padded past N), so that one panel is one contiguous run of memory that a thread streams
// front to back. Each panel is swept by a 6x16 register tile (12 accumulators, 2 panel loads and 6
// broadcasts per k), rows of x in blocks of up to 6; the panel stays in L1/L2 across the row
// blocks. Where AVX-512 is compiled in, wide tiles (tile.h: up to 8 rows x 3 panels) take their
// place at every M, and where a group of panels takes several of them, they prefetch the next
// group into L2 while they sweep this one. Both give every output the same FMA chain over k, so
// results are bit-identical whichever runs. Threads take disjoint runs of panels: each reads only
// its own share of the weights.
#include "ops.h"
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>

#include "tile.h"

namespace {

using ts::kNR;

// The same product without AVX2 (any CPU): one output at a time over the packed panels.
void panel_scalar(const float* A, int64_t lda, const float* P, int64_t K, const float* bias,
                  float* C, int64_t ldc, int64_t rows, int64_t ncols) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < ncols; ++j) {
      float acc = bias ? bias[j] : 0.f;
      for (int64_t k = 0; k < K; ++k) acc += A[m * lda + k] * P[k * kNR + j];
      C[m * ldc + j] = acc;
    }
}

}  // namespace

void linear_panels(const float* A, int64_t lda, int64_t M, int64_t K, const float* P, int64_t N,
                   const float* bp, float* C, int64_t begin, int64_t end, int64_t ldc) {
  if (ldc < 0) ldc = N;
#if defined(__AVX512F__)
  // Groups of up to 3 panels, each swept by the wide tiles over all rows; with several tiles
  // per group, each prefetches its share of the next group (tile.h).
  const int64_t tiles = (M + ts::kMRWide - 1) / ts::kMRWide;
  for (int64_t p = begin; p < end; p += ts::kNBWide) {
    const int64_t nb = std::min<int64_t>(ts::kNBWide, end - p);
    const int64_t last = std::min(kNR, N - (p + nb - 1) * kNR);
    const char* next = reinterpret_cast<const char*>(P + (p + nb) * K * kNR);
    const int64_t next_lines =
        tiles > 1 ? std::min<int64_t>(ts::kNBWide, end - p - nb) * K * kNR * 4 / 64 : 0;
    for (int64_t t = 0, m0 = 0, rows = 0; m0 < M; ++t, m0 += rows) {
      rows = ts::tile_rows_wide(M, t);
      const int64_t l0 = next_lines * t / tiles, l1 = next_lines * (t + 1) / tiles;
      ts::kTilesWide[nb - 1][rows](A + m0 * lda, lda, P + p * K * kNR, K * kNR, K,
                                   bp ? bp + p * kNR : nullptr, C + m0 * ldc + p * kNR, ldc, last,
                                   next + l0 * 64, l1 - l0);
    }
  }
#else
  for (int64_t p = begin; p < end; ++p) {
    const float* panel = P + p * K * kNR;
    const float* pb = bp ? bp + p * kNR : nullptr;
    const int64_t ncols = std::min(kNR, N - p * kNR);
    for (int64_t t = 0, m0 = 0, rows = 0; m0 < M; ++t, m0 += rows) {
      rows = ts::tile_rows(M, t);
#if defined(__AVX2__) && defined(__FMA__)
      ts::kTiles<false>[rows](A + m0 * lda, lda, panel, kNR, K, pb, C + m0 * ldc + p * kNR, ldc,
                              ncols);
#else
      panel_scalar(A + m0 * lda, lda, panel, K, pb, C + m0 * ldc + p * kNR, ldc, rows, ncols);
#endif
    }
  }
#endif
}

at::Tensor pack_linear_weight(at::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "a 2-D fp32 weight");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NP = (N + kNR - 1) / kNR;
  auto packed = at::zeros({NP, K, kNR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  ts::parallel_for(0, NP, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < std::min(kNR, N - p * kNR); ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kNR + j] = src[(p * kNR + j) * K + k];
  });
  return packed;
}

at::Tensor packed_linear(at::Tensor x, at::Tensor packed, int64_t N,
                            c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kNR, "x [M, K], packed [NP, K, 16]");
  TORCH_CHECK(packed.is_contiguous() && packed.size(1) == x.size(1), "packed weight does not fit x");
  TORCH_CHECK(packed.size(0) == (N + kNR - 1) / kNR, "N does not match the packed panels");
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NP = packed.size(0), lda = x.stride(0);
  auto y = at::empty({M, N}, x.options());
  const float* A = x.data_ptr<float>();
  const float* P = packed.data_ptr<float>();
  float* C = y.data_ptr<float>();
  const at::Tensor b = bias.has_value() ? panel_bias(bias.value(), NP) : at::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  // Tasks of at least 64K multiply-adds: a product smaller than two of them stays on the calling
  // thread (waking a sleeping worker under OMP_WAIT_POLICY=PASSIVE costs more than that work).
  // Measured at M = 1: 2^16 streams the weights at ~23 GB/s, 2^20 (small layers on one thread)
  // at ~14.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, M * K * kNR));
  ts::parallel_for(0, NP, grain, [&](int64_t begin, int64_t end) {
    linear_panels(A, lda, M, K, P, N, bp, C, begin, end);
  });
  return y;
}
