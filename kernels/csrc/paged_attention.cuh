// Decode attention over a paged KV cache, on tensor cores. The caches are pools of blocks,
// k_pool / v_pool [num_blocks, kv, B, D] (B a power of two), and row b's logical position p lives
// in block tables[b, p / B] at offset p % B. Same arguments, slices, new-K/V handling and merge as
// the contiguous kernel, attn_split_kernel (decode_attention.cuh); what differs is how a block
// finds, moves and multiplies K/V.
//
// Why not attn_split_kernel's way. Holding a chunk of K/V in registers takes 229 registers a
// thread: two blocks of 4 warps share a multiprocessor, each warp has one chunk in flight, and its
// CUDA-core arithmetic is a long chain. Over block tables it ran at 1.75 TB/s beside 20 decoding
// sequences; this kernel is faster at every batch and context measured, batch 1 included
// (benchmarks/NOTES.md, 2026-11-25).
//
// Loads. The block moves stages of kPagedStage positions (K and V rows, 16 KB at D = 128) from
// the pools into a ring of kPagedStages stages in shared memory with cp.async, kPagedStages - 1
// stages ahead of the one it computes, so several stages of every block are in flight while its
// warps multiply. Each thread copies 16-byte pieces of a few rows of a stage; it looks up each
// row's block in the table (any block size works), the entries fetched one stage ahead. Rows are
// stored with their 16-byte pieces permuted by row (piece c of row r at c ^ (r % 8),
// paged_stage_offset), so the 8 rows an ldmatrix reads fall in 8 different bank groups.
//
// Products. Warp w takes positions 8w .. 8w + 7 of every stage. The scores S[g, t] = q_g . k_t are
// an m16n8k16 product: A = the G query heads (rows G..15 zero; loaded once into registers),
// B = the 8 positions' K rows (ldmatrix); its result is laid out exactly as the A operand of the
// m16n8k8 product P . V, so the probabilities go from one to the other in registers (as bf16/fp16,
// the softmax's running max and sums in fp32), and V's rows come by ldmatrix.trans. Rows G..15 of
// the products are wasted; at decode the tensor cores are far from the limit, the memory is not.
// The online softmax is per warp, in base 2 (the scale folded into one multiply).
//
// The end is attn_finish's: warps, then the slices of the cluster, merged in shared memory.
//
// FP8 pools (KV = __nv_fp8_e4m3, kv_cache.Fp8Pool): e4m3 rows with a float32 scale per position and
// KV head, at the same row index in k_scale / v_scale. The ring then holds the e4m3 rows (half the
// bytes; their 16-byte pieces permuted by row as above) and their scales, and the products read the
// e4m3 bytes straight into their operand registers, widened exactly to fp16 (ldmatrix moves 16-bit
// elements only; a pass through a 16-bit stage put its latency between each stage's arrival and
// its products). Two permutations make those reads whole words:
// - scores: the head dimension is permuted (the same way for the queries), so that a thread's
//   operands for two k16 steps are 8 consecutive bytes of its position's K row;
// - P . V: output column n of tile j is dimension n * D/8 + j, so that a thread's operands for
//   every tile are D/8 consecutive bytes of each of its two positions' V rows.
// Both products run in fp16 whatever T is: e4m3 widens to fp16 exactly in one instruction per
// pair (to bf16 it took five, and the kernel is bound by issuing instructions, not by bytes).
// bf16 queries are scaled per head by a power of two into fp16's top binade (exact for every value
// within 2^28 of the head's largest); the scores undo it. The scales stay out of the operands: K's
// multiplies the scores (fp32); V's joins the probabilities' exponent (log2 of the scale added to
// the score) with a running max of its own, so that the fp16 weights stay in (0, 1] whatever the
// scale; the accumulators take the softmax's own max back at the end.
// The new K/V are rounded to e4m3 with a scale of their own as kv_cache.write rounds them (the
// row's largest magnitude over 448), stored so, and attended as stored.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

