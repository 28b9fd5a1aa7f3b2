// The registry of the all-reduce kernels and the C API the Python side (native.py, ctypes) sets
// them up with: per GPU a workspace (launch.cuh: state words, one-shot slots, two-shot areas),
// peer access between every pair and each rank's peer table; the mapped host error words; init,
// reset, error and counter queries. The FFI handlers (ffi_allreduce.cu) only read what is built here.
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "launch.cuh"
#include "registry.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace switchyard {

Registry g_registry;

namespace {

std::string g_last_error;

bool any_host_error() {
  if (!g_registry.host_error) return false;
  for (int r = 0; r < g_registry.world; ++r)
    if (reinterpret_cast<volatile uint32_t*>(g_registry.host_error)[r] != 0) return true;
  return false;
}

}  // namespace

int fail(const std::string& msg) {
  g_last_error = msg;
  return 1;
}

// Find this call's rank from the device ordinal XLA runs the handler for. No CUDA call here: any
// runtime query issued while XLA captures the stream into a command buffer could invalidate the
// capture.
ffi::Error resolve(int32_t device, Peers* peers) {
  Registry& g = g_registry;
  g.host_calls.fetch_add(1, std::memory_order_relaxed);
  if (!g.ready)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "switchyard kernels are not initialised (switchyard.kernels.init)");
  if (any_host_error())
    return ffi::Error(ffi::ErrorCode::kAborted,
                      "switchyard all-reduce: a peer GPU never reached a barrier (timed out); "
                      "results since then are invalid; call switchyard.kernels.reset()");
  if (device < 0 || device >= kMaxOrdinals || g.rank_of[device] < 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "device " + std::to_string(device) + " is not registered with switchyard");
  *peers = g.peers[g.rank_of[device]];
  peers->timeout_ns = g.timeout_ns.load(std::memory_order_relaxed);
  return ffi::Error::Success();
}

