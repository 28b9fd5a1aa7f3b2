// Decode attention: one new token per row against that row's KV cache, with the new K/V written
// into the cache in the same launch (split-sequence "flash decoding").
//
// Layouts (one device's shard, as the engine keeps them):
//   q        [n, kv * G, D]   the new tokens' queries, rope applied
//   k_new    [n, kv, D]       the new tokens' keys (rope applied) and values
//   v_new    [n, kv, D]
//   k_cache  [slots, kv, L, D], v_cache the same; rows 0..n-1 are the batch (slots >= n)
//   pos      [n]  row b attends over cache positions [0, pos[b]]
//   write_at [n]  row b's new K/V go to position write_at[b]; outside [0, L) = not written
//   out      [n, kv * G, D]
//
// Work split. Block (b, h, s) takes kv head h of row b and the s-th of S equal slices of the
// positions [0, pos]; its 4 warps take turns at runs of 8 positions. For each position each lane
// loads D/32 consecutive elements of K and V (one coalesced row), the
// G dot products are reduced across the warp, and an online softmax (running max m, sum l,
// accumulator acc) folds in that position's V. The warps then merge in shared memory. With S = 1
// the block writes the output; otherwise it writes (acc, m, l) for its slice to `partials`
// [n, kv, S, G, D + 2] (fp32), and the last of the S blocks to finish (an atomic counter per
// (row, head), reset by that block) merges them into the output.
//
// The new K/V. The position being written is read by at most one block (the one whose slice
// holds it), and that block uses k_new/v_new directly for it instead of the cache; block s == 0
// stores them into the cache. No block reads what another writes, so one launch suffices.
//
// Numerics: scores, softmax and accumulation in fp32; products of bf16/fp16 inputs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace switchyard {

constexpr int kAttnWarps = 4;
constexpr int kAttnUnroll = 8;  // positions per warp per round
constexpr int kAttnMaxGroup = 8;  // query heads per KV head (GQA ratio) the kernel supports
constexpr float kAttnFloor = -1e30f;
constexpr int kAttnMaxSplits = 64;

struct AttnArgs {
  const void* q;
  const void* k_new;
  const void* v_new;
  void* k_cache;
  void* v_cache;
  const int32_t* pos;
  const int32_t* write_at;
  void* out;
  float* partials;
  int* counters;  // one per (row, KV head): zero between launches (the merging block resets it)
  int n, kv, G, L, S;
  float scale;
};

template <typename T>
__device__ __forceinline__ float attn_to_float(T x);
template <>
__device__ __forceinline__ float attn_to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float attn_to_float<__half>(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T attn_from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 attn_from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half attn_from_float<__half>(float x) { return __float2half(x); }

// E consecutive 2-byte elements (E = 2 or 4: 4 or 8 bytes, aligned because D * 2 bytes per row).
template <typename T, int E>
__device__ __forceinline__ void attn_load(const T* p, float (&x)[E]) {
  if constexpr (E == 4) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = attn_to_float(v[e]);
  } else {
    const uint32_t raw = *reinterpret_cast<const uint32_t*>(p);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = attn_to_float(v[e]);
  }
}

template <typename T, int E>
__device__ __forceinline__ void attn_copy(const T* src, T* dst) {
  if constexpr (E == 4) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
  }
}

