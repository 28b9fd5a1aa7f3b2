// XLA FFI handlers for the Switchyard all-reduce kernels, and the small C API the Python side
// uses to set them up (init / reset / error query). Algorithms live in the headers:
//   oneshot.cuh, twoshot.cuh, fused_rmsnorm.cuh; shared barrier and packs in common.cuh, the
//   flag-free exchange of one-shot and fused in lamport.cuh. The
//   decode-attention handler (decode_attention.cuh) needs no workspace and no init, only its
//   kernels loaded (sy_preload_attention).
//
// Command-buffer safety (XLA captures jitted steps into CUDA graphs): handlers only read the
// registry (built once at init), pick a launch configuration from buffer sizes and launch one
// kernel on the stream XLA gives them. No allocation, no synchronisation, no stream query; the
// per-call epoch lives in device memory (common.cuh), and every pointer baked into a graph (peer
// workspaces, the mapped error word) stays valid until process exit.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

#include "common.cuh"
#include "decode_attention.cuh"
#include "fused_rmsnorm.cuh"
#include "launch.cuh"
#include "layout.cuh"
#include "oneshot.cuh"
#include "twoshot.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace switchyard;

namespace {

constexpr int kMaxOrdinals = 64;
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

Registry g;
std::string g_last_error;

int fail(const std::string& msg) {
  g_last_error = msg;
  return 1;
}

#define SY_CHECK(call)                                                                        \
  do {                                                                                        \
    cudaError_t e_ = (call);                                                                  \
    if (e_ != cudaSuccess)                                                                    \
      return fail(std::string(#call) + " failed: " + cudaGetErrorString(e_));                 \
  } while (0)

bool any_host_error() {
  if (!g.host_error) return false;
  for (int r = 0; r < g.world; ++r)
    if (reinterpret_cast<volatile uint32_t*>(g.host_error)[r] != 0) return true;
  return false;
}

// Find this call's rank from the device ordinal XLA runs the handler for. No CUDA call here: any
// runtime query issued while XLA captures the stream into a command buffer could invalidate the
// capture.
ffi::Error resolve(int32_t device, Peers* peers) {
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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- dtype x vector-width dispatch ------------------------------------------------------------
template <typename F>
ffi::Error dispatch(ffi::DataType dt, bool vec, F&& f) {
  switch (dt) {
    case ffi::DataType::F32:
      return vec ? f(float{}, std::integral_constant<int, 4>{}) : f(float{}, std::integral_constant<int, 1>{});
    case ffi::DataType::BF16:
      return vec ? f(__nv_bfloat16{}, std::integral_constant<int, 8>{})
                 : f(__nv_bfloat16{}, std::integral_constant<int, 1>{});
    case ffi::DataType::F16:
      return vec ? f(__half{}, std::integral_constant<int, 8>{}) : f(__half{}, std::integral_constant<int, 1>{});
    default:
      return ffi::Error(ffi::ErrorCode::kUnimplemented, "switchyard all-reduce supports f32, bf16, f16");
  }
}

ffi::Error OneShotImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  Peers P;
  if (auto err = resolve(device, &P); err.failure()) return err;
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (n == 0) return ffi::Error::Success();
  if (static_cast<int64_t>(x.size_bytes()) > g.oneshot_bytes)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "message larger than the one-shot workspace");
  const bool vec = aligned16(x.untyped_data()) && aligned16(y->untyped_data());
  return dispatch(x.element_type(), vec, [&](auto t, auto w) {
    using T = decltype(t);
    constexpr int W = decltype(w)::value;
    const Grid grid = oneshot_grid(ceil_div(n, W));
    oneshot_kernel<T, W><<<grid.blocks, grid.threads, 0, stream>>>(
        P, g.layout, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()), n);
    return launched();
  });
}

ffi::Error TwoShotImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  Peers P;
  if (auto err = resolve(device, &P); err.failure()) return err;
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (n == 0) return ffi::Error::Success();
  if (static_cast<int64_t>(x.size_bytes()) > g.twoshot_bytes)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "message larger than the two-shot workspace");
  const bool vec = aligned16(x.untyped_data()) && aligned16(y->untyped_data());
  return dispatch(x.element_type(), vec, [&](auto t, auto w) {
    using T = decltype(t);
    constexpr int W = decltype(w)::value;
    const Grid grid = twoshot_grid(ceil_div(n, W), P.world);
    twoshot_kernel<T, W><<<grid.blocks, grid.threads, 0, stream>>>(
        P, g.layout, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()), n);
    return launched();
  });
}

