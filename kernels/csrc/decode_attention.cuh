// Decode attention: one new token per row against that row's KV cache, with the new K/V written
// into the cache in the same launch (split-sequence "flash decoding", merged inside a cluster).
//
// Layouts (one device's shard, as the engine keeps them):
//   qkv      [n, kv * G + 2 * kv, D]  per row: the new token's query heads, then its K heads and
//            its V heads (rope applied to q and K): the engine's QKV projection output after one
//            rope fusion, read in place (no slice copies per layer)
//   k_cache  [slots, kv, L, D], v_cache the same; rows 0..n-1 are the batch (slots >= n)
//   pos      [n]  row b attends over cache positions [0, pos[b]]
//   write_at [n]  row b's new K/V go to position write_at[b]; outside [0, L) = not written
//   out      [n, kv * G, D]
//
// Work split. Block (b, h, s) takes kv head h of row b and the s-th of S equal slices of the
// cached positions; its kAttnWarps warps take turns at chunks of 32 positions.
//  - loads: a warp's first chunk of K and V is requested before anything else but the queries;
//    after that the loop is software-pipelined without extra registers: the next chunk's K rows
//    are requested as soon as this chunk's scores have consumed kraw, its V rows as soon as the
//    V pass has consumed vraw;
//  - scores: lane i takes position i of the chunk and computes its G dot products over the
//    whole head dimension itself (its K row from HBM, the scaled queries from shared memory),
//    so no cross-lane reduction is needed per position;
//  - online softmax per chunk: one warp max and one warp sum per query head for 32 positions;
//  - values: lane i holds D/32 consecutive output elements and walks the chunk's 32 V rows (each
//    row one coalesced warp load), weighting them by the probabilities left in shared memory.
// The warps then merge in shared memory.
//
// Merging the S slices. The S blocks of one (row, head) form a thread-block cluster (S <= 16,
// Hopper's non-portable cluster size): each leaves its (m, l, acc) in its shared memory, the cluster
// synchronises, and every block merges a share of the G x D outputs by reading all S blocks'
// shared memory (distributed shared memory, every remote read issued before any is used), then
// the cluster synchronises again so that no block exits while a peer still reads its shared
// memory. No partial results go through global memory and nothing needs a second launch, a fence
// or an atomic: at batch 1 the kernel's time is a chain of latencies, and this keeps it to one
// HBM round trip for K/V and two cluster barriers. The host lowers S until all clusters fit on
// the GPU at once (ffi_attention.cu, g_attn_clusters).
//
// The new K/V. In the usual step the new token is the last attended position: warp 0 of slice 0
// takes it from qkv outside the chunk loop (so 1024 cached positions are 32 whole chunks), and
// the slices split only the cached positions. Written elsewhere in the range, that position is
// read by at most one block, which uses k_new/v_new for it instead of the cache. Block s == 0
// stores them into the cache. No block reads what another writes, so one launch suffices.
//
// Paged caches: paged_attention.cuh's kernel takes the same AttnArgs (with the block tables), cuts
// slices the same way (on 32-position boundaries), treats the new K/V the same way and ends with
// the same merge (attn_finish).
//
// Numerics: scores, softmax and accumulation in fp32; products of bf16/fp16 inputs.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "common.cuh"  // to_f32 / from_f32

namespace switchyard {

constexpr int kAttnWarps = 4;
constexpr int kAttnChunk = 32;  // positions per warp per step: one per lane
constexpr int kAttnMaxGroup = 8;  // query heads per KV head (GQA ratio) the kernel supports
constexpr float kAttnFloor = -1e30f;
// Clusters of up to 16 blocks: Hopper's non-portable size (each kernel allows it at preload); a GPU
// that cannot run a cluster of S at once reports none, and the host lowers S.
constexpr int kAttnMaxSplits = 16;

struct AttnArgs {
  const void* qkv;  // [n, kv * G + 2 * kv, D]: each row's query heads, then its new K and V heads
  void* k_cache;    // contiguous [slots, kv, L, D]; paged: the pool [num_blocks, kv, B, D]
  void* v_cache;
  const int32_t* pos;
  const int32_t* write_at;
  void* out;
  int n, kv, G, L, S;  // paged: L = M * B, the positions a block table can map
  float scale;
  // Paged caches only.
  const int32_t* tables = nullptr;  // [n, M] block of each B positions of each row
  int M = 0;                        // table entries per row
  int block_shift = 0;              // log2(B)
  uint32_t blocks = 0;              // num_blocks in the pools
  // FP8 pools only: the float32 scale of each pool row (k_cache / v_cache then hold e4m3).
  float* k_scale = nullptr;
  float* v_scale = nullptr;
};

template <typename T, int E>
__device__ __forceinline__ void attn_copy(const T* src, T* dst) {
  if constexpr (E == 4) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
  }
}

