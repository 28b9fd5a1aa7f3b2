// Decode product: y = x @ w (+ residual) for a few rows, one pass over the weights.
//
// x: [n, K] with n <= kRows; w: [K, N] row-major (the engine's layout, x @ w); residual, y: [n, N];
// all T (bf16 or f16). Accumulation in float32; y = T(residual + sum) is rounded once.
//
// Why a kernel of our own: at decode sizes (n = 1..8 rows) the product only streams the weights.
// XLA runs it as a split-K GEMM whose float32 partial sums it adds up inside the kernel that
// consumes the product (a rope pass, the residual add): for the engine's QKV and output products
// that came to ~81% of the copy roofline plus a residual-add pass of its own
// (benchmarks/NOTES.md, "Where TP=1 batch 1 loses its 20%"). Here one kernel reads each weight
// byte once, sums in a fixed order and applies the residual add on the way out.
//
// Work split. A block owns kTileCols = 32 columns (4 column groups of 8 = one 16-byte pack per
// row) over all of K, split into kSlices = 64 contiguous K ranges, one per thread:
//   lane = column group (bits 0..1) + 4 x slice-in-warp (bits 2..4), slice = slice-in-warp + 8 x warp.
// A thread walks its K range 8 rows at a time, with the next 8 packs of w in flight while it
// multiplies the current ones (each row of x it needs arrives as one 16-byte load per 8 rows).
// The 64 partial sums of a column are then added in a fixed tree: 3 butterfly steps across the
// 8 slices of a warp, then the 8 warps in order through shared memory. Every run gives the same
// bits. Requirements (checked by the host): K % (8 x kSlices) == 0, N % kTileCols == 0, 16-byte
// aligned x, w.
#pragma once
#include "common.cuh"

namespace switchyard {

constexpr int kProductThreads = 256;
constexpr int kProductGroups = 4;                                // column groups of a block
constexpr int kProductTileCols = kProductGroups * 8;             // columns of a block
constexpr int kProductSlices = kProductThreads / kProductGroups;  // K ranges of a block
constexpr int kProductWarps = kProductThreads / 32;
constexpr int kProductMaxRows = 8;

template <typename T, int kRows, bool kResidual>
__global__ void __launch_bounds__(kProductThreads) decode_product_kernel(
    const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ residual, T* __restrict__ y, int n,
    int K, int N) {
  constexpr int W = 8;
  using PackT = Pack<T, W>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = lane % kProductGroups;
  const int slice = lane / kProductGroups + (32 / kProductGroups) * warp;
  const int span = K / kProductSlices;  // rows of K per thread, a multiple of 8
  const int k0 = slice * span;
  const int col = blockIdx.x * kProductTileCols + group * W;
  const int64_t stride = N / W;  // packs per row of w
  const PackT* wp = reinterpret_cast<const PackT*>(w + static_cast<int64_t>(k0) * N + col);
  const PackT* xp = reinterpret_cast<const PackT*>(x + k0);
  const int kp = K / W;  // packs per row of x

  float acc[kRows][W];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < W; ++e) acc[r][e] = 0.f;

  PackT cur[8], next[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) cur[j] = load_vec(wp + j * stride);
  for (int k = 0; k < span; k += 8) {
    if (k + 8 < span) {
#pragma unroll
      for (int j = 0; j < 8; ++j) next[j] = load_vec(wp + (k + 8 + j) * stride);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r < n) {
        const PackT xv = load_vec(xp + r * kp + k / W);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float xf = to_f32(xv.v[j]);
#pragma unroll
          for (int e = 0; e < W; ++e) acc[r][e] = fmaf(xf, to_f32(cur[j].v[e]), acc[r][e]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) cur[j] = next[j];
  }

  // Across the warp's 8 slices (lane bits 2..4): the same tree in every lane.
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < W; ++e)
#pragma unroll
      for (int o = kProductGroups; o < 32; o <<= 1) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], o);

  __shared__ float part[kProductWarps][kRows][kProductTileCols];
  if (lane < kProductGroups) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int e = 0; e < W; ++e) part[warp][r][group * W + e] = acc[r][e];
  }
  __syncthreads();
  for (int t = threadIdx.x; t < kRows * kProductTileCols; t += kProductThreads) {
    const int r = t / kProductTileCols, c = t % kProductTileCols;
    if (r >= n) continue;
    float s = part[0][r][c];
#pragma unroll
    for (int q = 1; q < kProductWarps; ++q) s += part[q][r][c];
    const int64_t at = static_cast<int64_t>(r) * N + blockIdx.x * kProductTileCols + c;
    if constexpr (kResidual) s += to_f32(residual[at]);
    y[at] = from_f32<T>(s);
  }
}

}  // namespace switchyard
