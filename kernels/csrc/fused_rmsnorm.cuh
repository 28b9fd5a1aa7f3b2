// Fused all-reduce + residual add + RMSNorm (one-shot based), for the row-parallel output of a
// transformer layer followed by the next layer's norm:
//   new_residual = residual + T(sum_r x_r)                (in the residual dtype T)
//   normed       = weight * T(f32(new_residual) * rsqrt(mean(f32(new_residual)^2) + eps))
// (Llama/Hugging Face convention: statistics in float32, scale applied in T.)
//
// x, residual: [M, H] row-major; weight: [H]. Rows are the unit of work: block b owns rows
// b, b + gridDim, ... in both phases (one row per block up to kFusedMaxBlocks rows: nothing
// pairs blocks, so the grid may exceed what is resident at once).
//   1. push: the block stores its rows of x into slot[rank] of every peer's one-shot area;
//   2. per row: take the peers' packs as they arrive (flag-free, lamport.cuh) and sum all
//      contributions in float32 in rank order (bitwise identical on every rank), add the
//      residual, write new_residual, accumulate the sum of squares, block-reduce it, then write
//      normed. The reduced row never goes back to HBM before the norm except as the
//      new_residual output, which has to be written anyway (and is read back only for rows
//      longer than kKeep packs per thread).
// With world == 1 nothing is exchanged: the kernel is a one-pass residual add + RMSNorm.
//
// Partial products. Instead of x, a rank may pass S <= kMaxPartials float32 slices [S, M, H] whose
// sum is its contribution: the row-parallel product written as a dot batched over K slices. XLA
// runs its own split-K GEMMs at decode sizes and sums their partial products in the kernel that
// consumes them; in front of this kernel that sum was a launch of its own (1.1-1.3 us). Here the
// slices are summed in float32 in slice order and rounded to T as that sum would be, while the
// own packs are loaded.
// Workspace reuse is the one-shot argument (two halves selected by epoch parity), see lamport.cuh.
#pragma once
#include "common.cuh"
#include "lamport.cuh"
#include "layout.cuh"
#include "oneshot.cuh"

