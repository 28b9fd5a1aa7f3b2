// Shared pieces of the Switchyard all-reduce kernels: element packs, workspace layout, the
// cross-GPU barrier and its bounded wait.
//
// Execution model. One process drives every GPU of the node. At init each GPU gets one
// cudaMalloc'ed workspace (state words + data buffers) and peer access is enabled between all
// pairs, so a kernel running on GPU r can load and store any peer's workspace through its plain
// device pointer (UVA over NVLink). Each XLA FFI call on GPU r launches ONE kernel; the N kernels
// (one per GPU, launched by XLA's per-device threads) meet at barriers made of flag words.
//
// Epochs. Every kernel launch is one "call". Each GPU counts its completed launches in its own
// device memory, once per block index (State::calls[b], every entry equal between launches):
// block b of a launch reads entry b at its start (epoch = calls + 1, used for all its flags and
// halves) and stores the new count there at its end (finish_launch); while they wait for their
// peers, the grid's threads store it into every entry that no block of this launch reads
// (store_absent_counters). So no block waits for another and no fence or atomic closes a launch,
// yet the next launch (stream order) finds every entry equal to it. Nothing comes from the host
// per call, so the same kernel node can be replayed from a CUDA graph forever. All GPUs run the
// same sequence of calls (SPMD), so their counters stay equal. Comparisons are wrap-safe (int32
// difference), and a peer is at most one call ahead of us at a barrier, so the 32-bit counter may
// wrap freely.
//
// Bounded wait. A peer that never arrives would spin a kernel forever and wedge the GPU. Waits
// give up after `timeout_ns` of %globaltimer, set a sticky error word in device memory and in
// mapped pinned host memory (the host reads it without synchronising), and later waits skip
// waiting once the sticky word is set (barriers check it before they spin; the one-shot and fused
// kernels' threads read it once at their start, lamport.cuh). Results after an error are garbage;
// the host raises.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "phase_timer.cuh"

namespace switchyard {

constexpr int kMaxRanks = 8;      // 2, 4 or 8 GPUs of one NVSwitch node (any 1..8 works)
constexpr int kMaxBlocks = 128;   // flag slots per barrier; barrier kernels never use more blocks
constexpr int kMaxGrid = 1024;    // launch counters: no kernel with an epoch uses more blocks
constexpr int kNumBarriers = 2;   // two-shot needs two distinct barrier points per call
constexpr int kPackBytes = 16;    // one 128-bit load/store per thread per step

// Error codes written into State::error / the host error word.
constexpr uint32_t kErrTimeout = 1;

// Per-GPU state words at the start of every workspace.
struct State {
  uint32_t error;   // sticky: non-zero once any barrier timed out on this GPU
  uint32_t pad[3];
  // flags[bar][block][peer]: written by `peer` (remotely) when its block `block` reaches
  // barrier `bar` in launch `epoch`; read only by this GPU.
  uint32_t flags[kNumBarriers][kMaxBlocks][kMaxRanks];
  // calls[b]: completed launches (epoch of the last one), one copy per block index (see Epochs).
  alignas(16) uint32_t calls[kMaxGrid];
};

// Arguments shared by all kernels. Peer pointers come from the registry (stable for the life of
// the process), so they can be baked into CUDA graphs.
struct Peers {
  int rank;
  int world;
  State* self;                       // this GPU's state
  State* state[kMaxRanks];           // every rank's state (peer pointers, self included)
  char* data[kMaxRanks];             // every rank's data area
  uint32_t* host_error;              // mapped pinned host word for this GPU
  unsigned long long timeout_ns;     // bounded wait
};

// ---- element conversion --------------------------------------------------------------------
template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
// Round to nearest even, as XLA's convert does, so results match the reference path bit for bit
// wherever the arithmetic is the same.
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// ---- packs ---------------------------------------------------------------------------------
// A pack is W elements moved as one access. W = 16 bytes / sizeof(T) on the vector path, or 1 on
// the scalar path (used when a caller's pointer is not 16-byte aligned). Packs at the end of a
// buffer whose element count is not a multiple of W are loaded element by element and padded
// with zeros, so workspaces always hold whole packs and any element count works.
template <typename T, int W>
struct alignas(sizeof(T) * W) Pack {
  T v[W];
};

template <typename T, int W>
__device__ __forceinline__ Pack<T, W> load_pack(const T* base, int64_t pack, int64_t n) {
  Pack<T, W> p;
  const int64_t first = pack * W;
  if (first + W <= n) {
    p = *reinterpret_cast<const Pack<T, W>*>(base + first);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) p.v[i] = first + i < n ? base[first + i] : from_f32<T>(0.f);
  }
  return p;
}