#include "decode_attention.cuh"

namespace switchyard {

// A pool row (one position of one KV head) has a 32-bit index, from which its address is row * D:
// the host keeps num_blocks * kv * B below kPagedRowLimit. Table entries outside [0, num_blocks)
// are read as block 0 (no access outside the pool); the new K/V are stored only where the entry
// for write_at is inside it.
constexpr uint32_t kPagedRowLimit = 0xFFFFFFFFu;

__device__ __forceinline__ uint32_t attn_pool_row(const AttnArgs& a, int32_t block, int h, int t) {
  const uint32_t blk = static_cast<uint32_t>(block) < a.blocks ? static_cast<uint32_t>(block) : 0u;
  return ((blk * a.kv + h) << a.block_shift) + (static_cast<uint32_t>(t) & ((1u << a.block_shift) - 1u));
}

constexpr int kPagedStage = 32;   // positions per stage: 8 for each of the kAttnWarps warps
constexpr int kPagedStages = 4;   // stages in the shared-memory ring (8 for FP8 pools measured slower)
static_assert(kPagedStage == 8 * kAttnWarps, "a warp takes 8 positions (one n8 tile) of a stage");

using Fp8 = __nv_fp8_e4m3;
constexpr float kFp8Max = 448.f;          // fp8.FP8_MAX
constexpr float kFp8MinScale = 1e-12f;    // fp8.MIN_SCALE

template <typename T, typename KV>
__host__ __device__ constexpr bool paged_fp8() {
  return !std::is_same<T, KV>::value;
}

// One ring stage: K rows then V rows of kPagedStage positions in the pool's element type, then (FP8)
// their scales, K's then V's.
template <typename T, typename KV, int D>
__host__ __device__ constexpr int paged_stage_bytes() {
  return 2 * kPagedStage * D * static_cast<int>(sizeof(KV)) + (paged_fp8<T, KV>() ? 2 * kPagedStage * 4 : 0);
}

// Shared memory of one block: the ring, reused by attn_finish's arrays once the loop is done.
template <typename T, typename KV, int D, int G>
constexpr int paged_attn_smem_bytes() {
  constexpr int ring = kPagedStages * paged_stage_bytes<T, KV, D>();
  constexpr int finish = static_cast<int>(sizeof(float)) * ((kAttnWarps + 1) * G * (D + 2));
  return ring > finish ? ring : finish;
}

// kv_cache.write's rounding of one row: its scale from the row's largest magnitude, and each value
// as the pool gives it back (e4m3 times the scale, rounded to T), with the reciprocal as fp8.py
// computes it.
struct Fp8RowScale {
  float scale, inv;
  __device__ __forceinline__ explicit Fp8RowScale(float amax)
      : scale(fmaxf(amax * (1.0f / kFp8Max), kFp8MinScale)), inv(1.0f / scale) {}
  __device__ __forceinline__ Fp8 quantize(float x) const { return Fp8(fminf(fmaxf(x * inv, -kFp8Max), kFp8Max)); }
  template <typename T>
  __device__ __forceinline__ T stored(float x) const {
    return from_f32<T>(static_cast<float>(quantize(x)) * scale);
  }
};

template <typename T, int D>
__device__ __forceinline__ float paged_row_amax(const T* row) {
  float m = 0.f;
  for (int i = 0; i < D; ++i) m = fmaxf(m, fabsf(to_f32(row[i])));
  return m;
}

// Where piece `piece` (8 elements, 16 bytes) of row r of a stage's K or V lives in the stage: pieces
// permuted by row, so the 8 rows an ldmatrix reads fall in 8 different bank groups.
template <int D>
__device__ __forceinline__ int paged_stage_offset(int r, int piece) {
  return r * D + ((piece ^ (r & 7)) * 8);
}

// The same for an e4m3 row (D bytes): its pieces permuted within the row's D / 16.
template <int D>
__device__ __forceinline__ int paged_fp8_offset(int r, int piece) {
  constexpr int kMask = (D / 16 < 8 ? D / 16 : 8) - 1;
  return r * D + ((piece ^ (r & kMask)) * 16);
}

// Four e4m3 values (w's bytes, the first lowest) as two registers of two fp16 each, exactly: bytes
// 0, 1 in lo, bytes 2, 3 in hi.
__device__ __forceinline__ void paged_e4m3x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const __half2_raw l = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFFu), __NV_E4M3);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  lo = *reinterpret_cast<const uint32_t*>(&l);
  hi = *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t paged_smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void paged_cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void paged_cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void paged_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void paged_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void paged_ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void paged_ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += A (m16 x k16, rows 8..15 zero: a1 = a3 = 0) . B (k16 x n8)
