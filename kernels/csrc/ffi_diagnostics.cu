// Diagnostics, compiled only into the diagnostic library (python -m switchyard.kernels.build
// --diagnostics, or --phase-timer), never into the product library: the device-side timestamp that
// benchmarks/allreduce.py and benchmarks/kernel_phases.py bracket their chains with, and
// sy_phase_read, which hands out the phase timers of a -DSWITCHYARD_PHASE_TIMER build
// (phase_timer.cuh).
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>

#include "common.cuh"
#include "registry.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace switchyard;

namespace {

// Writes %globaltimer (ns) once the stream reaches it. The first operand is aliased to the first
// result so that a chain of operations can be ordered through it without copying. The result is
// u32[2] (low, high word) so that JAX needs no 64-bit mode.
__global__ void timestamp_kernel(uint32_t* out) {
  const unsigned long long t = globaltimer();
  out[0] = static_cast<uint32_t>(t);
  out[1] = static_cast<uint32_t>(t >> 32);
}

ffi::Error TimestampImpl(cudaStream_t stream, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>,
                         ffi::Result<ffi::Buffer<ffi::U32>> ts) {
  if (ts->element_count() < 2) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "timestamp needs u32[2]");
  timestamp_kernel<<<1, 1, 0, stream>>>(ts->typed_data());
  return launched();
}

}  // namespace

namespace switchyard {

cudaError_t preload_diagnostic_kernels() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, timestamp_kernel);
}

}  // namespace switchyard

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(SyTimestamp, TimestampImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

extern "C" {

// Copy GPU `ordinal`'s phase counters out (cycles[kPhaseSlots], ns[kPhaseSlots],
// last[kPhaseBlocks * kPhaseSlots]) and clear the sums. Returns 1 where the build has no phase
// timer (a diagnostic build without -DSWITCHYARD_PHASE_TIMER).
int sy_phase_read(int ordinal, unsigned long long* cycles, unsigned long long* ns, unsigned long long* last) {
#ifdef SWITCHYARD_PHASE_TIMER
  const auto totals = std::make_unique<PhaseTotals>();  // zeroed
  int prev = 0;
  cudaGetDevice(&prev);
  cudaError_t e = cudaSetDevice(ordinal);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = collect_allreduce_phases(*totals);
  if (e == cudaSuccess) e = collect_attention_phases(*totals);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  cudaSetDevice(prev);
  if (e != cudaSuccess) return fail(std::string("phase timer: ") + cudaGetErrorString(e));
  std::memcpy(cycles, totals->cycles, sizeof(totals->cycles));
  std::memcpy(ns, totals->ns, sizeof(totals->ns));
  std::memcpy(last, totals->last, sizeof(totals->last));
  return 0;
#else
  (void)ordinal, (void)cycles, (void)ns, (void)last;
  return 1;
#endif
}

}  // extern "C"

#pragma GCC visibility pop
