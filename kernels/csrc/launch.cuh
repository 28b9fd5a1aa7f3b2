// Host side of the all-reduce kernels: the launch configuration of each kernel and the workspace
// layout. The XLA FFI handlers (ffi_allreduce.cu), the registry (registry.cu) and the one-GPU
// multi-rank check (tests/helpers/emulated_ranks.cu) use these, so the check launches exactly the
// handlers' grids.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "common.cuh"
#include "fused_rmsnorm.cuh"
#include "lamport.cuh"
#include "layout.cuh"

namespace switchyard {

constexpr int kThreads = 512;
constexpr int kOneshotMaxBlocks = 64;
constexpr int kFusedMaxBlocks = 1024;  // one row per block (no barrier pairs blocks: any grid works)
constexpr int kTwoshotMaxBlocks = kMaxBlocks;
static_assert(kTwoshotMaxBlocks <= kMaxBlocks, "flag slots of the two-shot barriers");
static_assert(kOneshotMaxBlocks <= kMaxGrid && kFusedMaxBlocks <= kMaxGrid && kTwoshotMaxBlocks <= kMaxGrid,
              "one launch counter per block index (common.cuh, Epochs)");

struct Grid {
  int blocks;
  int threads;
};

inline int64_t round_up(int64_t v, int64_t m) { return ceil_div(v, m) * m; }

inline int threads_for(int64_t work) {
  return static_cast<int>(std::min<int64_t>(kThreads, std::max<int64_t>(32, round_up(work, 32))));
}

// `packs`: packs of W elements in the message.
inline Grid oneshot_grid(int64_t packs) {
  const int threads = threads_for(packs);
  return {static_cast<int>(std::min<int64_t>(kOneshotMaxBlocks, ceil_div(packs, threads))), threads};
}

inline Grid twoshot_grid(int64_t packs, int world) {
  const int64_t slice = ceil_div(packs, world);
  const int threads = threads_for(slice);
  return {static_cast<int>(std::min<int64_t>(kTwoshotMaxBlocks, ceil_div(slice, threads))), threads};
}

// `row_packs`: packs of W elements per row (W divides the row).
inline Grid fused_grid(int64_t rows, int64_t row_packs) {
  const int threads = static_cast<int>(std::min<int64_t>(kFusedThreads, std::max<int64_t>(32, round_up(row_packs, 32))));
  return {static_cast<int>(std::min<int64_t>(kFusedMaxBlocks, rows)), threads};
}

// A workspace: the State words, then the data areas of `Layout` (same offsets on every GPU).
struct Workspace {
  Layout layout;
  size_t state_bytes;  // the data area starts here
  size_t total_bytes;
  int64_t oneshot_bytes;  // the largest one-shot (and fused) message per rank
};

inline Workspace make_workspace(int world, int64_t oneshot_bytes, int64_t twoshot_bytes) {
  const int64_t os_slot = round_up(std::max<int64_t>(oneshot_bytes, kPackBytes), 256);
  const int64_t ts_area = round_up(std::max<int64_t>(twoshot_bytes, kPackBytes) + world * kPackBytes * 2, 256);
  Workspace w{};
  w.layout.oneshot_off = 0;
  w.layout.oneshot_slot = os_slot;
  w.layout.scatter_off = 2 * world * os_slot;
  w.layout.gather_off = w.layout.scatter_off + ts_area;
  w.layout.twoshot_bytes = twoshot_bytes;
  w.state_bytes = round_up(sizeof(State), 256);
  w.total_bytes = w.state_bytes + w.layout.gather_off + ts_area;
  w.oneshot_bytes = os_slot;
  return w;
}

// The state words of a fresh workspace, or of one reset: every launch counter and barrier flag =
// epoch, no error (common.cuh, State).
inline State fresh_state(uint32_t epoch) {
  State s;
  std::memset(&s, 0, sizeof(s));
  for (auto& c : s.calls) c = epoch;
  for (auto& bar : s.flags)
    for (auto& blk : bar)
      for (auto& f : blk) f = epoch;
  return s;
}

// Rank r's view of the workspaces: bases[q] is rank q's workspace (a peer pointer where q != r),
// host_error the device address of the mapped host error words (one per rank).
inline Peers make_peers(int r, int world, char* const* bases, size_t state_bytes, uint32_t* host_error,
                        unsigned long long timeout_ns) {
  Peers P;
  std::memset(&P, 0, sizeof(P));
  P.rank = r;
  P.world = world;
  for (int q = 0; q < world; ++q) {
    P.state[q] = reinterpret_cast<State*>(bases[q]);
    P.data[q] = bases[q] + state_bytes;
  }
  P.self = P.state[r];
  P.host_error = host_error + r;
  P.timeout_ns = timeout_ns;
  return P;
}

// Every one-shot slot of a workspace empty (lamport.cuh: all bits set), on the current device.
inline cudaError_t empty_oneshot_slots(char* base, size_t state_bytes, const Layout& L) {
  return cudaMemset(base + state_bytes + L.oneshot_off, kEmptyByte, L.scatter_off - L.oneshot_off);
}

// A workspace as after init, with every counter and flag = `state`'s (fresh_state): a call cut
// short (timeout) can leave packs in one-shot slots, so they are emptied again. Current device;
// nothing may be in flight on it.
inline cudaError_t reset_workspace(char* base, const State& state, size_t state_bytes, const Layout& L) {
  cudaError_t e = cudaMemcpy(base, &state, sizeof(state), cudaMemcpyHostToDevice);
  if (e == cudaSuccess) e = empty_oneshot_slots(base, state_bytes, L);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  return e;
}

// The launches a workspace has completed (synchronous; current device): the count every launch
// counter holds, or -1 where they differ between block indices (common.cuh, Epochs) or the read fails.
inline long long launch_count(const char* base) {
  uint32_t calls[kMaxGrid];
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpy(calls, base + offsetof(State, calls), sizeof(calls), cudaMemcpyDeviceToHost) != cudaSuccess)
    return -1;
  for (uint32_t c : calls)
    if (c != calls[0]) return -1;
  return calls[0];
}

}  // namespace switchyard