template <typename T, int D, int G>
__global__ void __launch_bounds__(kAttnWarps * 32) attn_split_kernel(AttnArgs a) {
  constexpr int E = D / 32;
  const int b = blockIdx.x / a.kv, h = blockIdx.x % a.kv, s = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int pos = a.pos[b];
  const int wat = a.write_at[b];
  const bool writes = wat >= 0 && wat < a.L;
  const int total = min(pos + 1, a.L);
  const int chunk = (total + a.S - 1) / a.S;
  const int t0 = s * chunk, t1 = min(total, t0 + chunk);

  const T* q = static_cast<const T*>(a.q) + (static_cast<int64_t>(b) * a.kv * G + h * G) * D;
  const int64_t head = (static_cast<int64_t>(b) * a.kv + h);
  const T* kn = static_cast<const T*>(a.k_new) + head * D;
  const T* vn = static_cast<const T*>(a.v_new) + head * D;
  T* kc = static_cast<T*>(a.k_cache) + head * a.L * D;
  T* vc = static_cast<T*>(a.v_cache) + head * a.L * D;

  if (s == 0 && warp == 0 && writes) {
    attn_copy<T, E>(kn + lane * E, kc + static_cast<int64_t>(wat) * D + lane * E);
    attn_copy<T, E>(vn + lane * E, vc + static_cast<int64_t>(wat) * D + lane * E);
  }

  float qf[G][E];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    attn_load<T, E>(q + g * D + lane * E, qf[g]);
#pragma unroll
    for (int e = 0; e < E; ++e) qf[g][e] *= a.scale;
  }
  float m[G], l[G], acc[G][E];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = kAttnFloor;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  }

  // Each warp takes kAttnUnroll consecutive positions per round and issues all their loads before
  // using any: one position at a time leaves too few loads in flight to reach HBM bandwidth.
  for (int base = t0 + warp * kAttnUnroll; base < t1; base += kAttnWarps * kAttnUnroll) {
    float kf[kAttnUnroll][E], vf[kAttnUnroll][E];
#pragma unroll
    for (int u = 0; u < kAttnUnroll; ++u) {
      // Past the slice's end, re-read its last position (no branch around the loads); it is masked below.
      const int t = min(base + u, t1 - 1);
      const bool fresh = writes && t == wat;
      attn_load<T, E>((fresh ? kn : kc + static_cast<int64_t>(t) * D) + lane * E, kf[u]);
      attn_load<T, E>((fresh ? vn : vc + static_cast<int64_t>(t) * D) + lane * E, vf[u]);
    }
    float score[kAttnUnroll][G];
#pragma unroll
    for (int u = 0; u < kAttnUnroll; ++u) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) d += qf[g][e] * kf[u][e];
        score[u][g] = d;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
      for (int u = 0; u < kAttnUnroll; ++u) {
#pragma unroll
        for (int g = 0; g < G; ++g) score[u][g] += __shfl_xor_sync(0xffffffffu, score[u][g], off);
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < kAttnUnroll; ++u)
        if (base + u < t1) mx = fmaxf(mx, score[u][g]);
      const float corr = __expf(m[g] - mx);
      l[g] *= corr;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] *= corr;
#pragma unroll
      for (int u = 0; u < kAttnUnroll; ++u) {
        if (base + u < t1) {
          const float p = __expf(score[u][g] - mx);
          l[g] += p;
#pragma unroll
          for (int e = 0; e < E; ++e) acc[g][e] += p * vf[u][e];
        }
      }
      m[g] = mx;
    }
  }

  // Merge the warps: every warp leaves (m, l) per query head and its acc slice in shared memory.
  __shared__ float sm_m[kAttnWarps][G];
  __shared__ float sm_l[kAttnWarps][G];
  __shared__ float sm_acc[kAttnWarps][G][D];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][g][lane * E + e] = acc[g][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += kAttnWarps * 32) {
    const int g = i / D, d = i % D;
    float mx = kAttnFloor;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float sum = 0.f, val = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float f = __expf(sm_m[w][g] - mx);
      sum += sm_l[w][g] * f;
      val += sm_acc[w][g][d] * f;
    }
    if (a.S == 1) {
      T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(b) * a.kv * G + h * G + g) * D;
      out[d] = attn_from_float<T>(val / sum);
    } else {
      float* part = a.partials + ((head * a.S + s) * G + g) * (D + 2);
      part[d] = val;
      if (d == 0) {
        part[D] = mx;
        part[D + 1] = sum;
      }
    }
  }
  if (a.S == 1) return;

  // The last block of this (row, head) to finish merges the S slices (no second launch). Release:
  // every thread's partial stores, then one fenced increment; acquire: a fence after seeing S - 1.
  __shared__ bool sm_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    sm_last = atomicAdd(a.counters + head, 1) == a.S - 1;
  }
  __syncthreads();
  if (!sm_last) return;
  __threadfence();
  const float* base = a.partials + head * a.S * G * (D + 2);
  const int64_t slice = static_cast<int64_t>(G) * (D + 2);
  // Per query head, the slices' weights exp(m_s - M) / sum: warp g computes them for head g.
  __shared__ float sm_w[G][kAttnMaxSplits];
  for (int g = warp; g < G; g += kAttnWarps) {
    float mx = kAttnFloor;
    for (int j = lane; j < a.S; j += 32) mx = fmaxf(mx, __ldcg(base + j * slice + g * (D + 2) + D));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float total = 0.f;
    for (int j = lane; j < a.S; j += 32) {
      const float* p = base + j * slice + g * (D + 2);
      const float w = __expf(__ldcg(p + D) - mx);
      sm_w[g][j] = w;
      total += w * __ldcg(p + D + 1);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
    for (int j = lane; j < a.S; j += 32) sm_w[g][j] /= total;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += kAttnWarps * 32) {
    const int g = i / D, d = i % D;
    float val = 0.f;
#pragma unroll 8
    for (int j = 0; j < a.S; ++j) val += sm_w[g][j] * __ldcg(base + j * slice + g * (D + 2) + d);
    T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(b) * a.kv * G + h * G + g) * D;
    out[d] = attn_from_float<T>(val);
  }
  if (threadIdx.x == 0) a.counters[head] = 0;  // ready for the next launch (stream order)
}

}  // namespace switchyard
