// The all-reduce kernels with several ranks on ONE GPU, for machines with a single GPU.
//
// Each emulated rank gets its own workspace (the layout of launch.cuh), its own stream and its own
// Peers table pointing at the other ranks' workspaces, exactly as sy_init builds them for one GPU
// each; the kernels cannot tell the difference except in speed (a "peer" store is a local store,
// not an NVLink trip). Every call launches the handlers' grids (launch.cuh) on every rank's
// stream, so the ranks' kernels run concurrently and exchange through the same flag-free slots,
// launch counters and barriers as on a node. Timings from here are not NVLink timings.
//
// Built and driven by tests/kernels/test_kernels_emulated.py through ctypes (a C API, host buffers in
// and out). A configuration whose blocks cannot all be resident at once is refused: ranks that
// wait for blocks that never start would only end at the bounded wait.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common.cuh"
#include "fused_rmsnorm.cuh"
#include "launch.cuh"
#include "oneshot.cuh"
#include "twoshot.cuh"

using namespace switchyard;

namespace {

enum Kernel { kOneShot = 0, kTwoShot = 1, kFused = 2, kFusedPartials = 3 };

struct Emulation {
  int world = 0;
  Workspace ws{};
  char* base[kMaxRanks] = {};
  cudaStream_t stream[kMaxRanks] = {};
  Peers peers[kMaxRanks];
  uint32_t* host_error = nullptr;
};

Emulation g;
std::string g_error;

int fail(const std::string& msg) {
  g_error = msg;
  return 1;
}

#define EMU_CHECK(call)                                                                       \
  do {                                                                                        \
    cudaError_t e_ = (call);                                                                  \
    if (e_ != cudaSuccess) return fail(std::string(#call) + ": " + cudaGetErrorString(e_));   \
  } while (0)

// The handler's grid for `kernel` (launch.cuh).
template <int W>
Grid grid_of(int kernel, int64_t n, int64_t hidden) {
  if (kernel == kOneShot) return oneshot_grid(ceil_div(n, W));
  if (kernel == kTwoShot) return twoshot_grid(ceil_div(n, W), g.world);
  return fused_grid(n / hidden, hidden / W);
}

// One call of `kernel` on rank r's stream, with the grid of grid_of.
template <typename T, int W>
cudaError_t launch(int kernel, int r, Grid grid, const void* x, const T* residual, const T* weight, T* out, T* out2,
                   int64_t n, int64_t hidden, int splits, float eps) {
  const Peers& P = g.peers[r];
  const Layout& L = g.ws.layout;
  switch (kernel) {
    case kOneShot:
      oneshot_kernel<T, W><<<grid.blocks, grid.threads, 0, g.stream[r]>>>(P, L, static_cast<const T*>(x), out, n);
      break;
    case kTwoShot:
      twoshot_kernel<T, W><<<grid.blocks, grid.threads, 0, g.stream[r]>>>(P, L, static_cast<const T*>(x), out, n);
      break;
    case kFused:
      fused_rmsnorm_kernel<T, W, false><<<grid.blocks, grid.threads, 0, g.stream[r]>>>(
          P, L, static_cast<const T*>(x), nullptr, 0, residual, weight, out, out2, n / hidden, hidden, eps);
      break;
    default:
      fused_rmsnorm_kernel<T, W, true><<<grid.blocks, grid.threads, 0, g.stream[r]>>>(
          P, L, nullptr, static_cast<const float*>(x), splits, residual, weight, out, out2, n / hidden, hidden, eps);
  }
  return cudaGetLastError();
}

template <typename T, int W>
const void* kernel_fn(int kernel) {
  switch (kernel) {
    case kOneShot: return reinterpret_cast<const void*>(oneshot_kernel<T, W>);
    case kTwoShot: return reinterpret_cast<const void*>(twoshot_kernel<T, W>);
    case kFused: return reinterpret_cast<const void*>(fused_rmsnorm_kernel<T, W, false>);
    default: return reinterpret_cast<const void*>(fused_rmsnorm_kernel<T, W, true>);
  }
}

template <typename T, int W>
int run_typed(int kernel, int64_t n, int64_t hidden, int splits, float eps, int64_t calls, int absent,
              int graph_reps, const void* x_host, const void* residual_host, const void* weight_host,
              void* out_host, void* out2_host, double* us_per_call) {
  const int world = g.world;
  const bool fused = kernel == kFused || kernel == kFusedPartials;
  const int64_t x_elem = kernel == kFusedPartials ? static_cast<int64_t>(sizeof(float)) * splits : sizeof(T);
  if (static_cast<int64_t>(n * sizeof(T)) > (kernel == kTwoShot ? g.ws.layout.twoshot_bytes : g.ws.oneshot_bytes))
    return fail("message larger than the workspace");
  if (fused && (hidden < 1 || n % hidden != 0 || hidden % W != 0)) return fail("fused: bad hidden size");

  // Every rank's blocks must be resident together (see the top of this file).
  int sms = 0, dev = 0, per_sm = 0;
  EMU_CHECK(cudaGetDevice(&dev));
  EMU_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const Grid grid = grid_of<W>(kernel, n, hidden);
  EMU_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel_fn<T, W>(kernel), grid.threads, 0));
  if (static_cast<int64_t>(grid.blocks) * world > static_cast<int64_t>(per_sm) * sms)
    return fail("does not fit: " + std::to_string(world) + " ranks x " + std::to_string(grid.blocks) +
                " blocks, " + std::to_string(per_sm) + " per SM on " + std::to_string(sms) + " SMs");

  std::vector<char*> bufs;
  auto alloc = [&](size_t bytes) -> char* {
    char* p = nullptr;
    if (cudaMalloc(&p, bytes < 16 ? 16 : bytes) != cudaSuccess) return nullptr;
    bufs.push_back(p);
    return p;
  };
  auto free_all = [&]() {
    for (char* p : bufs) cudaFree(p);
  };
  char *xs[kMaxRanks], *outs[kMaxRanks], *outs2[kMaxRanks];
  char* res = fused ? alloc(n * sizeof(T)) : nullptr;
  char* wt = fused ? alloc(hidden * sizeof(T)) : nullptr;
  int rc = 0;
  for (int r = 0; r < world && rc == 0; ++r) {
    xs[r] = alloc(n * x_elem);
    outs[r] = alloc(n * sizeof(T));
    outs2[r] = fused ? alloc(n * sizeof(T)) : nullptr;
    if (!xs[r] || !outs[r] || (fused && !outs2[r])) rc = fail("cudaMalloc failed");
  }
  if (fused && (!res || !wt)) rc = fail("cudaMalloc failed");
  cudaEvent_t start[kMaxRanks], stop[kMaxRanks];
  for (int r = 0; r < world; ++r) {
    cudaEventCreate(&start[r]);
    cudaEventCreate(&stop[r]);
  }
  auto body = [&]() -> int {
    const char* xh = static_cast<const char*>(x_host);
    for (int r = 0; r < world; ++r) {
      EMU_CHECK(cudaMemcpy(xs[r], xh + r * n * x_elem, n * x_elem, cudaMemcpyHostToDevice));
      // Poisoned outputs: an element the kernel never writes stays all ones (a NaN).
      EMU_CHECK(cudaMemset(outs[r], 0xFF, n * sizeof(T)));
      if (fused) EMU_CHECK(cudaMemset(outs2[r], 0xFF, n * sizeof(T)));
    }
    if (fused) {
      EMU_CHECK(cudaMemcpy(res, residual_host, n * sizeof(T), cudaMemcpyHostToDevice));
      EMU_CHECK(cudaMemcpy(wt, weight_host, hidden * sizeof(T), cudaMemcpyHostToDevice));
    }
    EMU_CHECK(cudaDeviceSynchronize());
    auto launch_all = [&]() -> int {
      for (int64_t c = 0; c < calls; ++c) {
        for (int r = 0; r < world; ++r) {
          if (r == absent) continue;
          EMU_CHECK((launch<T, W>(kernel, r, grid, xs[r], reinterpret_cast<const T*>(res),
                                  reinterpret_cast<const T*>(wt), reinterpret_cast<T*>(outs[r]),
                                  reinterpret_cast<T*>(outs2[r]), n, hidden, splits, eps)));
        }
      }
      return 0;
    };
    if (graph_reps <= 0) {  // direct launches, timed per rank
      for (int r = 0; r < world; ++r) EMU_CHECK(cudaEventRecord(start[r], g.stream[r]));
      if (int e = launch_all()) return e;
      for (int r = 0; r < world; ++r) EMU_CHECK(cudaEventRecord(stop[r], g.stream[r]));
      EMU_CHECK(cudaDeviceSynchronize());
      double best = -1;
      for (int r = 0; r < world; ++r) {
        if (r == absent) continue;
        float ms = 0;
        EMU_CHECK(cudaEventElapsedTime(&ms, start[r], stop[r]));
        const double us = 1000.0 * ms / static_cast<double>(calls);
        if (best < 0 || us < best) best = us;
      }
      *us_per_call = best;
    } else {
      // One CUDA graph holding every rank's chain of `calls` launches as a branch of its own
      // (forked from and joined into stream 0), as XLA's command buffers replay a step; each
      // replay is timed whole and the median replay / calls is reported.
      cudaStream_t s0 = g.stream[0];
      EMU_CHECK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeThreadLocal));
      EMU_CHECK(cudaEventRecord(start[0], s0));
      for (int r = 1; r < world; ++r) EMU_CHECK(cudaStreamWaitEvent(g.stream[r], start[0], 0));
      if (int e = launch_all()) return e;
      for (int r = 1; r < world; ++r) {
        EMU_CHECK(cudaEventRecord(stop[r], g.stream[r]));
        EMU_CHECK(cudaStreamWaitEvent(s0, stop[r], 0));
      }
      cudaGraph_t graph;
      EMU_CHECK(cudaStreamEndCapture(s0, &graph));
      cudaGraphExec_t exec;
      EMU_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      EMU_CHECK(cudaGraphLaunch(exec, s0));  // warm-up
      std::vector<double> samples;
      cudaEvent_t a, b;
      EMU_CHECK(cudaEventCreate(&a));
      EMU_CHECK(cudaEventCreate(&b));
      for (int i = 0; i < graph_reps; ++i) {
        EMU_CHECK(cudaEventRecord(a, s0));
        EMU_CHECK(cudaGraphLaunch(exec, s0));
        EMU_CHECK(cudaEventRecord(b, s0));
        EMU_CHECK(cudaEventSynchronize(b));
        float ms = 0;
        EMU_CHECK(cudaEventElapsedTime(&ms, a, b));
        samples.push_back(1000.0 * ms / static_cast<double>(calls));
      }
      std::sort(samples.begin(), samples.end());
      *us_per_call = samples[samples.size() / 2];
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      EMU_CHECK(cudaDeviceSynchronize());
    }
    char* oh = static_cast<char*>(out_host);
    char* oh2 = static_cast<char*>(out2_host);
    for (int r = 0; r < world; ++r) {
      EMU_CHECK(cudaMemcpy(oh + r * n * sizeof(T), outs[r], n * sizeof(T), cudaMemcpyDeviceToHost));
      if (fused) EMU_CHECK(cudaMemcpy(oh2 + r * n * sizeof(T), outs2[r], n * sizeof(T), cudaMemcpyDeviceToHost));
    }
    return 0;
  };
  if (rc == 0) rc = body();
  for (int r = 0; r < world; ++r) {
    cudaEventDestroy(start[r]);
    cudaEventDestroy(stop[r]);
  }
  free_all();
  return rc;
}

}  // namespace

