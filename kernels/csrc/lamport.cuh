// Flag-free exchange for the one-shot and fused kernels: the data carries its own arrival.
//
// Every word of a one-shot slot that holds no data is kEmpty (all bits set). All-ones is a NaN in
// every supported dtype (f32 0xFFFFFFFF, bf16/f16 0xFFFF), and a writer never stores it: a data
// word that happens to be all-ones is first rewritten with its top bit cleared, which is still a
// NaN (canonical_pack), so sums keep their meaning and every rank sums the same bits. A reader
// spins on its own local slot until no word of the pack is empty, then stores kEmpty back, so the
// slot is empty again before any writer can reuse it.
//
// Why this needs no barrier, and why two halves (selected by epoch parity) are enough:
//  - readiness: a 32-bit aligned store is single-copy atomic, so a word is either all-ones (not
//    yet arrived) or the writer's value; a pack is taken only once all its words have arrived;
//  - reuse: launch e writes half e&1 of every peer. A writer can write that half again at launch
//    e+2 only after it finished launch e+1, which needed our launch-(e+1) data, which we store only
//    after our launch e completed (stream order), i.e. after every slot we read in launch e was
//    emptied. Our empties and the writer's later stores both land in our own memory, ordered by
//    that chain of causality.
// Against the barrier version this drops the release fence (which waits for every NVLink store
// to be acknowledged) and the flag's separate trip: a reader waits exactly one one-way NVLink
// latency after the writer's store.
#pragma once
#include <string.h>

#include <type_traits>

#include "common.cuh"

namespace switchyard {

constexpr uint32_t kEmptyWord = 0xFFFFFFFFu;
constexpr unsigned char kEmptyByte = 0xFF;  // the init/reset fill of the one-shot area

// Loads and stores that reach L2 on every access (never served from a stale L1 line).
template <typename T, int W>
__device__ __forceinline__ Pack<T, W> ld_volatile(const Pack<T, W>* p) {
  Pack<T, W> r;
  if constexpr (sizeof(r) == 16) {
    uint32_t a, b, c, d;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p) : "memory");
    const uint32_t w[4] = {a, b, c, d};
    memcpy(&r, w, 16);
  } else if constexpr (sizeof(r) == 4) {
    uint32_t a;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(a) : "l"(p) : "memory");
    memcpy(&r, &a, 4);
  } else {
    static_assert(sizeof(r) == 2, "packs are 2, 4 or 16 bytes");
    unsigned short a;
    asm volatile("ld.volatile.global.u16 %0, [%1];" : "=h"(a) : "l"(p) : "memory");
    memcpy(&r, &a, 2);
  }
  return r;
}

template <typename T, int W>
__device__ __forceinline__ void st_volatile(Pack<T, W>* p, const Pack<T, W>& v) {
  if constexpr (sizeof(v) == 16) {
    uint32_t w[4];
    memcpy(w, &v, 16);
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
  } else if constexpr (sizeof(v) == 4) {
    uint32_t a;
    memcpy(&a, &v, 4);
    asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(a) : "memory");
  } else {
    unsigned short a;
    memcpy(&a, &v, 2);
    asm volatile("st.volatile.global.u16 [%0], %1;" ::"l"(p), "h"(a) : "memory");
  }
}

// Words of a pack: 32-bit units, or one 16-bit unit for a single 2-byte element.
template <typename T, int W>
struct PackWords {
  static constexpr int kBytes = sizeof(Pack<T, W>);
  using Unit = typename std::conditional<kBytes >= 4, uint32_t, unsigned short>::type;
  static constexpr int kUnits = kBytes / sizeof(Unit);
  static constexpr Unit kEmpty = static_cast<Unit>(kEmptyWord);
  static constexpr Unit kTop = static_cast<Unit>(static_cast<Unit>(1) << (8 * sizeof(Unit) - 1));
};

template <typename T, int W>
__device__ __forceinline__ bool pack_empty(const Pack<T, W>& p) {
  using PW = PackWords<T, W>;
  typename PW::Unit u[PW::kUnits];
  memcpy(u, &p, sizeof(p));
  bool empty = false;
#pragma unroll
  for (int i = 0; i < PW::kUnits; ++i) empty |= u[i] == PW::kEmpty;
  return empty;
}

// The pack as it is sent: an all-ones word (a NaN) becomes a NaN with the top bit cleared.
template <typename T, int W>
__device__ __forceinline__ Pack<T, W> canonical_pack(const Pack<T, W>& p) {
  using PW = PackWords<T, W>;
  typename PW::Unit u[PW::kUnits];
  memcpy(u, &p, sizeof(p));
#pragma unroll
  for (int i = 0; i < PW::kUnits; ++i)
    if (u[i] == PW::kEmpty) u[i] = static_cast<typename PW::Unit>(PW::kEmpty & ~PW::kTop);
  Pack<T, W> r;
  memcpy(&r, u, sizeof(r));
  return r;
}

template <typename T, int W>
__device__ __forceinline__ Pack<T, W> empty_pack() {
  Pack<T, W> r;
  memset(&r, kEmptyByte, sizeof(r));
  return r;
}

// Wait (bounded) until a peer's pack has arrived in our slot, take it, and empty the slot.
// `gave_up`: whether an earlier wait gave up, read once per thread at the kernel's start
// (timed_out_before) and set here on a timeout; reading the error word inside the wait would put
// a second L2 round trip between the first empty poll and the next. After a timeout it returns
// whatever is there: the launch's results are invalid and the host raises (common.cuh, "Bounded
// wait"). Threads of the same launch do not see each other's timeouts; each waits at most once.
template <typename T, int W>
__device__ __forceinline__ Pack<T, W> take_pack(Pack<T, W>* slot, const Peers& P, bool& gave_up) {
  Pack<T, W> v = ld_volatile(slot);
  if (pack_empty(v) && !gave_up) {
    const unsigned long long start = globaltimer();
    do {
      v = ld_volatile(slot);
      if (globaltimer() - start > P.timeout_ns) {
        record_timeout(P);
        gave_up = true;
        break;
      }
    } while (pack_empty(v));
  }
  st_volatile(slot, empty_pack<T, W>());
  return v;
}

}  // namespace switchyard