__device__ __forceinline__ float attn_warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float attn_warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Where dimension d of query head g lies in a warp's row of sm_acc: in place, or (SWIZZLED: the paged
// kernel over FP8 pools, whose lanes store groups of four dimensions) with the 16-byte group's low
// three bits XORed with the storing lane's (head parity, lane % 4), so that no two lanes of a quarter
// warp store to the same banks; reads of 32 consecutive dimensions still take 32 banks (D >= 128).
template <int D, bool SWIZZLED>
__device__ __forceinline__ int attn_acc_index(int g, int d) {
  if constexpr (!SWIZZLED) {
    return d;
  } else {
    const int group = d >> 2, quad = group / (D / 16);
    return ((group ^ ((((g & 1) << 2) | quad) & 7)) << 2) | (d & 3);
  }
}

// The end of both decode-attention kernels. Each warp has left its (max, sum) per query head in sm_m / sm_l
// [kAttnWarps][G] and its unnormalised output in sm_acc [kAttnWarps][G][D] (natural-log scale; each row laid
// out as attn_acc_index says); the block merges its warps, and with S > 1 the cluster (the S blocks of this
// row and head) merges its blocks through distributed shared memory: blk_* [G] / [G][D] are the block's
// result that its peers read.
template <typename T, int D, int G, bool SWIZZLED = false>
__device__ __forceinline__ void attn_finish(const AttnArgs& a, int b, int h, const float* sm_m, const float* sm_l,
                                            const float* sm_acc, float* blk_m, float* blk_l, float* blk_acc,
                                            PhaseClock& clock) {
  namespace cg = cooperative_groups;
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += kAttnWarps * 32) {
    const int g = i / D, d = i % D;
    float mx = kAttnFloor;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, sm_m[w * G + g]);
    float sum = 0.f, val = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float f = __expf(sm_m[w * G + g] - mx);
      sum += sm_l[w * G + g] * f;
      val += sm_acc[(w * G + g) * D + attn_acc_index<D, SWIZZLED>(g, d)] * f;
    }
    if (a.S == 1) {
      T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(b) * a.kv * G + h * G + g) * D;
      out[d] = from_f32<T>(val / sum);
    } else {
      blk_acc[i] = val;
      if (d == 0) {
        blk_m[g] = mx;
        blk_l[g] = sum;
      }
    }
  }
  clock.mark(4);
  if (a.S == 1) return;

  // cluster.sync() is a release/acquire barrier across the cluster: every block's blk_* writes
  // are visible to every other block's reads after it.
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  clock.mark(5);
  const int rank = static_cast<int>(cluster.block_rank());
  for (int i = rank * kAttnWarps * 32 + threadIdx.x; i < G * D; i += a.S * kAttnWarps * 32) {
    const int g = i / D, d = i % D;
    // Every remote read is issued before any is used (unrolled over the largest cluster): one
    // distributed-shared-memory round trip instead of 3 x S dependent ones.
    float rm[kAttnMaxSplits], rl[kAttnMaxSplits], rv[kAttnMaxSplits];
#pragma unroll
    for (int r = 0; r < kAttnMaxSplits; ++r) {
      if (r < a.S) {
        rm[r] = *cluster.map_shared_rank(&blk_m[g], r);
        rl[r] = *cluster.map_shared_rank(&blk_l[g], r);
        rv[r] = *cluster.map_shared_rank(&blk_acc[i], r);
      } else {
        rm[r] = kAttnFloor;
        rl[r] = rv[r] = 0.f;
      }
    }
    float mx = kAttnFloor;
#pragma unroll
    for (int r = 0; r < kAttnMaxSplits; ++r) mx = fmaxf(mx, rm[r]);
    float sum = 0.f, val = 0.f;
#pragma unroll
    for (int r = 0; r < kAttnMaxSplits; ++r) {
      const float f = __expf(rm[r] - mx);
      sum += rl[r] * f;
      val += rv[r] * f;
    }
    T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(b) * a.kv * G + h * G + g) * D;
    out[d] = from_f32<T>(val / sum);
  }
  clock.mark(6);
  cluster.sync();  // keep every block's shared memory alive until all reads are done
  clock.mark(7);
}

