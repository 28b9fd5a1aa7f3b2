// XLA FFI handlers of the decode-attention kernels, over contiguous caches (decode_attention.cuh)
// and over paged pools with block tables (paged_attention.cuh), and their C API entry
// sy_preload_attention. They need no workspace and no init, only their kernels loaded on the GPU
// (and, per GPU, how many clusters of each split count fit at once). The handlers make no CUDA call
// but the launch: they are safe inside XLA's command buffers.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "decode_attention.cuh"
#include "paged_attention.cuh"
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
// The caches a kernel reads: contiguous, a paged pool in the queries' dtype, or a paged FP8 pool.
enum class Cache { kContiguous = 0, kPaged = 1, kPagedFp8 = 2 };
constexpr int kAttnKernels = 2 * 2 * 4 * 3;  // dtype x head_dim x group x cache
int g_attn_clusters[kMaxOrdinals][kAttnKernels][kAttnMaxSplits + 1] = {};

template <typename T, int D, int G, Cache C>
constexpr int attn_kernel_index() {
  return 16 * static_cast<int>(C) + (std::is_same<T, __half>::value ? 8 : 0) + (D == 64 ? 4 : 0) +
         (G == 1 ? 0 : G == 2 ? 1 : G == 4 ? 2 : 3);
}

template <typename T, int D, int G, Cache C>
constexpr auto attn_kernel() {
  if constexpr (C == Cache::kPagedFp8) return paged_attn_kernel<T, Fp8, D, G>;
  else if constexpr (C == Cache::kPaged) return paged_attn_kernel<T, T, D, G>;
  else return attn_split_kernel<T, D, G>;
}

// Dynamic shared memory: the paged kernel's ring (the contiguous kernel's arrays are static).
template <typename T, int D, int G, Cache C>
constexpr int attn_smem_bytes() {
  if constexpr (C == Cache::kPagedFp8) return paged_attn_smem_bytes<T, Fp8, D, G>();
  else if constexpr (C == Cache::kPaged) return paged_attn_smem_bytes<T, T, D, G>();
  else return 0;
}

template <typename A, typename B>
bool same_dims(const A& a, const B& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// The S slices of one (row, KV head) run as one thread-block cluster (decode_attention.cuh).
cudaLaunchConfig_t attention_config(const AttnArgs& a, int smem, cudaStream_t stream, cudaLaunchAttribute* cluster) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(a.n * a.kv, a.S);
  cfg.blockDim = dim3(kAttnWarps * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cluster->id = cudaLaunchAttributeClusterDimension;
  cluster->val.clusterDim.x = 1;
  cluster->val.clusterDim.y = a.S;
  cluster->val.clusterDim.z = 1;
  cfg.attrs = cluster;
  cfg.numAttrs = 1;
  return cfg;
}

template <typename T, int D, int G, Cache C>
cudaError_t launch_attention(AttnArgs a, int device, cudaStream_t stream) {
  const int* fits = g_attn_clusters[device][attn_kernel_index<T, D, G, C>()];
  while (a.S > 1 && static_cast<int64_t>(a.n) * a.kv > fits[a.S]) --a.S;
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t cfg = attention_config(a, attn_smem_bytes<T, D, G, C>(), stream, &cluster);
  return cudaLaunchKernelEx(&cfg, attn_kernel<T, D, G, C>(), a);
}

template <typename T, int D, int G, Cache C>
cudaError_t preload_attention(int device) {
  constexpr int smem = attn_smem_bytes<T, D, G, C>();
  cudaError_t e = cudaFuncSetAttribute(attn_kernel<T, D, G, C>(), cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess && kAttnMaxSplits > 8)
    e = cudaFuncSetAttribute(attn_kernel<T, D, G, C>(), cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  for (int S = 1; S <= kAttnMaxSplits && e == cudaSuccess; ++S) {
    AttnArgs a{};
    a.n = 1;
    a.kv = 1;
    a.S = S;
    cudaLaunchAttribute cluster;
    const cudaLaunchConfig_t cfg = attention_config(a, smem, nullptr, &cluster);
    int clusters = 0;
    e = cudaOccupancyMaxActiveClusters(&clusters, attn_kernel<T, D, G, C>(), &cfg);
    g_attn_clusters[device][attn_kernel_index<T, D, G, C>()][S] = clusters;
  }
  return e;
}

// Returns cudaErrorNotSupported for a shape without a compiled kernel.
template <typename T, int D, Cache C>
cudaError_t launch_attention_group(const AttnArgs& a, int device, cudaStream_t stream) {
  switch (a.G) {
    case 1: return launch_attention<T, D, 1, C>(a, device, stream);
    case 2: return launch_attention<T, D, 2, C>(a, device, stream);
    case 4: return launch_attention<T, D, 4, C>(a, device, stream);
    case 8: return launch_attention<T, D, 8, C>(a, device, stream);
    default: return cudaErrorNotSupported;
  }
}

template <typename T, Cache C>
cudaError_t launch_attention_dtype(const AttnArgs& a, int head_dim, int device, cudaStream_t stream) {
  if (head_dim == 128) return launch_attention_group<T, 128, C>(a, device, stream);
  if (head_dim == 64) return launch_attention_group<T, 64, C>(a, device, stream);
  return cudaErrorNotSupported;
}

ffi::Error bad_argument(const std::string& why) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, why); }