extern "C" {

const char* emu_last_error() { return g_error.c_str(); }

// `world` ranks on the current GPU. Returns 0, or 1 with emu_last_error() saying why.
int emu_init(int world, long long oneshot_bytes, long long twoshot_bytes, unsigned long long timeout_ns) {
  if (g.world) return fail("already initialised");
  if (world < 1 || world > kMaxRanks) return fail("world size must be 1..8");
  g.ws = make_workspace(world, oneshot_bytes, twoshot_bytes);
  EMU_CHECK(cudaHostAlloc(&g.host_error, sizeof(uint32_t) * kMaxRanks, cudaHostAllocMapped));
  std::memset(g.host_error, 0, sizeof(uint32_t) * kMaxRanks);
  uint32_t* dev_err = nullptr;
  EMU_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_err), g.host_error, 0));
  for (int r = 0; r < world; ++r) {
    EMU_CHECK(cudaMalloc(&g.base[r], g.ws.total_bytes));
    EMU_CHECK(cudaMemset(g.base[r], 0, g.ws.total_bytes));
    EMU_CHECK(empty_oneshot_slots(g.base[r], g.ws.state_bytes, g.ws.layout));
    EMU_CHECK(cudaStreamCreateWithFlags(&g.stream[r], cudaStreamNonBlocking));
  }
  for (int r = 0; r < world; ++r) g.peers[r] = make_peers(r, world, g.base, g.ws.state_bytes, dev_err, timeout_ns);
  EMU_CHECK(cudaDeviceSynchronize());
  g.world = world;
  return 0;
}

