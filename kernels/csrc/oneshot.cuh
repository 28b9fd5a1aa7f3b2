// One-shot all-reduce.
//
// Algorithm (one kernel per GPU, `world` GPUs):
//   1. push: every rank stores its whole input into slot[rank] of every PEER's workspace with
//      plain NVLink peer stores (its own contribution stays in its input);
//   2. reduce: every rank takes slot[q] (q != rank) from its OWN workspace as the packs arrive
//      (flag-free: the data carries its arrival, lamport.cuh) and sums all contributions in
//      float32 in rank order 0..world-1, then writes the result in the output dtype.
// Every rank performs the same float operations in the same order on the same bits (its own
// input goes through the same canonical_pack as what it sends), so every rank's output is bitwise
// identical. Pushing (remote stores) rather than pulling (remote loads) keeps the NVLink round
// trip of a load off the critical path: a rank waits for one one-way trip of the peers' stores.
//
// Reuse of the workspace: two halves, launch `epoch` writes half epoch & 1 (see lamport.cuh for
// why that is enough). Any partition of packs over threads works, since no barrier pairs blocks.
#pragma once
#include "common.cuh"
#include "lamport.cuh"
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
  PhaseClock clock;
  const uint32_t epoch = read_epoch(P);
  bool gave_up = timed_out_before(P);
  const uint32_t half = epoch & 1u;
  const int64_t packs = ceil_div(n, W);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  // Phase 1: push. Destinations are rotated by rank so that the ranks do not all hit GPU 0 first.
  Pack<T, W> mine;  // this thread's first pack, kept for phase 2 (small messages: its only one)
  for (int64_t i = first; i < packs; i += stride) {
    const Pack<T, W> p = canonical_pack(load_pack<T, W>(in, i, n));
    if (i == first) mine = p;
    for (int k = 1; k < P.world; ++k) {
      const int gpu = rank_after(P, k);
      st_volatile(oneshot_slot<T, W>(P, L, gpu, half, P.rank) + i, p);
    }
  }

  store_absent_counters(P, epoch);  // while the peers' packs travel
  clock.mark(1);

  // Phase 2: reduce, rank order fixed; peers' packs from local memory as they arrive.
  for (int64_t i = first; i < packs; i += stride) {
    float acc[W];
    for (int q = 0; q < P.world; ++q) {
      const Pack<T, W> v = q != P.rank ? take_pack(oneshot_slot<T, W>(P, L, P.rank, half, q) + i, P, gave_up)
                           : i == first ? mine
                                        : canonical_pack(load_pack<T, W>(in, i, n));
      accumulate<T, W>(acc, v, q == 0);
    }
    store_pack<T, W>(out, i, n, to_pack<T, W>(acc));
  }
  clock.mark(2);

  finish_launch(P, epoch);
  clock.mark(3);
}

}  // namespace switchyard