// The checks both handlers share, past the ranks: qkv [n, H + 2 kv, D] against the caches or pools
// ([*, kv, *, D]), the output, positions (`pos_count`, `write_count` entries), dtypes, splits and
// the loaded kernels. `what` names the operation.
ffi::Error check_common(const char* what, int32_t device, const ffi::AnyBuffer& qkv, size_t pos_count,
                        size_t write_count, const ffi::AnyBuffer& out, const ffi::AnyBuffer& k_cache,
                        const ffi::AnyBuffer& v_cache, int32_t splits, bool fp8_pools = false) {
  const std::string op(what);
  const auto pd = qkv.dimensions(), cd = k_cache.dimensions(), od = out.dimensions();
  const int64_t n = pd[0], heads = pd[1], d = pd[2], kv = cd[1];
  const int64_t hq = heads - 2 * kv;
  if (kv == 0 || hq <= 0 || hq % kv != 0)
    return bad_argument(op + ": qkv needs H query heads (a multiple of the KV heads) then K and V heads");
  if (cd[3] != d || !same_dims(v_cache.dimensions(), cd) || od.size() != 3 || od[0] != n || od[1] != hq ||
      od[2] != d)
    return bad_argument(op + ": shapes of qkv, the caches and the output do not agree");
  if (static_cast<int64_t>(pos_count) != n || static_cast<int64_t>(write_count) != n)
    return bad_argument(op + ": positions and write positions need one entry per row");
  const auto dt = qkv.element_type();
  const auto pool_dt = fp8_pools ? ffi::DataType::F8E4M3FN : dt;
  if (k_cache.element_type() != pool_dt || v_cache.element_type() != pool_dt || out.element_type() != dt)
    return bad_argument(op + (fp8_pools ? ": the pools must be float8_e4m3fn, qkv and output one dtype"
                                        : ": qkv, caches and output must share one dtype"));
  if (splits < 1 || splits > kAttnMaxSplits)
    return bad_argument(op + ": splits must be 1.." + std::to_string(kAttnMaxSplits));
  if (n * kv > std::numeric_limits<int32_t>::max()) return bad_argument(op + ": too many (row, KV head) pairs");
  if (device < 0 || device >= kMaxOrdinals || !g_attn_loaded[device])
    return bad_argument(op + ": kernels not loaded on this GPU (switchyard.kernels.native.attention_ready)");
  return ffi::Error::Success();
}

template <Cache C>
ffi::Error launch_checked(const char* what, const AttnArgs& a, ffi::DataType dt, int head_dim, int device,
                          cudaStream_t stream) {
  cudaError_t e = cudaErrorNotSupported;
  if (dt == ffi::DataType::BF16) e = launch_attention_dtype<__nv_bfloat16, C>(a, head_dim, device, stream);
  else if (dt == ffi::DataType::F16) e = launch_attention_dtype<__half, C>(a, head_dim, device, stream);
  if (e == cudaErrorNotSupported)
    return bad_argument(std::string(what) +
                        ": supports bf16/fp16, head_dim 64 or 128, 1/2/4/8 query heads per KV head");
  if (e != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(what) + " launch: " + cudaGetErrorString(e));
  return launched();
}