// x is either this rank's contribution [..., H] in the residual's dtype, or S float32 partial
// products [S, ..., H] whose sum it is (fused_rmsnorm.cuh): one more dimension than residual.
ffi::Error FusedImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                     ffi::Result<ffi::AnyBuffer> new_residual, ffi::Result<ffi::AnyBuffer> normed, float eps) {
  Peers P;
  if (auto err = resolve(device, &P); err.failure()) return err;
  const auto dims = residual.dimensions();
  if (dims.size() < 1) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "residual must have a hidden axis");
  const int64_t hidden = dims.back();
  const int64_t n = static_cast<int64_t>(residual.element_count());
  const bool partials = x.dimensions().size() == dims.size() + 1;
  const int64_t splits = partials ? x.dimensions()[0] : 0;
  if (partials && (x.element_type() != ffi::DataType::F32 || splits < 1 || splits > kMaxPartials ||
                   static_cast<int64_t>(x.element_count()) != splits * n))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "partial products must be float32 [S, ...residual shape] with 1 <= S <= 4");
  if (!partials && (x.element_type() != residual.element_type() || static_cast<int64_t>(x.element_count()) != n))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "x, residual: dtype/shape mismatch");
  if (n == 0) return ffi::Error::Success();
  if (weight.element_type() != residual.element_type() || static_cast<int64_t>(weight.element_count()) != hidden)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "residual, weight: dtype/shape mismatch");
  if (static_cast<int64_t>(residual.size_bytes()) > g.oneshot_bytes)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "message larger than the one-shot workspace");
  const int64_t rows = n / hidden;
  const int vec_elems = residual.element_type() == ffi::DataType::F32 ? 4 : 8;
  const bool vec = hidden % vec_elems == 0 && aligned16(x.untyped_data()) &&
                   aligned16(residual.untyped_data()) && aligned16(weight.untyped_data()) &&
                   aligned16(new_residual->untyped_data()) && aligned16(normed->untyped_data());
  return dispatch(residual.element_type(), vec, [&](auto t, auto w) {
    using T = decltype(t);
    constexpr int W = decltype(w)::value;
    const Grid grid = fused_grid(rows, hidden / W);
    const T* res = static_cast<const T*>(residual.untyped_data());
    const T* wt = static_cast<const T*>(weight.untyped_data());
    T* nr = static_cast<T*>(new_residual->untyped_data());
    T* out = static_cast<T*>(normed->untyped_data());
    if (partials)
      fused_rmsnorm_kernel<T, W, true><<<grid.blocks, grid.threads, 0, stream>>>(
          P, g.layout, nullptr, static_cast<const float*>(x.untyped_data()), static_cast<int>(splits), res, wt, nr,
          out, rows, hidden, eps);
    else
      fused_rmsnorm_kernel<T, W, false><<<grid.blocks, grid.threads, 0, stream>>>(
          P, g.layout, static_cast<const T*>(x.untyped_data()), nullptr, 0, res, wt, nr, out, rows, hidden, eps);
    return launched();
  });
}

// Device-side timestamp for benchmarks: writes %globaltimer (ns) once the stream reaches it. The
// first operand is aliased to the first result so that a chain of operations can be ordered
// through it without copying.
// The result is u32[2] (low, high word) so that JAX needs no 64-bit mode.
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

// ---- decode attention -------------------------------------------------------------------------
// GPUs on which the decode-attention kernels are loaded (sy_preload_attention).
bool g_attn_loaded[kMaxOrdinals] = {};
// Per GPU, per attention kernel (dtype x head_dim x group) and split count S: how many clusters of
// S blocks the GPU runs at once (cudaOccupancyMaxActiveClusters, at preload: the handler makes no
// CUDA call but the launch). The handler lowers S until the grid fits in one wave: clusters must
// find S free slots in one GPC, so a grid that fits by block count alone can still leave half its
// clusters waiting for the first half to finish (at 8 rows x 8 KV heads x 4 splits it did:
// benchmarks/results/kernel-phases-before-h200x2.json, 13 us between the first and last block start).
constexpr int kAttnKernels = 2 * 2 * 4;
int g_attn_clusters[kMaxOrdinals][kAttnKernels][kAttnMaxSplits + 1] = {};

template <typename T, int D, int G>
constexpr int attn_kernel_index() {
  return (std::is_same<T, __half>::value ? 8 : 0) + (D == 64 ? 4 : 0) + (G == 1 ? 0 : G == 2 ? 1 : G == 4 ? 2 : 3);
}

