// One-shot all-reduce.
//
// Algorithm (one kernel per GPU, `world` GPUs):
//   1. push: every rank stores its whole input into slot[rank] of EVERY rank's workspace
//      (its own included) with plain NVLink peer stores;
//   2. one barrier (block_barrier, common.cuh);
//   3. reduce: every rank reads slot[0..world-1] from its OWN workspace (local HBM) and sums them
//      in float32 in rank order 0..world-1, then writes the result in the output dtype.
// Every rank performs the same float operations in the same order on the same bits, so every
// rank's output is bitwise identical. Pushing (remote stores) rather than pulling (remote loads)
// keeps the NVLink round trip of a load off the critical path: a rank only waits for one flag.
//
// Reuse of the workspace. Launch `epoch` writes half (epoch & 1). A peer may start launch e+1 as
// soon as it has passed barrier e, while this rank is still reading half e&1, so e+1 must write
// the other half. A peer can only start launch e+2 after passing barrier e+1, which needs at
// least one block of this rank's launch e+1, which starts only after this rank's launch e has
// completed on its stream (all of its reads are done). Two halves are therefore sufficient.
//
// Work partition: pack i belongs to block (i / blockDim) mod gridDim in both phases and on every
// rank, so per-block barriers suffice.
#pragma once
#include "common.cuh"
#include "layout.cuh"

namespace switchyard {

template <typename T, int W>
__device__ __forceinline__ Pack<T, W>* oneshot_slot(const Peers& P, const Layout& L, int gpu,
                                                    uint32_t half, int slot) {
  return reinterpret_cast<Pack<T, W>*>(P.data[gpu] + L.oneshot_off +
                                       (static_cast<int64_t>(half) * P.world + slot) * L.oneshot_slot);
}

template <typename T, int W>
__global__ void __launch_bounds__(1024) oneshot_kernel(Peers P, Layout L, const T* __restrict__ in,
                                                       T* __restrict__ out, int64_t n) {
  const uint32_t epoch = read_epoch(P);
  const uint32_t half = epoch & 1u;
  const int64_t packs = ceil_div(n, W);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  // Phase 1: push. Destinations are rotated by rank so that the ranks do not all hit GPU 0 first.
  for (int64_t i = first; i < packs; i += stride) {
    const Pack<T, W> p = load_pack<T, W>(in, i, n);
    for (int k = 0; k < P.world; ++k) {
      const int gpu = (P.rank + k) % P.world;
      oneshot_slot<T, W>(P, L, gpu, half, P.rank)[i] = p;
    }
  }

  block_barrier(P, 0, epoch);

  // Phase 2: reduce from local memory, rank order fixed.
  for (int64_t i = first; i < packs; i += stride) {
    float acc[W];
    for (int q = 0; q < P.world; ++q)
      accumulate<T, W>(acc, load_ws<T, W>(oneshot_slot<T, W>(P, L, P.rank, half, q) + i), q == 0);
    store_pack<T, W>(out, i, n, to_pack<T, W>(acc));
  }

  finish_launch(P, epoch);
}

}  // namespace switchyard
