// Decode attention: one new token per row against that row's KV cache, with the new K/V written
// into the cache in the same launch (split-sequence "flash decoding", merged inside a cluster).
//
// Layouts (one device's shard, as the engine keeps them):
//   qkv      [n, kv * G + 2 * kv, D]  per row: the new token's query heads, then its K heads and
//            its V heads: the engine's QKV projection output, read in place (no slice copies and
//            no rope pass per layer)
//            or, instead, float32 partial products [S, n, kv * G + 2 * kv, D] whose sum (rounded to
//            the cache dtype) is qkv: the QKV projection written as a dot over S slices of K, so
//            that no kernel of XLA's sums its split-K partials in front of this one
//   inv_freq [D / 2] float32, or none: rotary embedding (rotate-half convention) applied here to
//            the queries and the new K at angle pos[b] * inv_freq[i], each rounded to the input
//            dtype as a separate rope pass would leave it (none: q and K arrive rotated)
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
// Merging the S slices. The S blocks of one (row, head) form a thread-block cluster (S <= 8, the
// portable cluster size): each leaves its (m, l, acc) in its shared memory, the cluster
// synchronises, and every block merges a share of the G x D outputs by reading all S blocks'
// shared memory (distributed shared memory, every remote read issued before any is used), then
// the cluster synchronises again so that no block exits while a peer still reads its shared
// memory. No partial results go through global memory and nothing needs a second launch, a fence
// or an atomic: at batch 1 the kernel's time is a chain of latencies, and this keeps it to one
// HBM round trip for K/V and two cluster barriers. The host lowers S until all clusters fit on
// the GPU at once (switchyard_ffi.cu, g_attn_clusters).
//
// The new K/V. Warp 0 of slice 0 takes the new token from qkv (rotating K, with rope), stores
// it into the cache and, when it is within the attended range, scores it outside the chunk loop.
// In the usual step it is the last attended position and the slices split only the cached
// positions before it (so 1024 cached positions are 32 whole chunks); written elsewhere in the
// range, the chunk loop masks that position out (its loads read another attended position, never
// the one being written). No block reads what another writes, so one launch suffices.
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
constexpr int kAttnMaxSplits = 8;  // the portable thread-block cluster size
constexpr int kAttnMaxParts = 4;   // partial products of qkv the kernel sums

struct AttnArgs {
  const void* qkv;  // [n, kv * G + 2 * kv, D]: each row's query heads, then its new K and V heads
  const float* parts;  // or (splits > 0) qkv as float32 partial products [splits, n, kv * G + 2 * kv, D]
  int splits;
  int64_t slice;  // elements per partial product
  const float* inv_freq;  // [D / 2], or nullptr: no rope
  void* k_cache;
  void* v_cache;
  const int32_t* pos;
  const int32_t* write_at;
  void* out;
  int n, kv, G, L, S;
  float scale;
};

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

// Rotate-half rope of one element: x at index d of a head, xp its partner at d +- D/2, with the
// cosine and sine of its angle. The result is rounded to T, as a separate rope pass would store it.
template <typename T, int D>
__device__ __forceinline__ float attn_rope(float x, float xp, int d, float cs, float sn) {
  return to_f32(from_f32<T>(d < D / 2 ? x * cs - xp * sn : x * cs + xp * sn));
}

