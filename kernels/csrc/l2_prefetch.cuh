// Warming L2 with the next kernel's weights while a latency-bound kernel leaves HBM idle.
//
// In a batch-1 decode step the GEMVs stream every weight once at close to HBM bandwidth, while the
// kernels between them (decode attention, the fused all-reduce + RMSNorm) wait on chains of
// latencies and move almost nothing. Those kernels take the first bytes of the matrix that the
// next kernel reads and ask L2 to fetch them (cp.async.bulk.prefetch.L2, Hopper's bulk-copy
// engine: one instruction per chunk, no registers, no completion to wait for). The next GEMV then
// finds that part in L2 and the HBM time of those bytes overlaps the latency-bound kernel instead
// of following it. Prefetches are hints: nothing depends on them for correctness, and a kernel
// may exit while they are still in flight.
#pragma once

#include <stdint.h>

namespace switchyard {

constexpr int64_t kPrefetchChunk = 4096;  // bytes per bulk prefetch instruction

// Prefetch [base, base + bytes) into L2, spread over `threads` callers: caller `index` takes
// chunks index, index + threads, ... . base must be 16-byte aligned; a tail of < 16 bytes is left
// out (bulk sizes are multiples of 16).
__device__ __forceinline__ void prefetch_l2(const void* base, int64_t bytes, int64_t index, int64_t threads) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const char* p = static_cast<const char*>(base);
  for (int64_t off = index * kPrefetchChunk; off < bytes; off += threads * kPrefetchChunk) {
    const uint32_t size = static_cast<uint32_t>(min(kPrefetchChunk, bytes - off)) & ~15u;
    // The memory clobber keeps the prefetch after the loads the caller issued before it: those
    // loads are on the kernel's critical path and should not queue behind the prefetched bytes.
    if (size) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(size) : "memory");
  }
#endif
}

}  // namespace switchyard