template <typename A, typename B>
bool same_dims(const A& a, const B& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// The S slices of one (row, KV head) run as one thread-block cluster (decode_attention.cuh).
cudaLaunchConfig_t attention_config(const AttnArgs& a, cudaStream_t stream, cudaLaunchAttribute* cluster) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(a.n * a.kv, a.S);
  cfg.blockDim = dim3(kAttnWarps * 32);
  cfg.stream = stream;
  cluster->id = cudaLaunchAttributeClusterDimension;
  cluster->val.clusterDim.x = 1;
  cluster->val.clusterDim.y = a.S;
  cluster->val.clusterDim.z = 1;
  cfg.attrs = cluster;
  cfg.numAttrs = 1;
  return cfg;
}

template <typename T, int D, int G>
cudaError_t launch_attention(AttnArgs a, int device, cudaStream_t stream) {
  const int* fits = g_attn_clusters[device][attn_kernel_index<T, D, G>()];
  while (a.S > 1 && static_cast<int64_t>(a.n) * a.kv > fits[a.S]) --a.S;
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t cfg = attention_config(a, stream, &cluster);
  return cudaLaunchKernelEx(&cfg, attn_split_kernel<T, D, G>, a);
}

template <typename T, int D, int G>
cudaError_t preload_attention(int device) {
  cudaFuncAttributes f;
  cudaError_t e = cudaFuncGetAttributes(&f, attn_split_kernel<T, D, G>);
  for (int S = 1; S <= kAttnMaxSplits && e == cudaSuccess; ++S) {
    AttnArgs a{};
    a.n = 1;
    a.kv = 1;
    a.S = S;
    cudaLaunchAttribute cluster;
    const cudaLaunchConfig_t cfg = attention_config(a, nullptr, &cluster);
    int clusters = 0;
    e = cudaOccupancyMaxActiveClusters(&clusters, attn_split_kernel<T, D, G>, &cfg);
    g_attn_clusters[device][attn_kernel_index<T, D, G>()][S] = clusters;
  }
  return e;
}

// Returns cudaErrorNotSupported for a shape without a compiled kernel.
template <typename T, int D>
cudaError_t launch_attention_group(const AttnArgs& a, int device, cudaStream_t stream) {
  switch (a.G) {
    case 1: return launch_attention<T, D, 1>(a, device, stream);
    case 2: return launch_attention<T, D, 2>(a, device, stream);
    case 4: return launch_attention<T, D, 4>(a, device, stream);
    case 8: return launch_attention<T, D, 8>(a, device, stream);
    default: return cudaErrorNotSupported;
  }
}

template <typename T>
cudaError_t launch_attention_dtype(const AttnArgs& a, int head_dim, int device, cudaStream_t stream) {
  if (head_dim == 128) return launch_attention_group<T, 128>(a, device, stream);
  if (head_dim == 64) return launch_attention_group<T, 64>(a, device, stream);
  return cudaErrorNotSupported;
}

ffi::Error AttentionImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer qkv, ffi::AnyBuffer, ffi::AnyBuffer,
                         ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> write_at, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> k_cache, ffi::Result<ffi::AnyBuffer> v_cache, float scale,
                         int32_t splits) {
  // k_cache / v_cache results alias the cache operands (input_output_aliases): read and write them.
  const auto pd = qkv.dimensions(), cd = k_cache->dimensions();
  auto bad = [](const char* why) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, why); };
  if (pd.size() != 3 || cd.size() != 4) return bad("decode attention: qkv [n, H + 2 kv, D], cache [slots, kv, L, D]");
  const int64_t n = pd[0], heads = pd[1], d = pd[2], kv = cd[1], len = cd[2];
  const int64_t hq = heads - 2 * kv;
  if (kv == 0 || hq <= 0 || hq % kv != 0)
    return bad("decode attention: qkv needs H query heads (a multiple of the KV heads) then K and V heads");
  if (cd[0] < n || cd[3] != d || !same_dims(v_cache->dimensions(), cd) || out->dimensions().size() != 3 ||
      out->dimensions()[0] != n || out->dimensions()[1] != hq || out->dimensions()[2] != d)
    return bad("decode attention: shapes of qkv, the caches and the output do not agree");
  if (static_cast<int64_t>(pos.element_count()) != n || static_cast<int64_t>(write_at.element_count()) != n)
    return bad("decode attention: positions and write positions need one entry per row");
  const auto dt = qkv.element_type();
  if (k_cache->element_type() != dt || v_cache->element_type() != dt || out->element_type() != dt)
    return bad("decode attention: qkv, caches and output must share one dtype");
  if (splits < 1 || splits > kAttnMaxSplits) return bad("decode attention: splits must be 1..8");
  if (n * kv > std::numeric_limits<int32_t>::max()) return bad("decode attention: too many (row, KV head) pairs");
  if (device < 0 || device >= kMaxOrdinals || !g_attn_loaded[device])
    return bad("decode attention: kernels not loaded on this GPU (switchyard.kernels.native.attention_ready)");
  if (n == 0) return ffi::Error::Success();
  AttnArgs a{qkv.untyped_data(), k_cache->untyped_data(), v_cache->untyped_data(), pos.typed_data(),
             write_at.typed_data(), out->untyped_data(), static_cast<int>(n), static_cast<int>(kv),
             static_cast<int>(hq / kv), static_cast<int>(len), static_cast<int>(splits), scale};
  cudaError_t e = cudaErrorNotSupported;
  if (dt == ffi::DataType::BF16) e = launch_attention_dtype<__nv_bfloat16>(a, static_cast<int>(d), device, stream);
  else if (dt == ffi::DataType::F16) e = launch_attention_dtype<__half>(a, static_cast<int>(d), device, stream);
  if (e == cudaErrorNotSupported)
    return bad("decode attention: supports bf16/fp16, head_dim 64 or 128, 1/2/4/8 query heads per KV head");
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("decode attention launch: ") + cudaGetErrorString(e));
  return launched();
}