template <typename T, int D, int G>
__global__ void __launch_bounds__(kAttnWarps * 32) attn_split_kernel(AttnArgs a) {
  namespace cg = cooperative_groups;
  PhaseClock clock;
  constexpr int E = D / 32;      // output elements per lane
  constexpr int P16 = D / 8;     // 16-byte pieces of one K row
  using VRaw = typename std::conditional<E == 4, uint2, uint32_t>::type;  // E elements of V
  const int b = blockIdx.x / a.kv, h = blockIdx.x % a.kv, s = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int pos = a.pos[b];
  const int wat = a.write_at[b];
  const bool writes = wat >= 0 && wat < a.L;
  const int total = min(pos + 1, a.L);
  // The usual decode step writes the new token at the end of the range; the slices then split
  // only the cached positions: a context of 1024 is 32 chunks for the 32 warps of 8 slices, not
  // 33 (one warp doing a second chunk for one position cost a whole extra HBM round trip).
  const bool tail = writes && wat == total - 1;
  const bool new_in_range = writes && wat < total;
  const bool takes_new = new_in_range && s == 0 && warp == 0;
  const int cached = tail ? total - 1 : total;
  const int chunk = (cached + a.S - 1) / a.S;
  const int t0 = s * chunk, t1 = min(cached, t0 + chunk);

  // Element offsets (in qkv, and in each partial product) of this row's queries, new K and new V.
  const int64_t row = static_cast<int64_t>(b) * (a.kv * G + 2 * a.kv) * D;
  const int64_t q = row + h * G * D;
  const int64_t kn = row + (a.kv * G + h) * D;
  const int64_t vn = row + (a.kv * G + a.kv + h) * D;
  const T* qkv = static_cast<const T*>(a.qkv);
  // One element, or n elements as one load, of qkv: read, or summed over the partial products in
  // float32 (slice order) and rounded to T, as XLA rounds the product it would have written.
  auto element = [&](int64_t at) -> T {
    if (a.splits == 0) return qkv[at];
    float f[kAttnMaxParts];
#pragma unroll
    for (int k = 0; k < kAttnMaxParts; ++k) f[k] = k < a.splits ? __ldg(a.parts + k * a.slice + at) : 0.f;
    float sum = f[0];
#pragma unroll
    for (int k = 1; k < kAttnMaxParts; ++k) sum += f[k];  // + 0.f past the last: exact
    return from_f32<T>(sum);
  };
  auto lane_pack = [&](int64_t at) -> VRaw {  // the E elements at `at`
    if (a.splits == 0) return *reinterpret_cast<const VRaw*>(qkv + at);
    using F = typename std::conditional<E == 4, float4, float2>::type;
    F f[kAttnMaxParts];
#pragma unroll
    for (int k = 0; k < kAttnMaxParts; ++k)
      if (k < a.splits) f[k] = __ldg(reinterpret_cast<const F*>(a.parts + k * a.slice + at));
    float sum[E] = {};
#pragma unroll
    for (int k = 0; k < kAttnMaxParts; ++k) {
      const float* fe = reinterpret_cast<const float*>(&f[k]);
#pragma unroll
      for (int e = 0; e < E; ++e)
        if (k < a.splits) sum[e] += fe[e];
    }
    VRaw r;
    T* rt = reinterpret_cast<T*>(&r);
#pragma unroll
    for (int e = 0; e < E; ++e) rt[e] = from_f32<T>(sum[e]);
    return r;
  };
  const int64_t head = (static_cast<int64_t>(b) * a.kv + h);
  T* kc = static_cast<T*>(a.k_cache) + head * a.L * D;
  T* vc = static_cast<T*>(a.v_cache) + head * a.L * D;

  // The queries' loads go out first: they are few, and their trip to shared memory (and the
  // barrier after it) then overlaps the K/V loads instead of queueing behind them.
  // With rope each element also needs its partner (d +- D/2) and its frequency.
  constexpr int kQPerThread = (G * D + kAttnWarps * 32 - 1) / (kAttnWarps * 32);
  const bool rope = a.inv_freq != nullptr;
  T qv[kQPerThread], qp[kQPerThread];
#pragma unroll
  for (int j = 0; j < kQPerThread; ++j) {
    const int i = threadIdx.x + j * kAttnWarps * 32;
    if (i < G * D) {
      qv[j] = element(q + i);
      if (rope) qp[j] = element(q + i - i % D + (i % D + D / 2) % D);
    }
  }
  const float freq = rope && threadIdx.x < D / 2 ? a.inv_freq[threadIdx.x] : 0.f;

  // Chunk loads: this lane's K row, and every V row of the chunk at this lane's elements. Past
  // the slice's end they re-read its last position (no branch around the loads); masked below.
  uint4 kraw[P16];
  VRaw vraw[kAttnChunk];
  // The position being written in this launch (only inside the range when the new token is not
  // the last one) is masked out below; its loads read another attended position instead.
  const int stand_in = wat == 0 ? 1 : 0;
  auto load_k = [&](int base) {
    int t = min(base + lane, t1 - 1);
    if (new_in_range && t == wat) t = stand_in;
    const T* krow = kc + static_cast<int64_t>(t) * D;
#pragma unroll
    for (int c = 0; c < P16; ++c) kraw[c] = *reinterpret_cast<const uint4*>(krow + c * 8);
  };
  auto load_v = [&](int base) {
#pragma unroll
    for (int j = 0; j < kAttnChunk; ++j) {
      int tj = min(base + j, t1 - 1);
      if (new_in_range && tj == wat) tj = stand_in;
      const T* vrow = vc + static_cast<int64_t>(tj) * D;
      vraw[j] = *reinterpret_cast<const VRaw*>(vrow + lane * E);
    }
  };
  // The first chunk's loads go out before anything else (they need only pos), so the queries'
  // trip to shared memory and the barrier below overlap them. The new K/V's store into the cache
  // may land before or after these loads: the loads never read the position it writes.
  const int first = t0 + warp * kAttnChunk;
  if (first < t1) {
    load_k(first);
    load_v(first);
  }
  // Warp 0 of slice 0 owns the new token's K and V (this lane's E elements): it stores them into
  // the cache and, when it is the last attended position, scores it.
  const bool owns_new = writes && s == 0 && warp == 0;
  VRaw knew, vnew, kpart;
  if (owns_new) {
    knew = lane_pack(kn + lane * E);
    vnew = lane_pack(vn + lane * E);
    if (rope) kpart = lane_pack(kn + (lane ^ 16) * E);  // 16 * E == D / 2
  }

  __shared__ __align__(16) float qs[G][D];            // scaled queries, read by every lane
  __shared__ float sp[kAttnWarps][G][kAttnChunk];     // a chunk's probabilities, per warp
  // Rope: the cosine and sine of the D / 2 angles pos * inv_freq, once per block. sincosf, not the
  // fast intrinsic: the angle reaches 1e5 radians at long contexts.
  __shared__ float rope_cs[D / 2], rope_sn[D / 2];
  if (rope) {
    if (threadIdx.x < D / 2) sincosf(static_cast<float>(pos) * freq, &rope_sn[threadIdx.x], &rope_cs[threadIdx.x]);
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < kQPerThread; ++j) {
    const int i = threadIdx.x + j * kAttnWarps * 32;
    if (i < G * D) {
      const int f = i % (D / 2);
      qs[i / D][i % D] =
          (rope ? attn_rope<T, D>(to_f32(qv[j]), to_f32(qp[j]), i % D, rope_cs[f], rope_sn[f]) : to_f32(qv[j])) *
          a.scale;
    }
  }
  if (owns_new) {
    if (rope) {
      T* kt = reinterpret_cast<T*>(&knew);
      const T* kp = reinterpret_cast<const T*>(&kpart);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int d = lane * E + e;
        kt[e] = from_f32<T>(attn_rope<T, D>(to_f32(kt[e]), to_f32(kp[e]), d, rope_cs[d % (D / 2)], rope_sn[d % (D / 2)]));
      }
    }
    *reinterpret_cast<VRaw*>(kc + static_cast<int64_t>(wat) * D + lane * E) = knew;
    *reinterpret_cast<VRaw*>(vc + static_cast<int64_t>(wat) * D + lane * E) = vnew;
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
  if (takes_new) {  // the new token alone: m = its score, l = 1, acc = its V
    const T* kt = reinterpret_cast<const T*>(&knew);
    const T* vt = reinterpret_cast<const T*>(&vnew);
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
    const bool valid = base + lane < t1 && !(new_in_range && base + lane == wat);  // warp 0 of slice 0 has it

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

  // Merge the warps: every warp leaves (m, l) per query head and its acc slice in shared memory;
  // the block's result (max, sum, unnormalised acc) goes to blk_* for the cluster merge.
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
      out[d] = from_f32<T>(val / sum);
    } else {
      blk_acc[g][d] = val;
      if (d == 0) {
        blk_m[g] = mx;
        blk_l[g] = sum;
      }
    }
  }
  clock.mark(4);
  if (a.S == 1) return;

  // The cluster (the S blocks of this row and head) merges through distributed shared memory.
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
        rv[r] = *cluster.map_shared_rank(&blk_acc[g][d], r);
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

}  // namespace switchyard
