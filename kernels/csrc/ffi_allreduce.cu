// XLA FFI handlers of the all-reduce kernels: one-shot, two-shot, and the all-reduce fused with
// residual add + RMSNorm. Algorithms live in the headers (oneshot.cuh, twoshot.cuh,
// fused_rmsnorm.cuh; shared barrier and packs in common.cuh, the flag-free exchange of one-shot and
// fused in lamport.cuh); launch grids in launch.cuh; the registry the handlers read in registry.cu.
//
// Command-buffer safety (XLA captures jitted steps into CUDA graphs): handlers only read the
// registry (built once at init), pick a launch configuration from buffer sizes and launch one
// kernel on the stream XLA gives them. No allocation, no synchronisation, no stream query; the
// per-call epoch lives in device memory (common.cuh), and every pointer baked into a graph (peer
// workspaces, the mapped error word) stays valid until process exit.
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "common.cuh"
#include "fused_rmsnorm.cuh"
#include "launch.cuh"
#include "oneshot.cuh"
#include "registry.cuh"
#include "twoshot.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace switchyard;

namespace {

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
  if (static_cast<int64_t>(x.size_bytes()) > g_registry.oneshot_bytes)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "message larger than the one-shot workspace");
  const bool vec = aligned16(x.untyped_data()) && aligned16(y->untyped_data());
  return dispatch(x.element_type(), vec, [&](auto t, auto w) {
    using T = decltype(t);
    constexpr int W = decltype(w)::value;
    const Grid grid = oneshot_grid(ceil_div(n, W));
    oneshot_kernel<T, W><<<grid.blocks, grid.threads, 0, stream>>>(
        P, g_registry.layout, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()), n);
    return launched();
  });
}

ffi::Error TwoShotImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  Peers P;
  if (auto err = resolve(device, &P); err.failure()) return err;
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (n == 0) return ffi::Error::Success();
  if (static_cast<int64_t>(x.size_bytes()) > g_registry.twoshot_bytes)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "message larger than the two-shot workspace");
  const bool vec = aligned16(x.untyped_data()) && aligned16(y->untyped_data());
  return dispatch(x.element_type(), vec, [&](auto t, auto w) {
    using T = decltype(t);
    constexpr int W = decltype(w)::value;
    const Grid grid = twoshot_grid(ceil_div(n, W), P.world);
    twoshot_kernel<T, W><<<grid.blocks, grid.threads, 0, stream>>>(
        P, g_registry.layout, static_cast<const T*>(x.untyped_data()), static_cast<T*>(y->untyped_data()), n);
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
                      "partial products must be float32 [S, ...residual shape] with 1 <= S <= " +
                          std::to_string(kMaxPartials));
  if (!partials && (x.element_type() != residual.element_type() || static_cast<int64_t>(x.element_count()) != n))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "x, residual: dtype/shape mismatch");
  if (n == 0) return ffi::Error::Success();
  if (weight.element_type() != residual.element_type() || static_cast<int64_t>(weight.element_count()) != hidden)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "residual, weight: dtype/shape mismatch");
  if (static_cast<int64_t>(residual.size_bytes()) > g_registry.oneshot_bytes)
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
          P, g_registry.layout, nullptr, static_cast<const float*>(x.untyped_data()), static_cast<int>(splits), res,
          wt, nr, out, rows, hidden, eps);
    else
      fused_rmsnorm_kernel<T, W, false><<<grid.blocks, grid.threads, 0, stream>>>(
          P, g_registry.layout, static_cast<const T*>(x.untyped_data()), nullptr, 0, res, wt, nr, out, rows, hidden,
          eps);
    return launched();
  });
}

template <typename T, int W>
cudaError_t preload_kernels() {
  cudaFuncAttributes a;
  cudaError_t e;
  if ((e = cudaFuncGetAttributes(&a, oneshot_kernel<T, W>)) != cudaSuccess) return e;
  if ((e = cudaFuncGetAttributes(&a, twoshot_kernel<T, W>)) != cudaSuccess) return e;
  if ((e = cudaFuncGetAttributes(&a, fused_rmsnorm_kernel<T, W, false>)) != cudaSuccess) return e;
  return cudaFuncGetAttributes(&a, fused_rmsnorm_kernel<T, W, true>);
}

}  // namespace

namespace switchyard {

// Load every all-reduce kernel into the current device's context now. With CUDA's lazy module
// loading the first launch of a kernel would otherwise load its module, and loading a module while
// XLA is capturing the stream into a CUDA graph invalidates the capture.
cudaError_t preload_allreduce_kernels() {
  cudaError_t e;
  if ((e = preload_kernels<float, 4>()) != cudaSuccess) return e;
  if ((e = preload_kernels<float, 1>()) != cudaSuccess) return e;
  if ((e = preload_kernels<__nv_bfloat16, 8>()) != cudaSuccess) return e;
  if ((e = preload_kernels<__nv_bfloat16, 1>()) != cudaSuccess) return e;
  if ((e = preload_kernels<__half, 8>()) != cudaSuccess) return e;
  return preload_kernels<__half, 1>();
}

#ifdef SWITCHYARD_PHASE_TIMER
cudaError_t collect_allreduce_phases(PhaseTotals& t) { return collect_phases(t); }
#endif

}  // namespace switchyard

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

#pragma GCC visibility pop