// One row's part of a launch, as both kernels (this one and paged_attention.cuh's) read it: its new
// token's query heads for KV head h and that head's new K and V (pointers into qkv), where the new
// K/V go, and the cached positions the slices split. The usual decode step writes the new token at
// the end of the range (tail): that position is then taken from k_new/v_new by warp 0 of slice 0,
// outside the chunk loop, and the slices split only the cached positions: a context of 1024 is 32
// chunks for the 32 warps of 8 slices, not 33 (one warp doing a second chunk for one position cost
// a whole extra HBM round trip).
template <typename T, int D, int G>
struct AttnRow {
  const T* q;
  const T* kn;
  const T* vn;
  int wat;      // write_at[b]
  bool writes;  // wat inside [0, L)
  bool tail;    // wat is the last attended position
  int cached;   // positions read from the cache: [0, cached)
  __device__ __forceinline__ AttnRow(const AttnArgs& a, int b, int h) {
    const T* row = static_cast<const T*>(a.qkv) + static_cast<int64_t>(b) * (a.kv * G + 2 * a.kv) * D;
    q = row + h * G * D;
    kn = row + (a.kv * G + h) * D;
    vn = row + (a.kv * G + a.kv + h) * D;
    wat = a.write_at[b];
    writes = wat >= 0 && wat < a.L;
    const int total = min(a.pos[b] + 1, a.L);
    tail = writes && wat == total - 1;
    cached = tail ? total - 1 : total;
  }
};