template <typename T>
__device__ __forceinline__ void paged_mma_k16(float (&c)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  const uint32_t z = 0;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(z), "r"(a2), "r"(z), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(z), "r"(a2), "r"(z), "r"(b0), "r"(b1));
  }
}

// c += A (m16 x k8, rows 8..15 zero) . B (k8 x n8)
template <typename T>
__device__ __forceinline__ void paged_mma_k8(float (&c)[4], uint32_t a0, uint32_t b0) {
  const uint32_t z = 0;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(z), "r"(b0));
  } else {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(z), "r"(b0));
  }
}

// Two floats as one register of two T (the first in the low half).
template <typename T>
__device__ __forceinline__ uint32_t paged_pack(float lo, float hi) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

template <typename T, typename KV, int D, int G>
__global__ void __launch_bounds__(kAttnWarps * 32) paged_attn_kernel(AttnArgs a) {
  static_assert(D % 32 == 0 && G <= 8, "head_dim a multiple of 32, at most 8 query heads per KV head");
  PhaseClock clock;
  constexpr bool kFp8 = paged_fp8<T, KV>();
  static_assert(!kFp8 || std::is_same<KV, Fp8>::value, "a pool of T, or e4m3 with scales");
  constexpr int KS = D / 16;                       // k16 steps of the scores
  constexpr int NT = D / 8;                        // n8 tiles of the output
  constexpr int kRowBytes = D * static_cast<int>(sizeof(KV));  // one pool row
  constexpr int CH = kRowBytes / 16;               // 16-byte pieces of one pool row
  constexpr int kRowsPerPass = kAttnWarps * 32 / CH;
  constexpr int kPasses = kPagedStage / kRowsPerPass;  // rows of a stage each thread copies
  constexpr int kStageBytes = paged_stage_bytes<T, KV, D>();
  constexpr int kScaleOffset = 2 * kPagedStage * kRowBytes;  // FP8: the stage's scales
  constexpr float kLog2e = 1.4426950408889634f;
  static_assert(kPagedStage % kRowsPerPass == 0, "whole passes per stage");
  extern __shared__ __align__(128) unsigned char paged_smem[];
  unsigned char* ring = paged_smem;

  const int b = blockIdx.x / a.kv, h = blockIdx.x % a.kv, s = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const AttnRow<T, D, G> row(a, b, h);
  const T *q = row.q, *kn = row.kn, *vn = row.vn;
  // The queries as the A operand (row g = lane / 4; rows past G are zero), loaded before the block
  // table (FP8 scales them in the prologue, so their loads should be on their way early). Step k's
  // columns 2 quad + {0, 1} and 2 quad + {8, 9} are those dimensions; FP8 permutes them (see the
  // top): dimensions 32 (k / 2) + 8 quad + 4 (k % 2) + {0, 1} and + {2, 3}.
  const int g_row = lane >> 2, quad = lane & 3;
  uint32_t qa[KS][2];
#pragma unroll
  for (int k = 0; k < KS; ++k) {
    qa[k][0] = qa[k][1] = 0u;
    if (g_row < G) {
      const int first = kFp8 ? 32 * (k / 2) + 8 * quad + 4 * (k % 2) : k * 16 + quad * 2;
      const T* qg = q + g_row * D + first;
      qa[k][0] = *reinterpret_cast<const uint32_t*>(qg);
      qa[k][1] = *reinterpret_cast<const uint32_t*>(qg + (kFp8 ? 2 : 8));
    }
  }
  // Slice 0's warp 0 writes the new K/V and attends the new token; their values are loaded now,
  // beside the queries, not after the first copies are issued (slice 0 finished last in its
  // cluster: benchmarks/NOTES.md).
  constexpr int E = D / 32;
  float k_new[E], v_new[E];
#pragma unroll
  for (int e = 0; e < E; ++e) k_new[e] = v_new[e] = 0.f;
  if (s == 0 && warp == 0) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      k_new[e] = to_f32(kn[lane * E + e]);
      v_new[e] = to_f32(vn[lane * E + e]);
    }
  }
  const int wat = row.wat, cached = row.cached;
  const bool writes = row.writes, tail = row.tail;
  // Slices start on stage boundaries, so only a slice's last stage is partial.
  const int span = ((cached + a.S - 1) / a.S + kPagedStage - 1) / kPagedStage * kPagedStage;
  const int t0 = s * span, t1 = min(cached, t0 + span);
  const int stages = t0 < t1 ? (t1 - t0 + kPagedStage - 1) / kPagedStage : 0;

  KV* kc = static_cast<KV*>(a.k_cache);
  KV* vc = static_cast<KV*>(a.v_cache);
  const int32_t* table = a.tables + static_cast<int64_t>(b) * a.M;
  int32_t write_block = -1;
  if (s == 0 && warp == 0 && writes) write_block = table[wat >> a.block_shift];

  // This thread copies piece `piece` of rows first_row + p * kRowsPerPass of every stage; past the
  // slice's end it copies its last position again (finite data, masked below).
  const int piece = tid % CH, first_row = tid / CH;
  auto stage_pos = [&](int i, int p) { return min(t0 + i * kPagedStage + first_row + p * kRowsPerPass, t1 - 1); };
  auto fetch_entries = [&](int i, int32_t (&e)[kPasses]) {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) e[p] = i < stages ? table[stage_pos(i, p) >> a.block_shift] : 0;
  };
  auto issue = [&](int i, const int32_t (&e)[kPasses]) {
    if (i >= stages) return;
    unsigned char* st = ring + (i % kPagedStages) * kStageBytes;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int r = first_row + p * kRowsPerPass;
      const uint32_t pool_row = attn_pool_row(a, e[p], h, stage_pos(i, p));
      const uint64_t src = static_cast<uint64_t>(pool_row) * D + piece * (16 / sizeof(KV));
      const int dst = kFp8 ? paged_fp8_offset<D>(r, piece)
                           : static_cast<int>(sizeof(KV)) * paged_stage_offset<D>(r, piece);
      paged_cp_async16(paged_smem_addr(st + dst), kc + src);
      paged_cp_async16(paged_smem_addr(st + kPagedStage * kRowBytes + dst), vc + src);
      if constexpr (kFp8) {
        if (piece == 0) {
          paged_cp_async4(paged_smem_addr(st + kScaleOffset + 4 * r), a.k_scale + pool_row);
          paged_cp_async4(paged_smem_addr(st + kScaleOffset + 4 * (kPagedStage + r)), a.v_scale + pool_row);
        }
      }
    }
  };

  // The first stages' table entries, then their copies, before anything else.
  int32_t first_entries[kPagedStages - 1][kPasses];
  int32_t next_entries[kPasses];