// Free what emu_init took, so that another world size can be set up in the same process.
int emu_shutdown() {
  EMU_CHECK(cudaDeviceSynchronize());
  for (int r = 0; r < g.world; ++r) {
    EMU_CHECK(cudaStreamDestroy(g.stream[r]));
    EMU_CHECK(cudaFree(g.base[r]));
  }
  if (g.host_error) EMU_CHECK(cudaFreeHost(g.host_error));
  g = Emulation{};
  return 0;
}

// Every counter and flag = epoch, every one-shot slot empty, errors cleared (as sy_reset).
int emu_reset(unsigned int epoch) {
  EMU_CHECK(cudaDeviceSynchronize());
  const State s = fresh_state(epoch);
  for (int r = 0; r < g.world; ++r) {
    EMU_CHECK(reset_workspace(g.base[r], s, g.ws.state_bytes, g.ws.layout));
    g.host_error[r] = 0;
  }
  return 0;
}

// Non-zero where a rank's bounded wait gave up.
int emu_error() {
  uint32_t e = 0;
  for (int r = 0; r < g.world; ++r) e |= reinterpret_cast<volatile uint32_t*>(g.host_error)[r];
  return static_cast<int>(e);
}

// Rank r's completed launches, or -1 where its launch counters disagree (launch_count).
long long emu_calls(int rank) {
  if (rank < 0 || rank >= g.world) return -1;
  return launch_count(g.base[rank]);
}

