// Host side shared by the FFI sources of the product library (registry.cu, ffi_allreduce.cu,
// ffi_attention.cu) and of the diagnostic build (ffi_diagnostics.cu): the registry of workspaces
// and peers that sy_init builds, the error string of the C API, and the handlers' common checks.
// Everything here has hidden visibility (the library is built with -fvisibility=hidden).
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "common.cuh"
#include "layout.cuh"
#include "xla/ffi/api/ffi.h"

namespace switchyard {

constexpr int kMaxOrdinals = 64;  // CUDA device ordinals a process may register

struct Registry {
  bool ready = false;
  int world = 0;
  int ordinals[kMaxRanks] = {};
  int rank_of[kMaxOrdinals];
  char* base[kMaxRanks] = {};
  uint32_t* host_error = nullptr;  // pinned, mapped: one word per rank
  Peers peers[kMaxRanks];
  Layout layout{};
  int64_t oneshot_bytes = 0;
  int64_t twoshot_bytes = 0;
  size_t state_bytes = 0;
  std::atomic<unsigned long long> timeout_ns{10ull * 1000 * 1000 * 1000};
  std::atomic<unsigned long long> host_calls{0};
  Registry() {
    for (int& r : rank_of) r = -1;
  }
};

extern Registry g_registry;

// Sets sy_last_error(); returns 1 (the C API's failure code).
int fail(const std::string& msg);

// This call's peer table from the device ordinal XLA runs the handler for (no CUDA call).
xla::ffi::Error resolve(int32_t device, Peers* peers);

// The handler's result after its launch: a launch error, or success.
xla::ffi::Error launched();

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Loads the all-reduce kernels into the current device's context (ffi_allreduce.cu).
cudaError_t preload_allreduce_kernels();

#ifdef SWITCHYARD_DIAGNOSTICS
// Loads the diagnostic kernels into the current device's context (ffi_diagnostics.cu).
cudaError_t preload_diagnostic_kernels();
#endif

#ifdef SWITCHYARD_PHASE_TIMER
// Each file's phase counters (phase_timer.cuh, collect_phases), for sy_phase_read.
cudaError_t collect_allreduce_phases(PhaseTotals& t);
cudaError_t collect_attention_phases(PhaseTotals& t);
#endif

}  // namespace switchyard