template <typename T, int D>
cudaError_t preload_attention_dtype_dim(int device) {
  cudaError_t e;
  if ((e = preload_attention<T, D, 1>(device)) != cudaSuccess) return e;
  if ((e = preload_attention<T, D, 2>(device)) != cudaSuccess) return e;
  if ((e = preload_attention<T, D, 4>(device)) != cudaSuccess) return e;
  return preload_attention<T, D, 8>(device);
}

}  // namespace

// Exported symbols (the library is built with -fvisibility=hidden so that the statically linked
// CUDA runtime does not leak into the process).
#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(SyOneShot, OneShotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SyTwoShot, TwoShotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SyFusedRmsNorm, FusedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SyDecodeAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()           // qkv: q heads, then k_new, v_new
                                  .Arg<ffi::AnyBuffer>()           // k_cache (aliased to result 1)
                                  .Arg<ffi::AnyBuffer>()           // v_cache (aliased to result 2)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()    // write positions
                                  .Ret<ffi::AnyBuffer>()           // out
                                  .Ret<ffi::AnyBuffer>()           // k_cache
                                  .Ret<ffi::AnyBuffer>()           // v_cache
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("splits"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SyTimestamp, TimestampImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

// Load every kernel into the current device's context now. With CUDA's lazy module loading the
// first launch of a kernel would otherwise load its module, and loading a module while XLA is
// capturing the stream into a CUDA graph invalidates the capture.
template <typename T, int W>
static cudaError_t preload_kernels() {
  cudaFuncAttributes a;
  cudaError_t e;
  if ((e = cudaFuncGetAttributes(&a, oneshot_kernel<T, W>)) != cudaSuccess) return e;
  if ((e = cudaFuncGetAttributes(&a, twoshot_kernel<T, W>)) != cudaSuccess) return e;
  if ((e = cudaFuncGetAttributes(&a, fused_rmsnorm_kernel<T, W, false>)) != cudaSuccess) return e;
  return cudaFuncGetAttributes(&a, fused_rmsnorm_kernel<T, W, true>);
}

static cudaError_t preload_all_kernels() {
  cudaError_t e;
  if ((e = preload_kernels<float, 4>()) != cudaSuccess) return e;
  if ((e = preload_kernels<float, 1>()) != cudaSuccess) return e;
  if ((e = preload_kernels<__nv_bfloat16, 8>()) != cudaSuccess) return e;
  if ((e = preload_kernels<__nv_bfloat16, 1>()) != cudaSuccess) return e;
  if ((e = preload_kernels<__half, 8>()) != cudaSuccess) return e;
  if ((e = preload_kernels<__half, 1>()) != cudaSuccess) return e;
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, timestamp_kernel);
}