template <typename T, int W>
__device__ __forceinline__ void store_pack(T* base, int64_t pack, int64_t n, const Pack<T, W>& p) {
  const int64_t first = pack * W;
  if (first + W <= n) {
    *reinterpret_cast<Pack<T, W>*>(base + first) = p;
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i)
      if (first + i < n) base[first + i] = p.v[i];
  }
}

// Where a pack load reads through.
enum class Via {
  kReadOnly,  // the read-only data cache (inputs this kernel never writes)
  kL2,        // ld.global.cg, bypassing L1: workspace packs written by peers (L1 is not coherent
              // with NVLink writes, and a line cached from two calls ago must never be returned)
  kDefault,   // plain load (memory this kernel wrote itself)
};

// A whole pack as one vector load. Dereferencing a Pack pointer and copying the result
// (canonical_pack's memcpy) let the compiler split the load into 16 byte loads, which cost the
// fused kernel 0.5 us before its push (benchmarks/results/kernel-phases-before-h200x2.json).
template <typename T, int W, Via kVia = Via::kReadOnly>
__device__ __forceinline__ Pack<T, W> load_vec(const Pack<T, W>* p) {
  using Unit = typename std::conditional<sizeof(Pack<T, W>) == 16, uint4,
               typename std::conditional<sizeof(Pack<T, W>) == 4, unsigned int, unsigned short>::type>::type;
  static_assert(sizeof(Unit) == sizeof(Pack<T, W>), "a pack is 2, 4 or 16 bytes");
  const Unit* q = reinterpret_cast<const Unit*>(p);
  Unit u;
  if constexpr (kVia == Via::kReadOnly) u = __ldg(q);
  else if constexpr (kVia == Via::kL2) u = __ldcg(q);
  else u = *q;
  Pack<T, W> r;
  memcpy(&r, &u, sizeof(r));
  return r;
}

// Sum of one pack from every rank, in float32, in rank order 0..world-1. The order is fixed and
// identical on every GPU, so every GPU produces identical bits.
template <typename T, int W>
__device__ __forceinline__ void accumulate(float (&acc)[W], const Pack<T, W>& p, bool first) {
#pragma unroll
  for (int i = 0; i < W; ++i) acc[i] = first ? to_f32(p.v[i]) : acc[i] + to_f32(p.v[i]);
}

template <typename T, int W>
__device__ __forceinline__ Pack<T, W> to_pack(const float (&acc)[W]) {
  Pack<T, W> p;
#pragma unroll
  for (int i = 0; i < W; ++i) p.v[i] = from_f32<T>(acc[i]);
  return p;
}

// ---- flags and barrier ---------------------------------------------------------------------
__device__ __forceinline__ void st_release_sys(uint32_t* addr, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* addr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Epoch of this launch: calls + 1. Every thread reads its block's entry itself (one L2 line,
// broadcast within a warp), so no block-wide synchronisation sits before the first store of a launch.
__device__ __forceinline__ uint32_t read_epoch(const Peers& P) {
  return *reinterpret_cast<volatile uint32_t*>(&P.self->calls[blockIdx.x]) + 1u;
}

// Entries >= G (G = gridDim.x) are read by no block of this launch, so any thread may store the
// new count there at any time of the launch: the kernels do it while they wait for their peers'
// data (after their own stores went out). The grid's threads share them: whole 16-byte vectors
// from the first multiple of 4, single words before it.
__device__ __forceinline__ void store_absent_counters(const Peers& P, uint32_t epoch) {
  static_assert(kMaxGrid % 4 == 0, "whole vectors of counters");
  uint32_t* calls = P.self->calls;
  const int G = gridDim.x;
  const int lo = (G + 3) & ~3;  // <= kMaxGrid, a multiple of 4
  const int head = G + static_cast<int>(threadIdx.x);
  if (blockIdx.x == 0 && head < lo) calls[head] = epoch;
  const uint4 v = make_uint4(epoch, epoch, epoch, epoch);
  uint4* vec = reinterpret_cast<uint4*>(calls + lo);
  const int nvec = (kMaxGrid - lo) / 4;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += G * blockDim.x) vec[i] = v;
}