// `calls` back-to-back calls of `kernel` (0 one-shot, 1 two-shot, 2 fused, 3 fused taking float32
// partial products) on every rank but `absent` (-1: none), each rank's launches on its own stream.
// dtype: 0 f32, 1 bf16, 2 f16; vec: the 16-byte pack path (else one element per pack).
// Host buffers: x [world][n] of dtype, or [world][splits][n] float32 for kernel 3; residual [n];
// weight [hidden]; out [world][n] (the sum, or new_residual); out2 [world][n] (normed). Outputs
// are poisoned (all ones) before the first call. us_per_call: min over ranks of the chain's time per
// call with direct launches, or with graph_reps > 0 the median over that many replays of one CUDA
// graph holding every rank's chain (not NVLink time either way).
int emu_run(int kernel, int dtype, int vec, long long n, long long hidden, int splits, float eps, long long calls,
            int absent, int graph_reps, const void* x, const void* residual, const void* weight, void* out, void* out2,
            double* us_per_call) {
  if (!g.world) return fail("not initialised");
  if (n < 1 || calls < 1 || kernel < 0 || kernel > 3) return fail("bad arguments");
  if (kernel == kFusedPartials && (splits < 1 || splits > kMaxPartials)) return fail("bad split count");
  const bool v = vec != 0;
  switch (dtype) {
    case 0:
      return v ? run_typed<float, 4>(kernel, n, hidden, splits, eps, calls, absent, graph_reps, x, residual, weight, out, out2, us_per_call)
               : run_typed<float, 1>(kernel, n, hidden, splits, eps, calls, absent, graph_reps, x, residual, weight, out, out2, us_per_call);
    case 1:
      return v ? run_typed<__nv_bfloat16, 8>(kernel, n, hidden, splits, eps, calls, absent, graph_reps, x, residual, weight, out, out2, us_per_call)
               : run_typed<__nv_bfloat16, 1>(kernel, n, hidden, splits, eps, calls, absent, graph_reps, x, residual, weight, out, out2, us_per_call);
    case 2:
      return v ? run_typed<__half, 8>(kernel, n, hidden, splits, eps, calls, absent, graph_reps, x, residual, weight, out, out2, us_per_call)
               : run_typed<__half, 1>(kernel, n, hidden, splits, eps, calls, absent, graph_reps, x, residual, weight, out, out2, us_per_call);
    default:
      return fail("dtype must be 0 (f32), 1 (bf16) or 2 (f16)");
  }
}

}  // extern "C"