ffi::Error launched() {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("kernel launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace switchyard

using namespace switchyard;

#define SY_CHECK(call)                                                                        \
  do {                                                                                        \
    cudaError_t e_ = (call);                                                                  \
    if (e_ != cudaSuccess)                                                                    \
      return fail(std::string(#call) + " failed: " + cudaGetErrorString(e_));                 \
  } while (0)

// Every kernel the library launches, loaded into the current device's context (see
// preload_allreduce_kernels).
static cudaError_t preload_all_kernels() {
  cudaError_t e = preload_allreduce_kernels();
#ifdef SWITCHYARD_DIAGNOSTICS
  if (e == cudaSuccess) e = preload_diagnostic_kernels();
#endif
  return e;
}

// ---- C API for the Python side (ctypes) ------------------------------------------------------
// Exported symbols (the library is built with -fvisibility=hidden so that the statically linked
// CUDA runtime does not leak into the process).
#pragma GCC visibility push(default)
extern "C" {

const char* sy_last_error() { return g_last_error.c_str(); }

int sy_is_ready() { return g_registry.ready ? 1 : 0; }
int sy_world() { return g_registry.world; }
long long sy_oneshot_bytes() { return g_registry.oneshot_bytes; }
long long sy_twoshot_bytes() { return g_registry.twoshot_bytes; }
unsigned long long sy_host_calls() { return g_registry.host_calls.load(); }
void sy_set_timeout_ns(unsigned long long ns) { g_registry.timeout_ns.store(ns); }

// Free and total bytes of GPU `ordinal` as the driver counts them (every allocation on it, this
// process's and others'): the figure the engine sizes its KV pool from where XLA's allocator keeps
// no statistics (the virtual-memory allocator). Returns 0 on success; sy_last_error() says why not.
int sy_device_memory(int ordinal, unsigned long long* free_bytes, unsigned long long* total_bytes) {
  if (ordinal < 0 || ordinal >= kMaxOrdinals) return fail("device memory: bad device ordinal");
  int prev = 0;
  cudaGetDevice(&prev);
  size_t free_now = 0, total = 0;
  cudaError_t e = cudaSetDevice(ordinal);
  if (e == cudaSuccess) e = cudaMemGetInfo(&free_now, &total);
  cudaSetDevice(prev);
  if (e != cudaSuccess) return fail(std::string("cudaMemGetInfo: ") + cudaGetErrorString(e));
  *free_bytes = free_now;
  *total_bytes = total;
  return 0;
}

// Allocate a workspace on every listed device, enable peer access between all pairs and build
// the peer tables. `ordinals` are CUDA device ordinals in rank order. Idempotent for the same
// device list. Returns 0 on success; sy_last_error() says why not.
int sy_init(int world, const int* ordinals, long long oneshot_bytes, long long twoshot_bytes) {
  Registry& g = g_registry;
  if (g.ready) {
    bool same = world == g.world;
    for (int r = 0; same && r < world; ++r) same = ordinals[r] == g.ordinals[r];
    return same ? 0 : fail("already initialised with a different device list");
  }
  if (world < 1 || world > kMaxRanks) return fail("world size must be 1.." + std::to_string(kMaxRanks));
  for (int r = 0; r < world; ++r)
    if (ordinals[r] < 0 || ordinals[r] >= kMaxOrdinals) return fail("bad device ordinal");
  // Peer access between every pair; P2P support is a precondition (no staging through the host).
  for (int a = 0; a < world; ++a) {
    for (int b = 0; b < world; ++b) {
      if (a == b) continue;
      int can = 0;
      SY_CHECK(cudaDeviceCanAccessPeer(&can, ordinals[a], ordinals[b]));
      if (!can)
        return fail("no peer access from GPU " + std::to_string(ordinals[a]) + " to GPU " +
                    std::to_string(ordinals[b]));
      SY_CHECK(cudaSetDevice(ordinals[a]));
      cudaError_t e = cudaDeviceEnablePeerAccess(ordinals[b], 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // XLA or another library enabled it first: fine
      } else if (e != cudaSuccess) {
        return fail(std::string("cudaDeviceEnablePeerAccess: ") + cudaGetErrorString(e));
      }
    }
  }
  const Workspace ws = make_workspace(world, oneshot_bytes, twoshot_bytes);
  const Layout& L = ws.layout;
  const size_t state_bytes = ws.state_bytes;
  const size_t total = ws.total_bytes;

  uint32_t* host_error = nullptr;
  SY_CHECK(cudaHostAlloc(&host_error, sizeof(uint32_t) * kMaxRanks, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(host_error, 0, sizeof(uint32_t) * kMaxRanks);
  for (int r = 0; r < world; ++r) {
    SY_CHECK(cudaSetDevice(ordinals[r]));
    // Plain device memory (never managed memory, never multicast objects).
    SY_CHECK(cudaMalloc(&g.base[r], total));
    SY_CHECK(cudaMemset(g.base[r], 0, total));
    SY_CHECK(empty_oneshot_slots(g.base[r], state_bytes, L));
    SY_CHECK(preload_all_kernels());
    SY_CHECK(cudaDeviceSynchronize());
  }
  for (int r = 0; r < world; ++r) {
    uint32_t* dev_err = nullptr;
    SY_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_err), host_error, 0));
    g.peers[r] = make_peers(r, world, g.base, state_bytes, dev_err, g.timeout_ns.load());
    g.ordinals[r] = ordinals[r];
    g.rank_of[ordinals[r]] = r;
  }
  g.host_error = host_error;
  g.layout = L;
  g.world = world;
  g.state_bytes = state_bytes;
  g.oneshot_bytes = ws.oneshot_bytes;
  g.twoshot_bytes = twoshot_bytes;
  g.ready = true;
  return 0;
}

// Non-zero if any GPU's barrier timed out. Reads mapped host memory: no synchronisation.
int sy_error() {
  const Registry& g = g_registry;
  if (!g.ready) return 0;
  uint32_t e = 0;
  for (int r = 0; r < g.world; ++r) e |= reinterpret_cast<volatile uint32_t*>(g.host_error)[r];
  return static_cast<int>(e);
}

// Wait for all devices, then zero every state word (epochs, flags, errors) and empty every
// one-shot slot on every GPU. Only valid while no all-reduce is in flight (it synchronises the
// devices first). `epoch` lets tests start the counters near 2^32 to exercise wrap-around.
int sy_reset(unsigned int epoch) {
  const Registry& g = g_registry;
  if (!g.ready) return fail("not initialised");
  for (int r = 0; r < g.world; ++r) {
    SY_CHECK(cudaSetDevice(g.ordinals[r]));
    SY_CHECK(cudaDeviceSynchronize());
  }
  const State s = fresh_state(epoch);
  for (int r = 0; r < g.world; ++r) {
    SY_CHECK(cudaSetDevice(g.ordinals[r]));
    SY_CHECK(reset_workspace(g.base[r], s, g.state_bytes, g.layout));
    reinterpret_cast<volatile uint32_t*>(g.host_error)[r] = 0;
  }
  return 0;
}

// Completed launches on GPU `rank` (launch_count; for tests and diagnostics only).
long long sy_device_calls(int rank) {
  const Registry& g = g_registry;
  if (!g.ready || rank < 0 || rank >= g.world) return -1;
  if (cudaSetDevice(g.ordinals[rank]) != cudaSuccess) return -1;
  return launch_count(g.base[rank]);
}

}  // extern "C"
#pragma GCC visibility pop