// Called by every block at its very end: once all its threads have read entry b (the barrier),
// the block stores the new count into entry b, which only this block reads, so no block waits
// for another: the launch's end makes every entry visible to the next launch on this stream.
// History, on emulated ranks (benchmarks/results/emulated-counters-*-h100.json: strided,
// vector-end, while-waiting; benchmarks/NOTES.md): counting finished blocks with a fence and an
// atomic on one word closed every launch of more than one block 0.6-1.2 us later; storing every
// entry here, one volatile word at a time (1024 / blockDim per thread), made one-block launches
// up to 0.7 us slower; 16-byte vectors up to 0.25 us. Stored while waiting (this version) they
// cost as much on emulated ranks, which barely wait; over NVLink they sit in a ~1 us wait.
__device__ __forceinline__ void finish_launch(const Peers& P, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) P.self->calls[blockIdx.x] = epoch;
}

// A bounded wait gave up: record it where the host sees it without a sync, and make every later
// wait on this GPU give up at once (see State::error).
__device__ __forceinline__ void record_timeout(const Peers& P) {
  atomicExch(&P.self->error, kErrTimeout);
  *reinterpret_cast<volatile uint32_t*>(P.host_error) = kErrTimeout;
  __threadfence_system();
}

__device__ __forceinline__ bool timed_out_before(const Peers& P) {
  return *reinterpret_cast<volatile uint32_t*>(&P.self->error) != 0;
}

// The rank k places after ours (0 <= k < world), without an integer division on the way to the
// first store.
__device__ __forceinline__ int rank_after(const Peers& P, int k) {
  const int r = P.rank + k;
  return r < P.world ? r : r - P.world;
}

// Barrier `bar` for this block across all ranks.
//
// Memory ordering, step by step:
//  1. __syncthreads(): every thread of this block has issued its stores for the phase (local or
//     NVLink stores into peers' workspaces) before thread t < world proceeds (CTA-scope order).
//  2. Thread t stores `epoch` into flags[bar][block][rank] of GPU t with st.release.sys. Release is
//     cumulative: all writes ordered before it (the whole block's, through the bar.sync of step 1)
//     become visible at system scope to any thread that acquires this flag value.
//  3. Thread t spins with ld.acquire.sys on our own flags[bar][block][t] until GPU t's block with
//     the same index has done step 2 for this epoch (or one later: a peer may already be in the
//     next call). The acquire orders every later read of this thread after GPU t's released
//     writes.
//  4. __syncthreads(): the other threads of the block are ordered after the acquires of step 3,
//     so their subsequent loads (ld.global.cg, load_vec with Via::kL2) see the peers' data.
// Blocks with the same index exchange the same element ranges on every rank (the partition of
// work into blocks depends only on sizes and world, identical on all ranks), so a per-block
// barrier is enough: no grid-wide synchronisation is needed.
__device__ __forceinline__ void block_barrier(const Peers& P, int bar, uint32_t epoch) {
  __syncthreads();
  const int t = threadIdx.x;
  if (t < P.world) {
    st_release_sys(&P.state[t]->flags[bar][blockIdx.x][P.rank], epoch);
    const uint32_t* mine = &P.self->flags[bar][blockIdx.x][t];
    if (!timed_out_before(P)) {
      const unsigned long long start = globaltimer();
      while (static_cast<int32_t>(ld_acquire_sys(mine) - epoch) < 0) {
        if (globaltimer() - start > P.timeout_ns) {
          record_timeout(P);
          break;
        }
      }
    }
  }
  __syncthreads();
}

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace switchyard