ffi::Error AttentionImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer qkv, ffi::AnyBuffer, ffi::AnyBuffer,
                         ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> write_at, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::AnyBuffer> k_cache, ffi::Result<ffi::AnyBuffer> v_cache, float scale,
                         int32_t splits) {
  // k_cache / v_cache results alias the cache operands (input_output_aliases): read and write them.
  const auto pd = qkv.dimensions(), cd = k_cache->dimensions();
  if (pd.size() != 3 || cd.size() != 4)
    return bad_argument("decode attention: qkv [n, H + 2 kv, D], cache [slots, kv, L, D]");
  if (cd[0] < pd[0]) return bad_argument("decode attention: shapes of qkv, the caches and the output do not agree");
  if (ffi::Error e = check_common("decode attention", device, qkv, pos.element_count(), write_at.element_count(),
                                  *out, *k_cache, *v_cache, splits);
      e.failure())
    return e;
  const int64_t n = pd[0], kv = cd[1];
  if (n == 0) return ffi::Error::Success();
  AttnArgs a{qkv.untyped_data(), k_cache->untyped_data(), v_cache->untyped_data(), pos.typed_data(),
             write_at.typed_data(), out->untyped_data(), static_cast<int>(n), static_cast<int>(kv),
             static_cast<int>((pd[1] - 2 * kv) / kv), static_cast<int>(cd[2]), static_cast<int>(splits), scale};
  return launch_checked<Cache::kContiguous>("decode attention", a, qkv.element_type(), static_cast<int>(pd[2]), device, stream);
}

// The checks and arguments of a paged launch; k_scale / v_scale with FP8 pools (their scales,
// float32 [num_blocks, kv, B]), null otherwise.
ffi::Error paged_attention(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& qkv,
                           const ffi::Buffer<ffi::S32>& tables, const ffi::Buffer<ffi::S32>& pos,
                           const ffi::Buffer<ffi::S32>& write_at, ffi::AnyBuffer& out, ffi::AnyBuffer& k_pool,
                           ffi::AnyBuffer& v_pool, ffi::AnyBuffer* k_scale, ffi::AnyBuffer* v_scale, float scale,
                           int32_t splits) {
  const bool fp8 = k_scale != nullptr;
  const char* what = fp8 ? "paged decode attention (FP8 pools)" : "paged decode attention";
  const std::string op(what);
  const auto pd = qkv.dimensions(), cd = k_pool.dimensions(), td = tables.dimensions();
  if (pd.size() != 3 || cd.size() != 4 || td.size() != 2)
    return bad_argument(op + ": qkv [n, H + 2 kv, D], pools [num_blocks, kv, B, D], block tables [n, M]");
  if (ffi::Error e = check_common(what, device, qkv, pos.element_count(), write_at.element_count(), out, k_pool,
                                  v_pool, splits, fp8);
      e.failure())
    return e;
  const int64_t n = pd[0], blocks = cd[0], kv = cd[1], bs = cd[2], m = td[1];
  if (fp8) {
    for (const ffi::AnyBuffer* sc : {k_scale, v_scale}) {
      const auto sd = sc->dimensions();
      if (sc->element_type() != ffi::DataType::F32 || sd.size() != 3 || sd[0] != cd[0] || sd[1] != cd[1] ||
          sd[2] != cd[2])
        return bad_argument(op + ": the scales must be float32 [num_blocks, kv, B], as the pools' first dimensions");
    }
  }
  if (td[0] != n) return bad_argument(op + ": the block tables need one row per qkv row");
  if (bs < 1 || (bs & (bs - 1)) != 0) return bad_argument(op + ": the block size must be a power of two");
  if (blocks < 1 || blocks * kv * bs >= static_cast<int64_t>(kPagedRowLimit))
    return bad_argument(op + ": the pools need 1 to 2^32 - 2 rows (blocks x KV heads x block size)");
  if (m < 1 || m * bs > std::numeric_limits<int32_t>::max())
    return bad_argument(op + ": block tables need 1 to 2^31 / B entries per row");
  if (n == 0) return ffi::Error::Success();
  int shift = 0;
  while ((int64_t{1} << shift) < bs) ++shift;
  AttnArgs a{qkv.untyped_data(), k_pool.untyped_data(), v_pool.untyped_data(), pos.typed_data(),
             write_at.typed_data(), out.untyped_data(), static_cast<int>(n), static_cast<int>(kv),
             static_cast<int>((pd[1] - 2 * kv) / kv), static_cast<int>(m * bs), static_cast<int>(splits), scale,
             tables.typed_data(), static_cast<int>(m), shift, static_cast<uint32_t>(blocks)};
  if (!fp8) return launch_checked<Cache::kPaged>(what, a, qkv.element_type(), static_cast<int>(pd[2]), device, stream);
  a.k_scale = static_cast<float*>(k_scale->untyped_data());
  a.v_scale = static_cast<float*>(v_scale->untyped_data());
  return launch_checked<Cache::kPagedFp8>(what, a, qkv.element_type(), static_cast<int>(pd[2]), device, stream);
}