namespace switchyard {

// Sum of v over the block, the same bits in every thread. One barrier per row: warps leave their
// sums in half `parity` of `partial`, and every thread then adds them up in warp order from
// shared memory (broadcast reads; a second round of shuffles would be five dependent steps).
// Alternating halves between rows makes a barrier before reuse unnecessary: a thread writes a
// half again two rows later, after the next row's barrier, which every thread reaches only once
// it has read this row's sums.
constexpr int kFusedThreads = 512;  // at most, per block
__device__ __forceinline__ float block_sum(float v, int parity) {
  constexpr int kWarps = kFusedThreads / 32;
  __shared__ __align__(16) float partial[2][kWarps];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[parity][warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) / 32;
  float s = partial[parity][0];
#pragma unroll
  for (int i = 1; i < kWarps; ++i)
    if (i < nwarps) s += partial[parity][i];
  return s;
}

constexpr int kMaxPartials = 4;

// The sum of S float32 slices (`slice` elements apart) of the W elements at element `at`, rounded
// to a pack of T. Every load goes out before any is added.
template <typename T, int W>
__device__ __forceinline__ Pack<T, W> sum_partials(const float* __restrict__ parts, int S, int64_t slice,
                                                   int64_t at) {
  constexpr int V = W % 4 == 0 ? 4 : 1;  // floats per load
  using Unit = typename std::conditional<V == 4, float4, float>::type;
  Unit u[kMaxPartials][W / V];
#pragma unroll
  for (int k = 0; k < kMaxPartials; ++k) {
    if (k < S) {
#pragma unroll
      for (int i = 0; i < W / V; ++i) u[k][i] = __ldg(reinterpret_cast<const Unit*>(parts + k * slice + at) + i);
    }
  }
  float acc[W];
#pragma unroll
  for (int k = 0; k < kMaxPartials; ++k) {
    if (k < S) {
#pragma unroll
      for (int i = 0; i < W / V; ++i) {
        const float* f = reinterpret_cast<const float*>(&u[k][i]);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[i * V + e] = k == 0 ? f[e] : acc[i * V + e] + f[e];
      }
    }
  }
  Pack<T, W> r;
#pragma unroll
  for (int e = 0; e < W; ++e) r.v[e] = from_f32<T>(acc[e]);
  return r;
}

// W must divide H (the host picks W = 1 otherwise), so every row starts on a pack boundary.
// kPartials: x is null and `parts` holds `splits` slices (a separate instantiation, so that the
// plain kernel keeps its registers).
template <typename T, int W, bool kPartials = false>
__global__ void __launch_bounds__(kFusedThreads) fused_rmsnorm_kernel(
    Peers P, Layout L, const T* __restrict__ x, const float* __restrict__ parts, int splits,
    const T* __restrict__ residual, const T* __restrict__ weight, T* __restrict__ new_residual,
    T* __restrict__ normed, int64_t rows, int64_t hidden, float eps) {
  PhaseClock clock;
  const uint32_t epoch = read_epoch(P);
  bool gave_up = timed_out_before(P);
  const uint32_t half = epoch & 1u;
  const float inv_hidden = 1.f / static_cast<float>(hidden);  // off the path after the arrival
  const int64_t hp = hidden / W;  // packs per row
  using PackT = Pack<T, W>;
  const PackT* xp = reinterpret_cast<const PackT*>(x);

  const PackT* rp = reinterpret_cast<const PackT*>(residual);
  const PackT* wp = reinterpret_cast<const PackT*>(weight);
  PackT* nrp = reinterpret_cast<PackT*>(new_residual);
  PackT* np = reinterpret_cast<PackT*>(normed);
  // This rank's contribution to pack p of a row: x's pack, or the sum of its partial products.
  auto own_pack = [&](int64_t row, int64_t p) -> PackT {
    if constexpr (!kPartials) return canonical_pack(load_vec(xp + row * hp + p));
    else return canonical_pack(sum_partials<T, W>(parts, splits, rows * hidden, (row * hp + p) * W));
  };

  // The first kKeep packs of each thread stay in registers (a row of up to kKeep x blockDim
  // packs: every Llama hidden size); packs beyond that are re-read. The block's first row (its
  // only one up to kFusedMaxBlocks rows) is pushed as soon as its own packs are loaded: the
  // peers wait for that push, so nothing else goes before it. Its residuals and weights are
  // loaded right after the push, so their loads overlap the NVLink trip and no load from memory
  // sits between a peer's arrival and the outputs.
  constexpr int kKeep = 2;
  const int64_t bd = blockDim.x;
  const int64_t row0 = blockIdx.x;  // < rows: the grid has at most one block per row
  PackT own0[kKeep], res0[kKeep], wkeep[kKeep];
#pragma unroll
  for (int j = 0; j < kKeep; ++j) {
    const int64_t p = threadIdx.x + j * bd;
    if (p < hp) own0[j] = own_pack(row0, p);
  }

  // Phase 1: push this block's rows to every peer.
  auto push = [&](int64_t row, int64_t p, const PackT& v) {
    for (int k = 1; k < P.world; ++k) {
      const int gpu = rank_after(P, k);
      st_volatile(oneshot_slot<T, W>(P, L, gpu, half, P.rank) + row * hp + p, v);
    }
  };
  if (P.world > 1) {
    for (int64_t row = row0; row < rows; row += gridDim.x) {
#pragma unroll
      for (int j = 0; j < kKeep; ++j) {
        const int64_t p = threadIdx.x + j * bd;
        if (p < hp) push(row, p, row == row0 ? own0[j] : own_pack(row, p));
      }
      for (int64_t p = threadIdx.x + kKeep * bd; p < hp; p += bd) push(row, p, own_pack(row, p));
    }
  }
#pragma unroll
  for (int j = 0; j < kKeep; ++j) {  // after the push (st_volatile's memory clobber keeps them here)
    const int64_t p = threadIdx.x + j * bd;
    if (p < hp) {
      res0[j] = load_vec(rp + row0 * hp + p);
      wkeep[j] = load_vec(wp + p);
    }
  }

  store_absent_counters(P, epoch);  // while the peers' packs travel
  clock.mark(1);

  // Reduce one pack of a row (own = this rank's canonical pack), add the residual, write and
  // return new_residual.
  auto reduce_add = [&](int64_t row, int64_t p, const PackT& own, const PackT& res, float& sumsq) -> PackT {
    float acc[W];
    for (int q = 0; q < P.world; ++q) {
      const PackT v = q == P.rank ? own : take_pack(oneshot_slot<T, W>(P, L, P.rank, half, q) + row * hp + p, P, gave_up);
      accumulate<T, W>(acc, v, q == 0);
    }
    const PackT reduced = to_pack<T, W>(acc);
    PackT nr;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      nr.v[i] = from_f32<T>(to_f32(res.v[i]) + to_f32(reduced.v[i]));
      const float f = to_f32(nr.v[i]);
      sumsq += f * f;
    }
    nrp[row * hp + p] = nr;
    return nr;
  };
  auto write_normed = [&](int64_t row, int64_t p, const PackT& nr, const PackT& w, float rstd) {
    PackT o;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const T scaled = from_f32<T>(to_f32(nr.v[i]) * rstd);
      o.v[i] = from_f32<T>(to_f32(w.v[i]) * to_f32(scaled));
    }
    np[row * hp + p] = o;
  };

  int parity = 0;
  for (int64_t row = row0; row < rows; row += gridDim.x, parity ^= 1) {
    float sumsq = 0.f;
    PackT keep[kKeep];
    if (row != row0) {  // later rows (more rows than blocks): load in place of the first row's
#pragma unroll
      for (int j = 0; j < kKeep; ++j) {
        const int64_t p = threadIdx.x + j * bd;
        if (p < hp) {
          own0[j] = own_pack(row, p);
          res0[j] = load_vec(rp + row * hp + p);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kKeep; ++j) {
      const int64_t p = threadIdx.x + j * bd;
      if (p < hp) keep[j] = reduce_add(row, p, own0[j], res0[j], sumsq);
    }
    for (int64_t p = threadIdx.x + kKeep * bd; p < hp; p += bd)
      reduce_add(row, p, own_pack(row, p), load_vec(rp + row * hp + p), sumsq);
    clock.mark(2);
    const float rstd = rsqrtf(block_sum(sumsq, parity) * inv_hidden + eps);
    clock.mark(3);
#pragma unroll
    for (int j = 0; j < kKeep; ++j) {
      const int64_t p = threadIdx.x + j * bd;
      if (p < hp) write_normed(row, p, keep[j], wkeep[j], rstd);
    }
    for (int64_t p = threadIdx.x + kKeep * bd; p < hp; p += bd) write_normed(row, p, load_vec<T, W, Via::kDefault>(nrp + row * hp + p), load_vec(wp + p), rstd);
    clock.mark(4);
  }

  finish_launch(P, epoch);
  clock.mark(5);
}

}  // namespace switchyard
