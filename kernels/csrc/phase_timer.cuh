// Phase timer for diagnostic builds (compiled with -DSWITCHYARD_PHASE_TIMER; in normal builds
// every call below compiles to nothing).
//
// A kernel constructs one PhaseClock at its start and calls mark(i) (1 <= i < kPhaseSlots) where
// a phase ends. Thread 0 of every block stamps:
//   - the SM cycle counter (clock64) and %globaltimer deltas since the block's start, summed over
//     all blocks and launches into g_phase_cycles[i] and g_phase_ns[i] (slot 0 counts block
//     launches);
//   - %globaltimer at every mark for the block's most recent launch (g_phase_last), which shows
//     how far apart blocks start and end (launch spread, the wait for a peer).
// Thread 0's view is the block's view wherever the phase ends at a barrier or a data dependence
// that thread 0 takes part in. The host reads and clears them with sy_phase_read (ffi_diagnostics.cu).
//
// Each source file that launches timed kernels (ffi_allreduce.cu, ffi_attention.cu) has its own copy
// of the counters (its own device module); collect_phases() adds that file's copy into the totals.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <memory>

namespace switchyard {

constexpr int kPhaseSlots = 8;
constexpr int kPhaseBlocks = 1024;

// One GPU's counters as sy_phase_read hands them out.
struct PhaseTotals {
  unsigned long long cycles[kPhaseSlots];
  unsigned long long ns[kPhaseSlots];
  unsigned long long last[kPhaseBlocks][kPhaseSlots];
};

#ifdef SWITCHYARD_PHASE_TIMER
// static: one copy per source file, no symbol clashes between them.
static __device__ unsigned long long g_phase_cycles[kPhaseSlots];
static __device__ unsigned long long g_phase_ns[kPhaseSlots];
static __device__ unsigned long long g_phase_last[kPhaseBlocks][kPhaseSlots];

__device__ __forceinline__ unsigned long long phase_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct PhaseClock {
  long long start = 0;
  unsigned long long start_ns = 0;
  int block = 0;
  __device__ __forceinline__ PhaseClock() {
    if (threadIdx.x != 0) return;
    block = min(static_cast<int>(blockIdx.x + blockIdx.y * gridDim.x), kPhaseBlocks - 1);
    start = clock64();
    start_ns = phase_ns();
    atomicAdd(&g_phase_cycles[0], 1ull);
    for (int i = 1; i < kPhaseSlots; ++i) g_phase_last[block][i] = 0;
    g_phase_last[block][0] = start_ns;
  }
  __device__ __forceinline__ void mark(int i) {
    if (threadIdx.x != 0) return;
    const unsigned long long now = phase_ns();
    atomicAdd(&g_phase_cycles[i], static_cast<unsigned long long>(clock64() - start));
    atomicAdd(&g_phase_ns[i], now - start_ns);
    g_phase_last[block][i] = now;
  }
};

// Adds this source file's counters into `t` and clears its sums; a block's stamps replace those in
// `t` where its latest launch started later. Current device; nothing timed may be in flight. static,
// as the counters it reads: an inline function would be merged across files by the linker.
[[maybe_unused]] static cudaError_t collect_phases(PhaseTotals& t) {
  const auto unit = std::make_unique<PhaseTotals>();
  cudaError_t e = cudaMemcpyFromSymbol(unit->cycles, g_phase_cycles, sizeof(g_phase_cycles));
  if (e == cudaSuccess) e = cudaMemcpyFromSymbol(unit->ns, g_phase_ns, sizeof(g_phase_ns));
  if (e == cudaSuccess) e = cudaMemcpyFromSymbol(unit->last, g_phase_last, sizeof(g_phase_last));
  void* sym = nullptr;
  if (e == cudaSuccess) e = cudaGetSymbolAddress(&sym, g_phase_cycles);
  if (e == cudaSuccess) e = cudaMemset(sym, 0, sizeof(g_phase_cycles));
  if (e == cudaSuccess) e = cudaGetSymbolAddress(&sym, g_phase_ns);
  if (e == cudaSuccess) e = cudaMemset(sym, 0, sizeof(g_phase_ns));
  if (e != cudaSuccess) return e;
  for (int i = 0; i < kPhaseSlots; ++i) {
    t.cycles[i] += unit->cycles[i];
    t.ns[i] += unit->ns[i];
  }
  for (int b = 0; b < kPhaseBlocks; ++b)
    if (unit->last[b][0] > t.last[b][0])
      for (int i = 0; i < kPhaseSlots; ++i) t.last[b][i] = unit->last[b][i];
  return cudaSuccess;
}
#else
struct PhaseClock {
  __device__ __forceinline__ void mark(int) {}
};
#endif

}  // namespace switchyard