template <typename T, int D, int G>
__global__ void __launch_bounds__(kAttnWarps * 32) attn_split_kernel(AttnArgs a) {
  PhaseClock clock;
  constexpr int E = D / 32;      // output elements per lane
  constexpr int P16 = D / 8;     // 16-byte pieces of one K row
  using VRaw = typename std::conditional<E == 4, uint2, uint32_t>::type;  // E elements of V
  const int b = blockIdx.x / a.kv, h = blockIdx.x % a.kv, s = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const AttnRow<T, D, G> row(a, b, h);
  const T *q = row.q, *kn = row.kn, *vn = row.vn;
  const int wat = row.wat, cached = row.cached;
  const bool writes = row.writes, takes_tail = row.tail && s == 0 && warp == 0;
  const int chunk = (cached + a.S - 1) / a.S;
  const int t0 = s * chunk, t1 = min(cached, t0 + chunk);
  const int64_t head = (static_cast<int64_t>(b) * a.kv + h);
  T* kc = static_cast<T*>(a.k_cache) + head * a.L * D;  // this (row, head)'s cache
  T* vc = static_cast<T*>(a.v_cache) + head * a.L * D;

  // The queries' loads go out first: they are few, and their trip to shared memory (and the
  // barrier after it) then overlaps the K/V loads instead of queueing behind them.
  constexpr int kQPerThread = (G * D + kAttnWarps * 32 - 1) / (kAttnWarps * 32);
  T qv[kQPerThread];
#pragma unroll
  for (int j = 0; j < kQPerThread; ++j) {
    const int i = threadIdx.x + j * kAttnWarps * 32;
    if (i < G * D) qv[j] = q[i];
  }

  // Chunk loads: this lane's K row, and every V row of the chunk at this lane's elements. Past
  // the slice's end they re-read its last position (no branch around the loads); masked below.
  uint4 kraw[P16];
  VRaw vraw[kAttnChunk];
  auto load_k = [&](int base) {
    const int t = min(base + lane, t1 - 1);
    const T* krow = (writes && t == wat) ? kn : kc + static_cast<int64_t>(t) * D;
#pragma unroll
    for (int c = 0; c < P16; ++c) kraw[c] = *reinterpret_cast<const uint4*>(krow + c * 8);
  };
  auto load_v = [&](int base) {
#pragma unroll
    for (int j = 0; j < kAttnChunk; ++j) {
      const int tj = min(base + j, t1 - 1);
      const T* vrow = (writes && tj == wat) ? vn : vc + static_cast<int64_t>(tj) * D;
      vraw[j] = *reinterpret_cast<const VRaw*>(vrow + lane * E);
    }
  };
  // The first chunk's loads go out before anything else (they need only pos), so the queries'
  // trip to shared memory and the barrier below overlap them. The new K/V's store into the cache
  // may land before or after these loads: the position it writes is read from k_new/v_new.
  const int first = t0 + warp * kAttnChunk;
  if (first < t1) {
    load_k(first);
    load_v(first);
  }
  VRaw ktail, vtail;  // the new token's K and V at this lane's E elements
  if (takes_tail) {
    ktail = *reinterpret_cast<const VRaw*>(kn + lane * E);
    vtail = *reinterpret_cast<const VRaw*>(vn + lane * E);
  }

  __shared__ __align__(16) float qs[G][D];            // scaled queries, read by every lane
  __shared__ float sp[kAttnWarps][G][kAttnChunk];     // a chunk's probabilities, per warp
#pragma unroll
  for (int j = 0; j < kQPerThread; ++j) {
    const int i = threadIdx.x + j * kAttnWarps * 32;
    if (i < G * D) qs[i / D][i % D] = to_f32(qv[j]) * a.scale;
  }
  if (s == 0 && warp == 0 && writes) {
    attn_copy<T, E>(kn + lane * E, kc + static_cast<int64_t>(wat) * D + lane * E);
    attn_copy<T, E>(vn + lane * E, vc + static_cast<int64_t>(wat) * D + lane * E);
  }
  __syncthreads();
  clock.mark(1);

  float m[G], l[G], acc[G][E];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = kAttnFloor;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
  }
  if (takes_tail) {  // the new token alone: m = its score, l = 1, acc = its V
    const T* kt = reinterpret_cast<const T*>(&ktail);
    const T* vt = reinterpret_cast<const T*>(&vtail);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float part = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) part += qs[g][lane * E + e] * to_f32(kt[e]);
      m[g] = attn_warp_sum(part);
      l[g] = 1.f;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] = to_f32(vt[e]);
    }
  }

  // Software pipeline without extra registers: the next chunk's K loads go out as soon as this
  // chunk's scores have consumed kraw (they overlap the softmax and the V pass), and its V loads
  // as soon as the V pass has consumed vraw (they overlap the next chunk's scores).
  for (int base = first; base < t1; base += kAttnWarps * kAttnChunk) {
    const int next = base + kAttnWarps * kAttnChunk;
    const bool valid = base + lane < t1;

    // Scores of this lane's position for the G query heads.
    float sc[G];
#pragma unroll
    for (int g = 0; g < G; ++g) sc[g] = 0.f;
#pragma unroll
    for (int c = 0; c < P16; ++c) {
      const T* kv = reinterpret_cast<const T*>(&kraw[c]);
      float kf[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) kf[e] = to_f32(kv[e]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float4 qa = *reinterpret_cast<const float4*>(&qs[g][c * 8]);
        const float4 qb = *reinterpret_cast<const float4*>(&qs[g][c * 8 + 4]);
        sc[g] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] + qb.y * kf[5] +
                 qb.z * kf[6] + qb.w * kf[7];
      }
    }
    if (next < t1) load_k(next);
    clock.mark(2);

    // Online softmax over the chunk; the probabilities go to shared memory for the V pass.
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float mx = fmaxf(m[g], attn_warp_max(valid ? sc[g] : kAttnFloor));
      const float corr = __expf(m[g] - mx);
      const float p = valid ? __expf(sc[g] - mx) : 0.f;
      sp[warp][g][lane] = p;
      l[g] = l[g] * corr + attn_warp_sum(p);
      m[g] = mx;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[g][e] *= corr;
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < kAttnChunk; ++j) {
      const T* vv = reinterpret_cast<const T*>(&vraw[j]);
      float vf[E];
#pragma unroll
      for (int e = 0; e < E; ++e) vf[e] = to_f32(vv[e]);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = sp[warp][g][j];  // 0 past the slice's end
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] += p * vf[e];
      }
    }
    if (next < t1) load_v(next);
    __syncwarp();  // sp is rewritten by the next chunk
  }
  clock.mark(3);

  // Merge the warps: every warp leaves (m, l) per query head and its acc slice in shared memory.
  __shared__ float sm_m[kAttnWarps][G];
  __shared__ float sm_l[kAttnWarps][G];
  __shared__ float sm_acc[kAttnWarps][G][D];
  __shared__ float blk_m[G], blk_l[G];
  __shared__ float blk_acc[G][D];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][g][lane * E + e] = acc[g][e];
  }
  attn_finish<T, D, G>(a, b, h, &sm_m[0][0], &sm_l[0][0], &sm_acc[0][0][0], blk_m, blk_l, &blk_acc[0][0], clock);
}

}  // namespace switchyard
