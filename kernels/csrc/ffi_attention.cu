// XLA FFI handler of the decode-attention kernel (decode_attention.cuh) and its C API entry
// sy_preload_attention. It needs no workspace and no init, only its kernels loaded on the GPU
// (and, per GPU, how many clusters of each split count fit at once). The handler makes no CUDA call
// but the launch: it is safe inside XLA's command buffers.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "decode_attention.cuh"
#include "registry.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace switchyard;

namespace {

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
  auto bad = [](const std::string& why) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, why); };
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
  if (splits < 1 || splits > kAttnMaxSplits)
    return bad("decode attention: splits must be 1.." + std::to_string(kAttnMaxSplits));
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

#ifdef SWITCHYARD_PHASE_TIMER
namespace switchyard {
cudaError_t collect_attention_phases(PhaseTotals& t) { return collect_phases(t); }
}  // namespace switchyard
#endif

// Exported symbols (the library is built with -fvisibility=hidden).
#pragma GCC visibility push(default)

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

extern "C" {

// Load the decode-attention kernels into GPU `ordinal`'s context now (with lazy module loading, a
// first launch during XLA's stream capture would invalidate the capture).
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

}  // extern "C"

#pragma GCC visibility pop