// ---- C API for the Python side (ctypes) ------------------------------------------------------
extern "C" {

const char* sy_last_error() { return g_last_error.c_str(); }

// Load the decode-attention kernels into GPU `ordinal`'s context now (see preload_all_kernels).
int sy_preload_attention(int ordinal) {
  int prev = 0;
  cudaGetDevice(&prev);
  if (ordinal < 0 || ordinal >= kMaxOrdinals) return fail("preload attention kernels: bad device ordinal");
  cudaError_t e = cudaSetDevice(ordinal);
  if (e == cudaSuccess) e = preload_attention_dtype_dim<__nv_bfloat16, 128>(ordinal);
  if (e == cudaSuccess) e = preload_attention_dtype_dim<__nv_bfloat16, 64>(ordinal);
  if (e == cudaSuccess) e = preload_attention_dtype_dim<__half, 128>(ordinal);
  if (e == cudaSuccess) e = preload_attention_dtype_dim<__half, 64>(ordinal);
  cudaSetDevice(prev);
  if (e != cudaSuccess) return fail(std::string("preload attention kernels: ") + cudaGetErrorString(e));
  g_attn_loaded[ordinal] = true;
  return 0;
}
// Diagnostic builds (-DSWITCHYARD_PHASE_TIMER, phase_timer.cuh): copy GPU `ordinal`'s phase
// counters out (cycles[kPhaseSlots], ns[kPhaseSlots], last[kPhaseBlocks * kPhaseSlots]) and
// clear the sums. Returns 1 where the build has no phase timer.
int sy_phase_read(int ordinal, unsigned long long* cycles, unsigned long long* ns, unsigned long long* last) {
#ifdef SWITCHYARD_PHASE_TIMER
  int prev = 0;
  cudaGetDevice(&prev);
  cudaError_t e = cudaSetDevice(ordinal);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaMemcpyFromSymbol(cycles, g_phase_cycles, sizeof(g_phase_cycles));
  if (e == cudaSuccess) e = cudaMemcpyFromSymbol(ns, g_phase_ns, sizeof(g_phase_ns));
  if (e == cudaSuccess) e = cudaMemcpyFromSymbol(last, g_phase_last, sizeof(g_phase_last));
  void* sym = nullptr;
  if (e == cudaSuccess) e = cudaGetSymbolAddress(&sym, g_phase_cycles);
  if (e == cudaSuccess) e = cudaMemset(sym, 0, sizeof(g_phase_cycles));
  if (e == cudaSuccess) e = cudaGetSymbolAddress(&sym, g_phase_ns);
  if (e == cudaSuccess) e = cudaMemset(sym, 0, sizeof(g_phase_ns));
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  cudaSetDevice(prev);
  if (e != cudaSuccess) return fail(std::string("phase timer: ") + cudaGetErrorString(e));
  return 0;
#else
  (void)ordinal, (void)cycles, (void)ns, (void)last;
  return 1;
#endif
}
int sy_is_ready() { return g.ready ? 1 : 0; }
int sy_world() { return g.world; }
long long sy_oneshot_bytes() { return g.oneshot_bytes; }
long long sy_twoshot_bytes() { return g.twoshot_bytes; }
unsigned long long sy_host_calls() { return g.host_calls.load(); }
void sy_set_timeout_ns(unsigned long long ns) { g.timeout_ns.store(ns); }

// Allocate a workspace on every listed device, enable peer access between all pairs and build
// the peer tables. `ordinals` are CUDA device ordinals in rank order. Idempotent for the same
// device list. Returns 0 on success; sy_last_error() says why not.
int sy_init(int world, const int* ordinals, long long oneshot_bytes, long long twoshot_bytes) {
  if (g.ready) {
    bool same = world == g.world;
    for (int r = 0; same && r < world; ++r) same = ordinals[r] == g.ordinals[r];
    return same ? 0 : fail("already initialised with a different device list");
  }
  if (world < 1 || world > kMaxRanks) return fail("world size must be 1..8");
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
  if (!g.ready) return 0;
  uint32_t e = 0;
  for (int r = 0; r < g.world; ++r) e |= reinterpret_cast<volatile uint32_t*>(g.host_error)[r];
  return static_cast<int>(e);
}

// Wait for all devices, then zero every state word (epochs, flags, errors) and empty every
// one-shot slot on every GPU. Only
// valid while no all-reduce is in flight (it synchronises the devices first). `epoch` lets tests
// start the counters near 2^32 to exercise wrap-around.
int sy_reset(unsigned int epoch) {
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
  if (!g.ready || rank < 0 || rank >= g.world) return -1;
  if (cudaSetDevice(g.ordinals[rank]) != cudaSuccess) return -1;
  return launch_count(g.base[rank]);
}

}  // extern "C"

#pragma GCC visibility pop