#pragma unroll
  for (int i = 0; i < kPagedStages - 1; ++i) fetch_entries(i, first_entries[i]);
  fetch_entries(kPagedStages - 1, next_entries);
#pragma unroll
  for (int i = 0; i < kPagedStages - 1; ++i) {
    issue(i, first_entries[i]);
    paged_cp_async_commit();
  }
  clock.mark(1);

  // FP8 with bf16 queries: row g_row times 2^shift as fp16, its largest magnitude in [2^14, 2^15);
  // q_unscale undoes it in the scores. The four threads of a row hold all of its D values.
  float q_unscale = 1.f;
  if constexpr (kFp8 && std::is_same<T, __nv_bfloat16>::value) {
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < KS; ++k)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qa[k][i]));
        amax = fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y)));
      }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    int exponent;
    frexpf(amax, &exponent);  // amax < 2^exponent (exponent 0 for a zero row)
    const int shift = min(15 - exponent, 120);
    const float up = ldexpf(1.f, shift);
    q_unscale = ldexpf(1.f, -shift);
#pragma unroll
    for (int k = 0; k < KS; ++k)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qa[k][i]));
        qa[k][i] = paged_pack<__half>(v.x * up, v.y * up);
      }
  }
  using P = typename std::conditional<kFp8, __half, T>::type;  // the products' operand type
  // The output dimension of this thread's column c of tile j (FP8 permutes them, see the top).
  auto out_dim = [&](int j, int c) { return kFp8 ? (2 * quad + c) * NT + j : 8 * j + 2 * quad + c; };
  // FP8: the new K/V's rounding (warp 0 of slice 0, which stores them and attends the tail).
  Fp8RowScale k_round(0.f), v_round(0.f);
  if (s == 0 && warp == 0 && writes) {  // the new K/V into the pool (read from qkv by this launch)
    if constexpr (kFp8) {
      float km = 0.f, vm = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        km = fmaxf(km, fabsf(k_new[e]));
        vm = fmaxf(vm, fabsf(v_new[e]));
      }
      k_round = Fp8RowScale(attn_warp_max(km));
      v_round = Fp8RowScale(attn_warp_max(vm));
    }
    if (static_cast<uint32_t>(write_block) < a.blocks) {
      const uint32_t pool_row = attn_pool_row(a, write_block, h, wat);
      const uint64_t at = static_cast<uint64_t>(pool_row) * D + lane * E;
      if constexpr (kFp8) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          kc[at + e] = k_round.quantize(k_new[e]);
          vc[at + e] = v_round.quantize(v_new[e]);
        }
        if (lane == 0) {
          a.k_scale[pool_row] = k_round.scale;
          a.v_scale[pool_row] = v_round.scale;
        }
      } else {
        attn_copy<T, E>(kn + lane * E, kc + at);
        attn_copy<T, E>(vn + lane * E, vc + at);
      }
    }
  }
  // The new V for the tail's accumulators: its own, or (FP8) its e4m3 values, whose scale goes into m_v.
  auto new_v = [&](int i) { return kFp8 ? static_cast<float>(v_round.quantize(to_f32(vn[i]))) : to_f32(vn[i]); };

  // This thread's share of its warp's running softmax: row g_row, output columns 8j + 2 quad + {0, 1}.
  const float scale = a.scale * kLog2e;
  const float score_scale = scale * q_unscale;
  float m = kAttnFloor, l = 0.f;
  float m_v = kAttnFloor;  // FP8: the running max of score + log2(V's scale); acc is relative to it
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  if (tail && s == 0 && warp == 0) {  // the new token alone: m = its score, l = 1, acc = its V
    // The new K as the pool gives it back: qkv's own, or (FP8) its rounding.
    float k_back[E];
#pragma unroll
    for (int e = 0; e < E; ++e) k_back[e] = kFp8 ? to_f32(k_round.stored<T>(k_new[e])) : k_new[e];
    float part[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      part[g] = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) part[g] += to_f32(q[g * D + lane * E + e]) * k_back[e];
      part[g] = attn_warp_sum(part[g]);
    }
    if (g_row < G) {
#pragma unroll
      for (int g = 0; g < G; ++g)
        if (g == g_row) m = part[g] * scale;
      // FP8: acc holds the new V's e4m3 values, as the cached positions' (their scale in m_v).
      if constexpr (kFp8) m_v = m + __log2f(v_round.scale);
      l = quad == 0 ? 1.f : 0.f;  // the four threads of a row sum their l at the end
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        acc[j][0] = new_v(out_dim(j, 0));
        acc[j][1] = new_v(out_dim(j, 1));
      }
    }
  }
  clock.mark(2);

  // ldmatrix addresses: lane supplies row 8 * warp + lane % 8 of matrix lane / 8.
  const int my_row = 8 * warp + (lane & 7), my_mat = lane >> 3;
  for (int i = 0; i < stages; ++i) {
    paged_cp_async_wait<kPagedStages - 2>();
    __syncthreads();  // stage i has landed for every thread; every warp is done with stage i - 1
    issue(i + kPagedStages - 1, next_entries);  // into stage i - 1's place
    paged_cp_async_commit();
    fetch_entries(i + kPagedStages, next_entries);
    unsigned char* st = ring + (i % kPagedStages) * kStageBytes;
    T* ks = reinterpret_cast<T*>(st);  // 16-bit pools: the stage's K rows, then its V rows
    T* vs = ks + kPagedStage * D;
    float* k_scales = reinterpret_cast<float*>(st + kScaleOffset);  // FP8
    float* v_scales = k_scales + kPagedStage;
    const int base = t0 + i * kPagedStage;
    if (writes && !tail && wat >= base && wat < min(base + kPagedStage, t1)) {
      // The new K/V inside the range, not at its end: this stage's copy of it came from the pool,
      // written or not; the block takes qkv's instead, as the pool gives them back (block-uniform branch).
      const int r = wat - base;
      if constexpr (kFp8) {
        for (int c = tid; c < 2 * CH; c += kAttnWarps * 32) {
          const int pc = c % CH;
          const T* src = c < CH ? kn : vn;
          const Fp8RowScale round(paged_row_amax<T, D>(src));
          uint4 piece8;
          Fp8* f = reinterpret_cast<Fp8*>(&piece8);
#pragma unroll
          for (int e = 0; e < 16; ++e) f[e] = round.quantize(to_f32(src[pc * 16 + e]));
          *reinterpret_cast<uint4*>(st + (c < CH ? 0 : kPagedStage * kRowBytes) + paged_fp8_offset<D>(r, pc)) = piece8;
          if (pc == 0) (c < CH ? k_scales : v_scales)[r] = round.scale;
        }
      } else {
        constexpr int CH16 = D / 8;  // 16-byte pieces of a 16-bit row
        for (int c = tid; c < 2 * CH16; c += kAttnWarps * 32) {
          const int pc = c % CH16;
          const T* src = c < CH16 ? kn : vn;
          *reinterpret_cast<uint4*>((c < CH16 ? ks : vs) + paged_stage_offset<D>(r, pc)) =
              *reinterpret_cast<const uint4*>(src + pc * 8);
        }
      }
      __syncthreads();
    }
    const int first = base + 8 * warp;  // this warp's first position
    if (first >= t1) continue;          // warp-uniform

    // Scores: two accumulators, so that the k16 steps form two chains of KS / 2.
    float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (kFp8) {
      // B's column g_row is position 8 warp + g_row; 8 bytes of its row give steps k and k + 1.
      const int r = 8 * warp + g_row;
#pragma unroll
      for (int k = 0; k < KS; k += 2) {
        const int byte = 16 * k + 8 * quad;  // dimension 32 (k / 2) + 8 quad
        const uint2 w = *reinterpret_cast<const uint2*>(st + paged_fp8_offset<D>(r, byte / 16) + byte % 16);
        uint32_t kb[4];
        paged_e4m3x4(w.x, kb[0], kb[1]);
        paged_e4m3x4(w.y, kb[2], kb[3]);
        paged_mma_k16<P>(c0, qa[k][0], qa[k][1], kb[0], kb[1]);
        paged_mma_k16<P>(c1, qa[k + 1][0], qa[k + 1][1], kb[2], kb[3]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < KS; k += 2) {
        uint32_t kb[4];
        const int chunk = 2 * k + my_mat;  // pieces 2k, 2k + 1 (step k), 2k + 2, 2k + 3 (step k + 1)
        paged_ldmatrix_x4(kb, paged_smem_addr(ks + paged_stage_offset<D>(my_row, chunk)));
        paged_mma_k16<T>(c0, qa[k][0], qa[k][1], kb[0], kb[1]);
        paged_mma_k16<T>(c1, qa[k + 1][0], qa[k + 1][1], kb[2], kb[3]);
      }
    }
    // This thread's two positions: first + 2 quad + {0, 1}.
    const int pos = 8 * warp + 2 * quad;
    float2 k_scale = make_float2(1.f, 1.f), v_scale = make_float2(1.f, 1.f);
    if constexpr (kFp8) {
      k_scale = *reinterpret_cast<const float2*>(k_scales + pos);
      v_scale = *reinterpret_cast<const float2*>(v_scales + pos);
    }
    const bool valid0 = first + 2 * quad < t1, valid1 = first + 2 * quad + 1 < t1;
    const float s0 = (c0[0] + c1[0]) * (k_scale.x * score_scale), s1 = (c0[1] + c1[1]) * (k_scale.y * score_scale);
    float mx = fmaxf(valid0 ? s0 : kAttnFloor, valid1 ? s1 : kAttnFloor);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    const float corr = exp2f(m - m_new);
    const float p0 = valid0 ? exp2f(s0 - m_new) : 0.f, p1 = valid1 ? exp2f(s1 - m_new) : 0.f;
    l = l * corr + p0 + p1;
    m = m_new;
    // FP8: the weights of P . V are exp2(score + log2(V's scale) - m_v), under a running max of their own.
    float w0 = p0, w1 = p1, acc_corr = corr;
    if constexpr (kFp8) {
      const float u0 = valid0 ? s0 + __log2f(v_scale.x) : kAttnFloor, u1 = valid1 ? s1 + __log2f(v_scale.y) : kAttnFloor;
      float mu = fmaxf(u0, u1);
      mu = fmaxf(mu, __shfl_xor_sync(0xffffffffu, mu, 1));
      mu = fmaxf(mu, __shfl_xor_sync(0xffffffffu, mu, 2));
      const float m_v_new = fmaxf(m_v, mu);
      acc_corr = exp2f(m_v - m_v_new);
      w0 = valid0 ? exp2f(u0 - m_v_new) : 0.f;
      w1 = valid1 ? exp2f(u1 - m_v_new) : 0.f;
      m_v = m_v_new;
    }
    // Once the running max settles, the factor is exactly 1 for the whole warp: skip the rescaling then.
    if (__any_sync(0xffffffffu, acc_corr != 1.f)) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        acc[j][0] *= acc_corr;
        acc[j][1] *= acc_corr;
      }
    }
    if constexpr (kFp8) {
      // B's column g_row of tile j is dimension g_row * NT + j: NT consecutive bytes of each of
      // this thread's two V rows give every tile.
      const uint32_t pa = paged_pack<__half>(w0, w1);
      constexpr int kWords = NT / 4, kChunk = NT < 16 ? NT : 16;  // bytes per load
      uint32_t va[kWords], vb[kWords];
#pragma unroll
      for (int c = 0; c < NT / kChunk; ++c) {
        const int byte = g_row * NT + c * kChunk;
        const unsigned char* v_rows = st + kPagedStage * kRowBytes;
        const unsigned char* r0 = v_rows + paged_fp8_offset<D>(pos, byte / 16) + byte % 16;
        const unsigned char* r1 = v_rows + paged_fp8_offset<D>(pos + 1, byte / 16) + byte % 16;
        if constexpr (kChunk == 16) {
          const uint4 x = *reinterpret_cast<const uint4*>(r0), y = *reinterpret_cast<const uint4*>(r1);
          va[4 * c] = x.x, va[4 * c + 1] = x.y, va[4 * c + 2] = x.z, va[4 * c + 3] = x.w;
          vb[4 * c] = y.x, vb[4 * c + 1] = y.y, vb[4 * c + 2] = y.z, vb[4 * c + 3] = y.w;
        } else {
          static_assert(kChunk == 8, "D = 64 or a multiple of 128");
          const uint2 x = *reinterpret_cast<const uint2*>(r0), y = *reinterpret_cast<const uint2*>(r1);
          va[2 * c] = x.x, va[2 * c + 1] = x.y;
          vb[2 * c] = y.x, vb[2 * c + 1] = y.y;
        }
      }
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        uint32_t b[4];  // tiles 4w .. 4w + 3: (position 2 quad, position 2 quad + 1) of each
        paged_e4m3x4(__byte_perm(va[w], vb[w], 0x5140), b[0], b[1]);
        paged_e4m3x4(__byte_perm(va[w], vb[w], 0x7362), b[2], b[3]);
#pragma unroll
        for (int t = 0; t < 4; ++t) paged_mma_k8<__half>(acc[4 * w + t], pa, b[t]);
      }
    } else {
      const uint32_t pa = paged_pack<T>(p0, p1);
#pragma unroll
      for (int j = 0; j < NT; j += 4) {
        uint32_t vb[4];
        const int chunk = j + my_mat;  // output tiles j .. j + 3
        paged_ldmatrix_x4_trans(vb, paged_smem_addr(vs + paged_stage_offset<D>(my_row, chunk)));
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          paged_mma_k8<T>(acc[j + t], pa, vb[t]);
        }
      }
    }
  }
  clock.mark(3);

  // Into attn_finish's arrays, which take the ring's place once every copy has landed.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  paged_cp_async_wait<0>();
  __syncthreads();
  float* sm_m = reinterpret_cast<float*>(paged_smem);
  float* sm_l = sm_m + kAttnWarps * G;
  float* sm_acc = sm_l + kAttnWarps * G;
  float* blk_m = sm_acc + kAttnWarps * G * D;
  float* blk_l = blk_m + G;
  float* blk_acc = blk_l + G;
  if (g_row < G) {
    if (quad == 0) {
      sm_m[warp * G + g_row] = m / kLog2e;
      sm_l[warp * G + g_row] = l;
    }
    float* out = sm_acc + (warp * G + g_row) * D;
    if constexpr (kFp8) {
      // Column c of every tile is NT consecutive dimensions, (2 quad + c) NT onwards: groups of four,
      // each stored as one float4 where attn_acc_index puts it.
      const float back = exp2f(m_v - m);  // acc relative to the softmax's max
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int j = 0; j < NT; j += 4) {
          const int first = (2 * quad + c) * NT + j;
          *reinterpret_cast<float4*>(out + attn_acc_index<D, true>(g_row, first)) =
              make_float4(acc[j][c] * back, acc[j + 1][c] * back, acc[j + 2][c] * back, acc[j + 3][c] * back);
        }
    } else {
#pragma unroll
      for (int j = 0; j < NT; ++j)
        *reinterpret_cast<float2*>(out + out_dim(j, 0)) = make_float2(acc[j][0], acc[j][1]);
    }
  }
  attn_finish<T, D, G, kFp8>(a, b, h, sm_m, sm_l, sm_acc, blk_m, blk_l, blk_acc, clock);
}

}  // namespace switchyard
