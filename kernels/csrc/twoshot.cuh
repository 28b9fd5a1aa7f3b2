// Two-shot all-reduce (MultiShot: reduce-scatter then all-gather), two synchronisation points
// regardless of the number of GPUs, plain NVLink peer stores only (never NVLink multicast).
//
// The message of P packs is cut into `world` slices of S = ceil(P / world) packs; rank s owns
// slice s. Each GPU's workspace has a scatter area [world][S] and a gather area [world][S].
//   1. scatter: rank r stores slice s of its input into scatter[r] of GPU s, for every s;
//   2. barrier 0: every rank's slice contributions have arrived;
//   3. reduce: rank r sums scatter[0..world-1] of its own workspace in float32 in rank order,
//      writes the result into its own output (slice r) and stores it into gather[r] of every
//      other GPU;
//   4. barrier 1: every slice has arrived;
//   5. gather: rank r copies gather[s] (s != r) of its own workspace into its output.
// Each slice is reduced exactly once, by its owner, and copied bit for bit: all ranks end with
// identical outputs. Per rank, 2 (world-1)/world of the message crosses NVLink, against
// (world-1) for one-shot, which is why two-shot wins for large messages.
//
// Reuse of the workspace without double buffering:
//  - scatter: a peer writes our scatter area of launch e+1 before its barrier 0 of e+1, i.e.
//    after its launch e finished, which needed barrier 1 of e from all our blocks, which each of
//    our blocks passes only after finishing its step 3 reads of launch e;
//  - gather: a peer writes our gather area of launch e+1 after passing barrier 0 of e+1, which
//    needs at least one of our blocks of launch e+1, so our launch e (step 5 reads) is complete.
//
// Work partition: within-slice index j belongs to block (j / blockDim) mod gridDim in all three
// phases and on every rank, so per-block barriers suffice.
#pragma once
#include "common.cuh"
#include "layout.cuh"

namespace switchyard {

template <typename T, int W>
__global__ void __launch_bounds__(1024) twoshot_kernel(Peers P, Layout L, const T* __restrict__ in,
                                                       T* __restrict__ out, int64_t n) {
  const uint32_t epoch = read_epoch(P);
  const int64_t packs = ceil_div(n, W);
  const int64_t S = ceil_div(packs, P.world);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  auto scatter = [&](int gpu, int slot) {
    return reinterpret_cast<Pack<T, W>*>(P.data[gpu] + L.scatter_off) + slot * S;
  };
  auto gather = [&](int gpu, int slot) {
    return reinterpret_cast<Pack<T, W>*>(P.data[gpu] + L.gather_off) + slot * S;
  };

  // Phase 1: scatter slices to their owners (packs past the end are zero-filled by load_pack).
  for (int64_t j = first; j < S; j += stride) {
    for (int k = 0; k < P.world; ++k) {
      const int s = rank_after(P, k);
      scatter(s, P.rank)[j] = load_pack<T, W>(in, s * S + j, n);
    }
  }

  store_absent_counters(P, epoch);  // local stores; the barrier's release waits for the NVLink ones anyway
  block_barrier(P, 0, epoch);

  // Phase 2: reduce the owned slice in rank order; keep it and send it to every peer.
  for (int64_t j = first; j < S; j += stride) {
    float acc[W];
    for (int q = 0; q < P.world; ++q)
      accumulate<T, W>(acc, load_vec<T, W, Via::kL2>(scatter(P.rank, q) + j), q == 0);
    const Pack<T, W> r = to_pack<T, W>(acc);
    store_pack<T, W>(out, P.rank * S + j, n, r);
    for (int k = 1; k < P.world; ++k) gather(rank_after(P, k), P.rank)[j] = r;
  }

  block_barrier(P, 1, epoch);

  // Phase 3: copy the other ranks' reduced slices out of the local gather area.
  for (int64_t j = first; j < S; j += stride) {
    for (int k = 1; k < P.world; ++k) {
      const int s = rank_after(P, k);
      store_pack<T, W>(out, s * S + j, n, load_vec<T, W, Via::kL2>(gather(P.rank, s) + j));
    }
  }

  finish_launch(P, epoch);
}

}  // namespace switchyard