ffi::Error PagedAttentionImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer qkv, ffi::AnyBuffer,
                              ffi::AnyBuffer, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> pos,
                              ffi::Buffer<ffi::S32> write_at, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> k_pool, ffi::Result<ffi::AnyBuffer> v_pool, float scale,
                              int32_t splits) {
  // k_pool / v_pool results alias the pool operands (input_output_aliases): read and write them.
  return paged_attention(stream, device, qkv, tables, pos, write_at, *out, *k_pool, *v_pool, nullptr, nullptr, scale,
                         splits);
}

ffi::Error PagedAttentionFp8Impl(cudaStream_t stream, int32_t device, ffi::AnyBuffer qkv, ffi::AnyBuffer,
                                 ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Buffer<ffi::S32> tables,
                                 ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> write_at,
                                 ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_pool,
                                 ffi::Result<ffi::AnyBuffer> k_scale, ffi::Result<ffi::AnyBuffer> v_pool,
                                 ffi::Result<ffi::AnyBuffer> v_scale, float scale, int32_t splits) {
  // The pools' e4m3 data and scales results alias their operands (input_output_aliases).
  return paged_attention(stream, device, qkv, tables, pos, write_at, *out, *k_pool, *v_pool, &*k_scale, &*v_scale,
                         scale, splits);
}

template <typename T, int D, Cache C>
cudaError_t preload_attention_groups(int device) {
  cudaError_t e;
  if ((e = preload_attention<T, D, 1, C>(device)) != cudaSuccess) return e;
  if ((e = preload_attention<T, D, 2, C>(device)) != cudaSuccess) return e;
  if ((e = preload_attention<T, D, 4, C>(device)) != cudaSuccess) return e;
  return preload_attention<T, D, 8, C>(device);
}

template <typename T, int D>
cudaError_t preload_attention_dtype_dim(int device) {
  cudaError_t e = preload_attention_groups<T, D, Cache::kContiguous>(device);
  if (e == cudaSuccess) e = preload_attention_groups<T, D, Cache::kPaged>(device);
  return e == cudaSuccess ? preload_attention_groups<T, D, Cache::kPagedFp8>(device) : e;
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(SyPagedDecodeAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()           // qkv: q heads, then k_new, v_new
                                  .Arg<ffi::AnyBuffer>()           // k_pool (aliased to result 1)
                                  .Arg<ffi::AnyBuffer>()           // v_pool (aliased to result 2)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // block tables [n, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()    // write positions
                                  .Ret<ffi::AnyBuffer>()           // out
                                  .Ret<ffi::AnyBuffer>()           // k_pool
                                  .Ret<ffi::AnyBuffer>()           // v_pool
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("splits"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SyPagedDecodeAttentionFp8, PagedAttentionFp8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()           // qkv: q heads, then k_new, v_new
                                  .Arg<ffi::AnyBuffer>()           // k_pool, e4m3 (aliased to result 1)
                                  .Arg<ffi::AnyBuffer>()           // k_pool's scales (result 2)
                                  .Arg<ffi::AnyBuffer>()           // v_pool, e4m3 (result 3)
                                  .Arg<ffi::AnyBuffer>()           // v_pool's scales (result 4)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // block tables [n, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()    // write positions
                                  .Ret<ffi::AnyBuffer>()           // out
                                  .Ret<ffi::AnyBuffer>()           // k_pool
                                  .Ret<ffi::AnyBuffer>()           // k_pool's scales
                                  .Ret<ffi::AnyBuffer>()           // v_pool
                                  .Ret<ffi::AnyBuffer>()           // v_pool's scales
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
